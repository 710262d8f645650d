"""Disaggregated vLLM (the CPU build): a decode and a prefill engine, KV pulled over NIXL.

Equality: with remote prefill forced, greedy outputs equal the aggregated vLLM graph's on
20 prompts (8 share a long prefix), every prefill was remote, and every read finished
inside the prefill engine's KV lease; a request with ``min_tokens`` is prefilled remotely
too.  Faults: a killed prefill worker leaves requests completing; a client leaving
mid-stream frees the decode engine's request.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import signal
import time
from pathlib import Path

import openai
import pytest

from splitserve.contracts.kit.procs import pid_alive
from tests.graphs import start_graph
from tests.e2e.helpers import fleet
from tests.e2e.prompts import FORCED, MODEL, PROMPTS, QUESTIONS
from tests.integration.serve_helpers import descendants, wait_until
from tests.installed import needs_vllm

pytestmark = [pytest.mark.e2e, pytest.mark.deep, pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.exclusive, needs_vllm]

MAX_TOKENS = 8  # short answers: the module stays within a few minutes


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=180)


def ask(url: str, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    with client(url) as c:
        r = c.chat.completions.create(model=MODEL, temperature=0, max_tokens=max_tokens,
                                      messages=[{"role": "user", "content": prompt}])
    return r.choices[0].message.content


@pytest.fixture(scope="module")
def expected(vllm_agg) -> list[str]:
    """The aggregated vLLM graph's greedy answers (the same engine, prefilling itself)."""
    _, url = vllm_agg
    return [ask(url, p) for p in PROMPTS]


@pytest.fixture(scope="module")
def vllm_disagg(tmp_path_factory):
    run, url = start_graph(tmp_path_factory.mktemp("vllm-disagg"), "graphs.disagg:Frontend",
                           "configs/vllm_disagg.yaml", FORCED,
                           "--DecodeWorker.remote_prefill_timeout_s=60",
                           "--Common.restart.backoff_initial_s=0.1",
                           # two vLLM engines stopping on 2 busy cores take ~6 s each
                           "--Common.shutdown_timeout_s=90", timeout_s=600)
    yield run, url
    assert run.stop(timeout_s=90) == 0, run.output()[-3000:]


@pytest.fixture(scope="module")
def disagg_answers(vllm_disagg) -> list[str]:
    """The 20 prompts answered once through the disaggregated graph, remote prefill
    forced, one after another, with their latencies printed.  Shared by the equality
    test and the lease test below."""
    _, url = vllm_disagg
    out: list[str] = []
    took: list[float] = []
    for p in PROMPTS:
        t0 = time.monotonic()
        out.append(ask(url, p))
        took.append(round(time.monotonic() - t0, 1))
    print("sequential remote-prefill requests (s):", took)
    return out


def test_remote_prefill_outputs_equal_aggregated(expected, disagg_answers, vllm_disagg):
    """Every answer equals the aggregated graph's and every request was prefilled
    remotely."""
    # expected first: its answers are read before the disaggregated graph starts
    run, _ = vllm_disagg
    assert disagg_answers == expected
    decisions = fleet(run, "DecodeWorker", "splitserve_disagg_decisions_total")
    assert decisions == {(("reason", "forced-remote"), ("where", "remote")): len(PROMPTS)}


def test_no_remote_read_outlives_the_prefill_lease(disagg_answers, vllm_disagg):
    """Every read finished inside the prefill engine's KV lease (vLLM logs an expiry and,
    for a read after it, 'Potentially invalid KV blocks'), no request fell back to local
    prefill, and every prefill job was done.  This failed while vLLM's NIXL worker put
    the decode engine's model thread on the prefill engine's core (docs/engines.md)."""
    run, _ = vllm_disagg
    assert fleet(run, "DecodeWorker", "splitserve_disagg_fallbacks_total") == {}
    log = run.output()
    assert "Potentially invalid KV blocks" not in log
    assert "Releasing expired KV blocks" not in log
    jobs = fleet(run, "PrefillWorker", "splitserve_prefill_jobs_total")
    assert jobs == {(("outcome", "done"),): len(PROMPTS)}


def test_min_tokens_is_prefilled_remotely_as_fast_as_without(disagg_answers, vllm_disagg):
    """A request whose ``min_tokens`` exceeds the job's one token is prefilled remotely
    like any other.  vLLM refused such a job (min_tokens > max_tokens=1) on every
    delivery, and the request waited out the remote-prefill timeout before its decode
    worker prefilled it itself."""
    run, url = vllm_disagg
    done = (("outcome", "done"),)
    before = fleet(run, "PrefillWorker", "splitserve_prefill_jobs_total").get(done, 0)

    def timed(question: str, **extra) -> tuple[float, int]:
        t0 = time.monotonic()
        with client(url) as c:
            r = c.chat.completions.create(
                model=MODEL, temperature=0, max_tokens=MAX_TOKENS, extra_body=extra,
                messages=[{"role": "user", "content": question}])
        return time.monotonic() - t0, r.usage.completion_tokens

    plain, _ = timed(QUESTIONS[1])
    with_min, produced = timed(QUESTIONS[2], min_tokens=5)
    assert produced >= 5
    assert fleet(run, "DecodeWorker", "splitserve_disagg_fallbacks_total") == {}
    assert fleet(run, "PrefillWorker", "splitserve_prefill_jobs_total") == {
        done: before + 2}
    assert with_min < 2 * plain + 5, (plain, with_min)  # not the 60 s timeout


