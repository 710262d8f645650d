"""The shared decode coordinator over a mocker engine: fake children, a fake queue."""

from __future__ import annotations

import pytest

from .factories import SEED_POLICY, collect, coordinator, request, sample

pytestmark = [pytest.mark.unit, pytest.mark.asyncio]

DECISIONS = "splitserve_disagg_decisions_total"
FALLBACKS = "splitserve_disagg_fallbacks_total"


async def test_long_prompt_is_prefilled_remotely_then_resumed_on_the_decode_engine():
    coord, engines, queue = coordinator()
    chunks = await collect(coord, request(400, max_tokens=4))
    assert [c["token_ids"] for c in chunks] == [[7], [1000], [1001], [1002], []]
    assert chunks[-1]["finish_reason"] == "length"
    (job,) = queue.jobs
    assert job.handoff_subject == "splitserve.ns.decodeworker.handoff.abc"
    assert job.decode_worker_id == "abc" and len(job.token_ids) == 400
    (resumed,) = engines["decode"].requests
    assert resumed["stop_conditions"]["max_tokens"] == 3
    assert resumed["prefill_result"] == {"disaggregated_params": "dummy"}
    assert engines["local"].requests == []
    assert sample(coord, DECISIONS, where="remote", reason="min-score-met") == 1
    assert coord.inflight == 0 and coord.engine.tokens_in_flight == 0
    assert coord.inbox.waiting == 0


async def test_remote_request_of_one_token_needs_no_decode_engine():
    coord, engines, _ = coordinator()
    chunks = await collect(coord, request(400, max_tokens=1))
    assert [c["token_ids"] for c in chunks] == [[7]]
    assert chunks[-1]["finish_reason"] == "length"
    assert engines["decode"].requests == []


async def test_short_prompt_runs_on_the_local_aggregated_engine():
    coord, engines, queue = coordinator()
    chunks = await collect(coord, request(20, max_tokens=3))
    assert [c["token_ids"] for c in chunks] == [[1000], [1001], [1002], []]
    assert queue.jobs == [] and engines["decode"].requests == []
    assert "prefill_result" not in engines["local"].requests[0]
    assert sample(coord, DECISIONS, where="local", reason="below-min-score") == 1


@pytest.mark.parametrize(("answer", "prefill_workers", "decision", "fallback"), [
    ("full", 2, ("remote", "min-score-met"), "queue-full"),
    ("silence", 2, ("remote", "min-score-met"), "timeout"),
    ("duplicate", 2, ("remote", "min-score-met"), "queue-duplicate"),
    ("refused", 2, ("remote", "min-score-met"), "prefill-refused"),
    ("handoff", 0, ("local", "no-prefill-workers"), None),
])
async def test_every_failed_or_refused_offload_still_completes_locally(
        answer, prefill_workers, decision, fallback):
    coord, engines, _ = coordinator(answer=answer, prefill_workers=prefill_workers)
    chunks = await collect(coord, request(400, max_tokens=2))
    assert [c["token_ids"] for c in chunks] == [[1000], [1001], []]
    assert len(engines["local"].requests) == 1 and engines["decode"].requests == []
    where, reason = decision
    assert sample(coord, DECISIONS, where=where, reason=reason) == 1
    if fallback:
        assert sample(coord, FALLBACKS, reason=fallback) == 1
    assert coord.inbox.waiting == 0


async def test_a_request_the_queue_cannot_carry_falls_back_as_invalid_job():
    coord, _, queue = coordinator()
    req = request(400, max_tokens=2)
    req["sampling_options"]["top_p"] = 0.0  # outside (0, 1]: not a valid PrefillRequest
    chunks = await collect(coord, req)
    assert chunks[-1]["finish_reason"] == "length" and queue.jobs == []
    assert sample(coord, FALLBACKS, reason="invalid-job") == 1


@pytest.mark.parametrize("broken", [
    {"token_ids": []},
    {"stop_conditions": {"max_tokens": None}},
    {"stop_conditions": {"max_tokens": 0}},
])
async def test_requests_the_mocker_cannot_serve_are_refused_with_an_error_chunk(broken):
    coord, engines, _ = coordinator()
    chunks = await collect(coord, {**request(20), **broken})
    assert len(chunks) == 1 and chunks[0]["finish_reason"] == "error"
    assert engines["local"].requests == [] and coord.inflight == 0


