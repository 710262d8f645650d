"""What TensorRT-LLM (1.3.0rc29, as Dynamo 1.6.1 drives it) needs from the adapter, each
checked against the LLM double (which fails where the LLM fails) and, where Dynamo's
installed worker states the fact, against that source, so a drift fails here."""

from __future__ import annotations

import ast
import asyncio
import threading

import pytest

from splitserve.contracts.engine import GenerateParams
from splitserve.contracts.wire import FinishReason
from splitserve.components.engines.trtllm.config import (
    TESTED_VERSION,
    TrtllmEngineArgs,
    check_version,
    llm_kwargs,
)
from splitserve.components.engines.trtllm.engine import TrtllmEngine
from splitserve.components.prefill_queue import PrefillRequest
from splitserve.components.worker.prefill_loop import job_params
from tests.fixtures.engine_doubles import LlmApiDouble, LlmDouble, SamplingParamsDouble, tokens_for
from tests.unit.engines.adapter_helpers import collect, started_trtllm
from tests.unit.engines.upstream import Source, dynamo_dist_metadata, dynamo_source

pytestmark = pytest.mark.unit

P = GenerateParams(token_ids=(3, 1, 4, 1, 5), max_tokens=7, temperature=0.0)


def dynamo_arg_map() -> set[str]:
    """The keys of the ``arg_map`` dict literal Dynamo builds ``LLM(**...)`` from."""
    src = dynamo_source("trtllm/workers/llm_worker.py")
    for node in ast.walk(src.tree()):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                and any(isinstance(t, ast.Name) and t.id == "arg_map" for t in node.targets)):
            return {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    pytest.fail(f"{src.label}: its arg_map dict literal is gone; upstream changed",
                pytrace=False)


def handler_source() -> Source:
    return dynamo_source("trtllm/request_handlers/handler_base.py")


def run(coro):
    return asyncio.run(coro)


# ---- T1: end_id ------------------------------------------------------------------------
def test_double_raises_like_the_llm_without_tokenizer_or_end_id():
    llm = LlmDouble("agg", {}, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="tokenizer is required to reset end_id"):
        llm.generate_async([1, 2], SamplingParamsDouble(max_tokens=2))
    # an explicit end_id is accepted even without a tokenizer
    llm.generate_async([1, 2], SamplingParamsDouble(max_tokens=2, end_id=7))


def test_tokenizer_is_kept_as_dynamo_keeps_it():
    assert "skip_tokenizer_init" not in dynamo_arg_map()
    for role in ("agg", "prefill", "decode"):
        assert not llm_kwargs(TrtllmEngineArgs(), role).get("skip_tokenizer_init")


def test_every_role_serves_a_request_with_the_llms_end_id_rules():
    async def go():
        states: dict = {}
        agg, pre, dec = (await started_trtllm("agg", states), await started_trtllm("prefill", states),
                         await started_trtllm("decode", states))
        expected = await collect(agg.generate("a", P))
        res = await pre.prefill("p", P)
        assert await collect(dec.decode("p", P, res.handoff)) == expected
        assert await collect(dec.generate("l", P)) == expected
    run(go())


# ---- T5: the context phase keeps ignore_eos and min_tokens -----------------------------
def test_prefill_job_carries_ignore_eos_and_min_tokens():
    req = PrefillRequest(request_id="r", token_ids=[1, 2], decode_worker_id="d",
                         enqueued_at=0.0, ignore_eos=True, min_tokens=4)
    p = job_params(req)
    # the one token of the context phase may not be a stop token: min_tokens 1 says so
    # (the job's 4 would be refused by vLLM and SGLang beside max_tokens 1)
    assert p.ignore_eos and p.min_tokens == 1 and p.max_tokens == 1


def test_prefill_jobs_without_the_new_fields_read_as_before():
    import json

    base = dict(request_id="r", token_ids=[1, 2], decode_worker_id="d", enqueued_at=0.0)
    plain = json.loads(PrefillRequest(**base).encode())
    assert "ignore_eos" not in plain and "min_tokens" not in plain  # older readers forbid them
    both = PrefillRequest.model_validate_json(
        PrefillRequest(**base, ignore_eos=True, min_tokens=2).encode())
    assert (both.ignore_eos, both.min_tokens) == (True, 2)


def test_context_phase_whose_token_is_a_stop_token_still_hands_off_with_ignore_eos():
    first = tokens_for(list(P.token_ids), 1)[0]
    stop_first = GenerateParams(token_ids=P.token_ids, max_tokens=1, stop_token_ids=(first,))

    async def go():
        pre = await started_trtllm("prefill", {})
        # its one token ended the request: no KV to hand off, the answer is complete
        # (round 2, finding 9: this raised, and the job was retried to exhaustion)
        done = await pre.prefill("stops", stop_first)
        # TensorRT-LLM names a stop token's end "stop", as EOS's
        assert (done.first_token, done.handoff, done.finished) == (first, None,
                                                                   FinishReason.EOS)
        for p in (GenerateParams(**{**stop_first.__dict__, "ignore_eos": True}),
                  GenerateParams(**{**stop_first.__dict__, "min_tokens": 1})):
            res = await pre.prefill(f"ok-{p.ignore_eos}", p)
            assert res.first_token == first
    run(go())


def test_dynamo_applies_stop_conditions_to_the_prefill_request():
    src = handler_source()
    i = src.find("apply_stop_conditions_to_sampling_params(\n")
    assert "DisaggregationMode.PREFILL" in src.text[i - 400:i], src.label


# ---- T2, T7: context requests -----------------------------------------------------------
def test_context_request_has_a_disagg_request_id_and_is_not_streamed():
    async def go():
        states: dict = {}
        pre, dec = await started_trtllm("prefill", states), await started_trtllm("decode", states)
        res = await pre.prefill("p", P)
        ctx = pre.llm.calls[-1]
        assert ctx["streaming"] is False
        rid = ctx["disaggregated_params"].disagg_request_id
        assert isinstance(rid, int)
        await collect(dec.decode("p", P, res.handoff))
        gen = dec.llm.calls[-1]
        assert gen["disaggregated_params"].disagg_request_id == rid
        assert gen["streaming"] is True
    run(go())


def test_dynamo_sets_disagg_request_id_and_no_streaming_on_prefill():
    handler_source().require(
        'request_type="context_only",\n                    disagg_request_id=',
        "False if self.disaggregation_mode == DisaggregationMode.PREFILL else True")


def test_double_refuses_what_the_llm_refuses():
    llm = LlmDouble("decode", {})
    from tests.fixtures.engine_doubles import DisaggregatedParamsDouble as D
    with pytest.raises(ValueError, match="Unknown request type"):
        llm.generate_async([1], SamplingParamsDouble(), D(request_type="prefill_only"))
    pre = LlmDouble("prefill", {})
    with pytest.raises(ValueError, match="disagg_request_id"):
        pre.generate_async([1], SamplingParamsDouble(max_tokens=1), D(request_type="context_only"))


# ---- T3: a generation request is aborted only after its first token --------------------
def test_abort_of_a_generation_request_waits_for_its_first_token():
    async def go():
        states: dict = {}
        pre, dec = await started_trtllm("prefill", states), await started_trtllm("decode", states)
        res = await pre.prefill("p", P)
        it = dec.decode("p", P, res.handoff)
        await dec.abort("p")  # the client left while the KV was arriving
        assert dec.inflight() == 0
        for _ in range(100):
            if dec.llm.aborted:
                break
            await asyncio.sleep(0.01)
        assert dec.llm.aborted and not dec.llm.aborted_mid_transfer
        await it.aclose()
        # a local (context_and_generation) request is aborted at once
        it2 = dec.generate("l", GenerateParams(token_ids=(1,), max_tokens=500))
        await dec.abort("l")
        assert len(dec.llm.aborted) == 2
        await it2.aclose()
    run(go())


def test_dynamo_defers_the_decode_abort():
    handler_source().require("class _DeferredAbort", "signal_first_token")


# ---- T4, T6, T8: LLM arguments ----------------------------------------------------------
def test_transfer_timeout_stats_and_overlap_scheduler():
    assert "enable_iter_perf_stats" in dynamo_arg_map()
    for role in ("agg", "prefill", "decode"):
        kw = llm_kwargs(TrtllmEngineArgs(kv_transfer_timeout_ms=5_000), role)
        assert kw["enable_iter_perf_stats"] is True
        if role != "agg":
            assert kw["cache_transceiver_config"]["kv_transfer_timeout_ms"] == 5_000
        assert kw.get("disable_overlap_scheduler", False) is (role == "prefill")
    with pytest.raises(ValueError, match="enable_iter_perf_stats"):
        TrtllmEngineArgs(extra_llm_args={"enable_iter_perf_stats": False})


def test_stats_need_the_flag_and_then_reach_load():
    llm = LlmDouble("agg", {})
    llm.generated = True
    llm.stats.append({"numActiveRequests": 1})

    async def drain(x):
        return [s async for s in x.get_stats_async()]
    assert run(drain(llm)) == []  # no flag, no stats (as the executor)

    async def go():
        eng = await started_trtllm("agg", {})
        await collect(eng.generate("first", P))  # the stats queue exists from here
        eng.llm.stats.append({"numActiveRequests": 2, "numQueuedRequests": 0,
                              "kvCacheStats": {"usedNumBlocks": 3, "maxNumBlocks": 9}})
        for _ in range(100):
            if eng.load().kv_total_blocks:
                break
            await asyncio.sleep(0.02)
        assert eng.load().kv_total_blocks == 9
        await eng.shutdown()
    run(go())


def test_only_the_tested_release_starts_unless_accepted():
    check_version(TESTED_VERSION, TrtllmEngineArgs())
    with pytest.raises(RuntimeError, match="accept_untested_version"):
        check_version("1.2.0", TrtllmEngineArgs())
    check_version("1.2.0", TrtllmEngineArgs(accept_untested_version=True))

    async def go():
        eng = TrtllmEngine(TrtllmEngineArgs(), "m", "agg",
                           api_factory=lambda: LlmApiDouble("agg", {}, version="1.4.0"))
        with pytest.raises(RuntimeError, match="1.4.0"):
            await eng.start()
    run(go())


def test_dynamo_pins_the_tested_release():
    assert f"tensorrt-llm=={TESTED_VERSION}" in dynamo_dist_metadata()


# ---- T9, T10 ----------------------------------------------------------------------------
def test_a_dead_executor_is_reported_as_failure():
    async def go():
        eng = await started_trtllm("agg", {})
        assert eng.failure() is None
        eng.llm._executor._fatal_error = RuntimeError("MPI rank died")
        assert "MPI rank died" in str(eng.failure())
    run(go())


def test_a_dead_executor_ends_the_serving_worker_with_its_error():
    """T9 through the worker shell: the failure watcher every worker runs beside its
    serving loop turns the dead executor into the error that ends the replica (the
    supervisor restarts it), while serving itself never returns."""
    from splitserve.contracts.kit.hosting import watch_failure
    from splitserve.components.worker.shell import serve_or_die

    async def go():
        eng = await started_trtllm("decode", {})
        serving = asyncio.get_running_loop().create_future()  # serves until stopped
        died = asyncio.ensure_future(watch_failure(eng, every_s=0.01))
        await asyncio.sleep(0.05)
        assert not died.done()  # a healthy executor keeps the worker serving
        eng.llm._executor._fatal_error = RuntimeError("MPI rank died")
        with pytest.raises(RuntimeError, match="MPI rank died"):
            await asyncio.wait_for(serve_or_die(serving, died), 5)
        assert not serving.done()
    run(go())


def test_llm_is_built_on_the_event_loop_thread():
    threads: list[threading.Thread] = []

    class Api(LlmApiDouble):
        def make_llm(self, **kw):
            threads.append(threading.current_thread())
            return super().make_llm(**kw)

    async def go():
        eng = TrtllmEngine(TrtllmEngineArgs(), "m", "agg", api_factory=lambda: Api("agg", {}))
        await eng.start()
        return threading.current_thread()
    assert threads == [] and run(go()) is threads[0]


# ---- round 2, finding 11: the prefix hit lives on RequestOutput --------------------------
def test_dynamos_worker_reads_the_prefix_hit_from_the_request_output():
    src = dynamo_source("trtllm/request_handlers/handler_base.py")
    assert "engine_reported = int(res.cached_tokens or 0)" in src.after(
        "def _prompt_tokens_details", 300)
    assert "_prompt_tokens_details(\n" in src.text and "res, num_input_tokens" in src.text


def test_usage_reports_the_request_outputs_prefix_hit():
    from splitserve.components.engines.trtllm.requests import DeltaCursor
    from tests.fixtures.engine_doubles import _Completion, _Output

    out = _Output([_Completion([7, 8], "stop")], True, [1, 2, 3, 4], cached_tokens=2)
    delta = DeltaCursor().delta(out)
    assert delta.cached_tokens == 2 and delta.token_ids == (7, 8)
    assert DeltaCursor().delta(_Output([], True, [1])).cached_tokens == 0


# ---- round 2, finding 4: events and stats exist after the first request ------------------
def test_dynamo_starts_its_publisher_at_the_first_output():
    src = handler_source()
    i = src.find("self.publisher.start()")
    assert "if self.first_generation and self.publisher:" in src.text[i - 200:i], src.label


def test_nothing_is_polled_before_the_first_request_and_the_relay_survives():
    async def go():
        eng = await started_trtllm("agg", {})
        got: list = []
        relay = asyncio.ensure_future(eng.run_kv_events(got.extend))
        await asyncio.sleep(0.3)  # several poll periods before any request
        assert not relay.done() and eng.llm.early_stats_polls == 0
        bs = eng.args.tokens_per_block
        eng.llm.events.append({"event_id": 1, "data": {
            "type": "stored", "parent_hash": None,
            "blocks": [{"block_hash": 5, "tokens": [{"token_id": t} for t in range(bs)]}]}})
        await collect(eng.generate("first", P))
        for _ in range(100):
            if got:
                break
            await asyncio.sleep(0.02)
        assert got and got[0].block_hashes == (5,) and not relay.done()
        relay.cancel()
        await asyncio.gather(relay, return_exceptions=True)
        await eng.shutdown()
    run(go())


# ---- round 2, finding 12: a partial block's removal is not passed on ----------------------
def test_dynamo_drops_the_removal_of_partial_blocks():
    src = dynamo_source("trtllm/publisher.py")
    removed = src.after('elif data["type"] == "removed":', 600)
    assert "if block_hash in self.partial_block_hashes:" in removed, src.label


def test_the_relay_removes_only_blocks_it_announced():
    from splitserve.components.engines.zmq_relay import block_hash
    from splitserve.contracts.block_events import BlockRemoved, BlockStored

    async def go():
        eng = await started_trtllm("agg", {})
        await collect(eng.generate("first", P))
        bs = eng.args.tokens_per_block
        eng.llm.events += [
            {"event_id": 1, "data": {"type": "stored", "parent_hash": None, "blocks": [
                {"block_hash": 7, "tokens": [{"token_id": t} for t in range(bs)]},
                {"block_hash": 8, "tokens": [{"token_id": 1}]}]}},  # partial
            {"event_id": 2, "data": {"type": "removed", "block_hashes": [7, 8]}}]
        got: list = []
        relay = asyncio.ensure_future(eng.run_kv_events(got.extend))
        for _ in range(100):
            if len(got) >= 2:
                break
            await asyncio.sleep(0.02)
        relay.cancel()
        await asyncio.gather(relay, return_exceptions=True)
        assert [type(e) for e in got] == [BlockStored, BlockRemoved]
        assert got[0].block_hashes == got[1].block_hashes == (block_hash(7),)
        await eng.shutdown()
    run(go())