def model_thread_cores(replica_pid: int) -> str:
    """The cores vLLM's worker process below a replica may run its main thread on (the
    thread that runs the model and polls the engine core's step queue)."""
    for pid in descendants(replica_pid):
        with contextlib.suppress(FileNotFoundError):
            status = dict(line.split(":\t", 1) for line in
                          Path(f"/proc/{pid}/status").read_text().splitlines()
                          if ":\t" in line)
            if status["Name"].strip() == "VLLM::Worker":
                return status["Cpus_allowed_list"].strip()
    raise AssertionError(f"no vLLM worker process below {replica_pid}")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the config pins cores 0 and 1")
def test_each_engines_model_thread_stays_on_its_configured_core(vllm_disagg):
    """vLLM's NIXL worker moves the model thread to a core it reserves for transfers
    (core 1 here, the prefill engine's); the project's connector puts it back.  With
    both model threads on core 1 the decode engine was starved (docs/engines.md)."""
    run, _ = vllm_disagg
    decode = next(r["pid"] for r in run.replicas("DecodeWorker") if r["state"] == "ready")
    prefill = next(r["pid"] for r in run.replicas("PrefillWorker") if r["state"] == "ready")
    assert (model_thread_cores(decode), model_thread_cores(prefill)) == ("0", "1")


def test_cancel_mid_stream_frees_the_decode_engines_request(vllm_disagg):
    run, url = vllm_disagg
    metrics = run.replicas("DecodeWorker")[0]["metrics"]
    running = "splitserve_worker_running_requests"

    def gauge() -> float:
        return fleet(run, "DecodeWorker", running).get((), 0.0)

    cancelled = (("outcome", "cancelled"),)
    before = fleet(run, "DecodeWorker", "splitserve_worker_requests_total").get(cancelled, 0.0)
    with client(url) as c:  # closed on every path: a socket left open fails a later test
        stream = c.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=1500, stream=True,
            messages=[{"role": "user", "content": "Count from 1 to 1000, one number a line."}])
        got = 0
        for ch in stream:
            got += bool(ch.choices and ch.choices[0].delta.content)
            if got >= 3:
                break
        assert metrics and gauge() >= 1  # the decode engine holds the request meanwhile
        stream.close()  # ~1,500 tokens (minutes) still to come
    # The frontend stops the request's context; the decode worker races its stream
    # against that stop and aborts the engine's request at once (the load report that
    # carries the gauge comes every second).
    t0 = time.monotonic()
    wait_until(lambda: gauge() == 0, 30, interval_s=0.5, what="decode engine request freed")
    print(f"decode engine request freed {time.monotonic() - t0:.1f}s after the client left")
    # counted against the module's graph, shared with the other tests
    assert fleet(run, "DecodeWorker", "splitserve_worker_requests_total").get(
        cancelled) == before + 1


def test_killed_prefill_worker_requests_still_complete(expected, vllm_disagg):
    """The prefill worker is SIGKILLed just after its first handoff of two jobs.

    The decode engine may still be reading that job's KV from the dead engine (vLLM then
    recomputes the lost blocks itself: ``on_load_failure: recompute``); the other job is
    lost with the worker and is either redelivered to the restarted worker or prefilled
    by the decode engine after ``remote_prefill_timeout_s``.  Either way both answers
    equal the aggregated graph's."""
    run, url = vllm_disagg
    pid = next(r["pid"] for r in run.replicas("PrefillWorker") if r["state"] == "ready")
    engine_pids = descendants(pid)
    assert engine_pids  # vLLM's engine core and worker processes
    run.seen_pids |= set(engine_pids)  # the run's last-resort clean-up covers them
    done = (("outcome", "done"),)

    def jobs_done() -> float:
        return fleet(run, "PrefillWorker", "splitserve_prefill_jobs_total").get(done, 0)

    before = jobs_done()
    picked = [12, 13]  # two of the prompts sharing the long prefix
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(ask, url, PROMPTS[i]) for i in picked]
        wait_until(lambda: jobs_done() > before, 120, interval_s=0.01,
                   what="the prefill worker's first handoff")
        os.kill(pid, signal.SIGKILL)
        answers = [f.result(timeout=300) for f in futs]
    assert answers == [expected[i] for i in picked]
    assert time.monotonic() - t0 < 300
    # A SIGKILLed worker leaves vLLM's engine core running (re-parented to init) and
    # holding the replica's output pipe; the supervisor kills them (the replica's process
    # group) 2 s after the replica's own exit.  Killing them here as well keeps the test
    # independent of that grace.
    for child in engine_pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    wait_until(lambda: any(r["state"] == "ready" and r["pid"] != pid
                           for r in run.replicas("PrefillWorker")), 300, interval_s=1,
               what="prefill worker restarted")
    assert not any(pid_alive(p) for p in engine_pids)
    assert "Paris" in ask(url, QUESTIONS[0], 16)