async def test_snapshot_reads_own_load_and_the_prefill_pool():
    coord, _, _ = coordinator(prefill_workers=3)
    coord.inflight, coord.engine.tokens_in_flight = 5, 16 * 1638
    snap = coord.snapshot()
    assert (snap.decode_active_requests, snap.live_prefill_workers) == (5, 3)
    assert snap.decode_kv_usage == pytest.approx(0.1, abs=1e-3)  # 1638 of 16384 blocks


async def test_explain_answers_the_decision_without_acting():
    coord, engines, queue = coordinator()
    (answer,) = [a async for a in coord.explain({"token_ids": list(range(300))})]
    assert answer["decision"]["remote"] and answer["worker_id"] == 0xABC
    assert answer["request"]["prompt_length"] == 300
    assert queue.jobs == [] and engines["local"].requests == []


async def test_qos_local_prefill_flag_skips_the_decider():
    coord, engines, queue = coordinator()
    req = request(400, max_tokens=2)
    req["extra_args"]["splitserve"]["prefill_locally"] = True
    chunks = await collect(coord, req)
    assert chunks[-1]["finish_reason"] == "length" and queue.jobs == []
    assert len(engines["local"].requests) == 1
    assert sample(coord, DECISIONS, where="local", reason="qos-local-prefill") == 1


async def test_a_request_that_ended_at_its_first_token_is_answered_without_decoding():
    """The prefill engine's one token was EOS (TensorRT-LLM then hands no KV off): the
    decode worker answers that token and ends, neither decoding nor prefilling again."""
    coord, engines, queue = coordinator(answer="finished")
    chunks = await collect(coord, request(400, max_tokens=8))
    assert [c["token_ids"] for c in chunks] == [[2]]
    assert chunks[-1]["finish_reason"] == "eos"
    assert engines["decode"].requests == [] and engines["local"].requests == []
    assert len(queue.jobs) == 1 and coord.inbox.waiting == 0
    assert sample(coord, FALLBACKS, reason="timeout") == 0


@pytest.mark.parametrize(("options", "where", "reason"), [
    ({"sampling_options": {"top_k": 5, "repetition_penalty": 1.1}}, "remote",
     "min-score-met"),
    ({"output_options": {"logprobs": 2}}, "local", "sampling-local-prefill"),
    ({"sampling_options": {"guided_decoding": {"json": {"type": "object"}}}}, "local",
     "sampling-local-prefill"),
])
async def test_a_job_carries_the_sampling_but_not_logprobs_or_a_schema(options, where,
                                                                       reason):
    coord, _, queue = coordinator()
    req = request(400, max_tokens=2)
    for section, values in options.items():
        req[section] = {**(req.get(section) or {}), **values}
    chunks = await collect(coord, req)
    assert chunks[-1]["finish_reason"] == "length"
    assert sample(coord, DECISIONS, where=where, reason=reason) == 1
    if where == "remote":
        (job,) = queue.jobs
        assert (job.top_k, job.repetition_penalty) == (5, 1.1)
    else:
        assert queue.jobs == []


async def test_a_prompt_sharing_a_prefix_is_queued_for_the_worker_that_computed_it():
    from splitserve.components.disagg import PrefillAffinity
    from splitserve.contracts.prefill_queue import PrefillAffinityConfig

    coord, _, queue = coordinator()
    coord.affinity = PrefillAffinity(PrefillAffinityConfig(block_size=16))
    coord.live_prefill_ids = lambda: {"p1", "p2"}
    queue.ran_on = "p2"
    prefix = list(range(10, 410))
    first = request(500, request_id="r1")
    first["token_ids"] = prefix + list(range(5000, 5100))
    await collect(coord, first)
    second = request(500, request_id="r2")
    second["token_ids"] = prefix + list(range(6000, 6100))
    await collect(coord, second)
    unrelated = request(500, request_id="r3")
    unrelated["token_ids"] = list(range(7000, 7500))
    await collect(coord, unrelated)
    # the first went to the shared queue and ran on p2; the second shares its 400-token
    # prefix (25 whole blocks of 16) and is queued for p2; the third shares nothing
    assert queue.targets == [None, "p2", None]
    assert coord.affinity.held(coord.affinity.hashes(second["token_ids"]), "p2") == 31
    name = "splitserve_disagg_prefill_affinity_total"
    assert sample(coord, name, reason="held") == 1
    assert sample(coord, name, reason="no-prefix-held") == 2
    # `dynamo route explain` says where the job would be queued, without queueing it
    [answer] = [a async for a in coord.explain({"token_ids": second["token_ids"]})]
    assert answer["prefill_affinity"] == {"worker": "p2", "reason": "held",
                                          "held_tokens": 496}
    assert len(queue.jobs) == 3
    # a worker that went away is forgotten, its jobs go to the shared queue again
    coord.live_prefill_ids = lambda: {"p1"}
    queue.ran_on = "p1"
    await collect(coord, {**second, "request_id": "r4"})
    assert queue.targets[-1] is None and coord.affinity.workers() == {"p1": 31}


async def test_placements_and_computed_prompts_are_told_to_the_other_decode_workers():
    """prefill_affinity.share: a placement is told at once, a job from the shared queue
    when it comes back naming its worker, a held job only once; a peer that remembers
    what it is told queues the prompt's followers for the same worker."""
    from splitserve.components.disagg import PrefillAffinity, read_share, share_message
    from splitserve.contracts.prefill_queue import PrefillAffinityConfig

    coord, _, queue = coordinator()
    coord.affinity = PrefillAffinity(PrefillAffinityConfig(block_size=16))
    coord.live_prefill_ids = lambda: {"p1", "p2"}
    told: list[tuple[str, list[int]]] = []
    coord.share = lambda worker, hashes: told.append((worker, list(hashes)))
    queue.ran_on = "p2"
    prefix = list(range(10, 410))
    first = {**request(500, request_id="r1"), "token_ids": prefix + list(range(5000, 5100))}
    await collect(coord, first)
    # shared queue, ran on p2: told once it came back
    assert [w for w, _ in told] == ["p2"]
    assert told[0][1] == coord.affinity.hashes(first["token_ids"])
    second = {**request(500, request_id="r2"), "token_ids": prefix + list(range(6000, 6100))}
    await collect(coord, second)
    # queued for p2 (held) and ran there: told at the placement only
    assert queue.targets == [None, "p2"] and [w for w, _ in told] == ["p2", "p2"]
    # a peer decode worker that never saw the prompt learns it from the message
    peer, _, peer_queue = coordinator()
    peer.affinity = PrefillAffinity(PrefillAffinityConfig(block_size=16))
    peer.live_prefill_ids = lambda: {"p1", "p2"}
    origin, worker, hashes = read_share(share_message("d1", *told[0]))
    assert (origin, worker) == ("d1", "p2")
    peer.affinity.remember(worker, hashes)
    follower = {**request(500, request_id="r3"), "token_ids": prefix + list(range(8000, 8100))}
    await collect(peer, follower)
    assert peer_queue.targets == ["p2"]


async def test_the_shell_publishes_placements_and_remembers_only_the_other_workers():
    """``decode.share_affinity`` over a NATS double: what the coordinator tells goes out
    on the subject, a peer's message is remembered, this worker's own echo and an
    unreadable message are not, and a publish that fails (closed at shutdown) raises
    nowhere."""
    import asyncio
    from types import SimpleNamespace

    from splitserve.components.disagg import PrefillAffinity, share_message
    from splitserve.components.worker.decode import share_affinity
    from splitserve.contracts.prefill_queue import PrefillAffinityConfig

    class Nats:
        def __init__(self) -> None:
            self.sent: list[tuple[str, bytes]] = []
            self.cb = None
            self.closed = False

        async def subscribe(self, subject, cb):
            self.subject, self.cb = subject, cb

        async def publish(self, subject, data):
            if self.closed:
                raise ConnectionError("closed")
            self.sent.append((subject, data))

    coord, _, _ = coordinator()
    coord.affinity = PrefillAffinity(PrefillAffinityConfig(block_size=16))
    nc = Nats()
    await share_affinity(nc, coord, "splitserve.ns.decodeworker.prefill_affinity", "d1")
    assert nc.subject == "splitserve.ns.decodeworker.prefill_affinity"
    coord.share("p1", [1, 2, 3])
    await asyncio.sleep(0)
    assert nc.sent == [(nc.subject, share_message("d1", "p1", [1, 2, 3]))]
    await nc.cb(SimpleNamespace(data=share_message("d2", "p2", [4, 5])))
    await nc.cb(SimpleNamespace(data=share_message("d1", "p3", [6])))  # its own echo
    await nc.cb(SimpleNamespace(data=b"not json"))
    assert coord.affinity.workers() == {"p2": 2}
    name = "splitserve_disagg_prefill_affinity_shared_total"
    assert [sample(coord, name, direction=d) for d in ("sent", "received", "unreadable")] == [
        1, 1, 1]
    nc.closed = True
    coord.share("p1", [7])
    await asyncio.sleep(0.01)  # the failed publish is logged, not raised


@pytest.mark.parametrize("protect_tpot_ms", [50, None])
async def test_a_local_verdict_that_would_stall_an_answer_here_goes_remote(protect_tpot_ms):
    policy = {**SEED_POLICY, "protect_tpot_ms": protect_tpot_ms}
    coord, engines, queue = coordinator(disaggregated_router=policy)
    coord.queue_depth = lambda: 12  # a deep prefill queue: the seed's policy says local
    now = [0.0]
    coord.guard._now = lambda: now[0]
    coord.guard.observe_prefill(1000, 3.0)  # the prefill workers compute 3 ms a token
    # An answer prefilled here, 2 of 100 tokens at 40 ms: 3.96 s of 4.95 s allowed at 50 ms
    coord.guard.begin("a", 100, local=True)
    coord.guard.token("a", 1)
    now[0] = 0.04
    coord.guard.token("a", 1)
    (explained,) = [a async for a in coord.explain({"token_ids": list(range(400))})]
    chunks = await collect(coord, request(400, max_tokens=2))  # 1.2 s of prefill
    assert chunks[-1]["finish_reason"] == "length"
    if protect_tpot_ms is None:
        assert queue.jobs == [] and len(engines["local"].requests) == 1
        assert explained["decision"]["reason"] == "below-min-score"
        assert sample(coord, DECISIONS, where="local", reason="below-min-score") == 1
        return
    assert len(queue.jobs) == 1 and engines["local"].requests == []
    assert explained["decision"]["reason"] == "protects-decoding"
    assert explained["decision"]["contributions"]["answers_harmed"] == 1
    assert sample(coord, DECISIONS, where="remote", reason="protects-decoding") == 1
    # the prefill worker's report (400 tokens in 10 ms) taught the guard its speed
    assert coord.guard.seconds_per_token == pytest.approx(0.8 * 0.003 + 0.2 * 0.01 / 400)
    assert len(coord.guard) == 1  # the request's own answer is gone, "a" is still there


async def test_answers_are_tracked_while_they_stream_and_forgotten_after():
    coord, _, _ = coordinator(disaggregated_router={**SEED_POLICY, "protect_tpot_ms": 50})
    seen = []
    async for _chunk in coord.generate(request(20, max_tokens=3)):  # local
        seen.append(len(coord.guard))
    assert seen[0] == 1 and len(coord.guard) == 0
    await collect(coord, request(400, max_tokens=3))  # remote
    assert len(coord.guard) == 0 and coord.guard.step_s is not None


async def test_the_guards_prefill_speeds_are_in_the_workers_metrics():
    coord, _, _ = coordinator(disaggregated_router={**SEED_POLICY, "protect_tpot_ms": 50})
    name = "splitserve_disagg_prefill_seconds_per_token"
    assert sample(coord, name, source="prefill_workers") == 0
    await collect(coord, request(400, max_tokens=2))  # remote: 400 tokens in 10 ms
    assert sample(coord, name, source="prefill_workers") == pytest.approx(0.01 / 400)
    assert sample(coord, name, source="local") == 0


async def test_the_class_target_a_request_carries_is_protected_without_a_section_value():
    coord, engines, queue = coordinator()  # no protect_tpot_ms
    coord.queue_depth = lambda: 12
    coord.guard.observe_prefill(1000, 3.0)
    first = request(20, max_tokens=100, request_id="first")
    first["extra_args"]["splitserve"]["tpot_ms"] = 1.0  # a 1 ms target: any stall harms it
    stream = coord.generate(first)
    assert (await anext(stream))["token_ids"] == [1000]  # decoding, prefilled here
    await anext(stream)
    chunks = await collect(coord, request(400, max_tokens=2, request_id="second"))
    assert chunks[-1]["finish_reason"] == "length" and len(queue.jobs) == 1
    assert sample(coord, DECISIONS, where="remote", reason="protects-decoding") == 1
    await stream.aclose()
    assert len(coord.guard) == 0
