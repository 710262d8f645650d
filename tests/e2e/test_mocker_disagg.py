"""The disagg graph on Dynamo's mocker: 2 prefill + 2 decode simulated SGLang workers
with this project's router, offload decider and JetStream prefill queue in the path."""

from __future__ import annotations

import json
import time
from pathlib import Path

import openai
import pytest

from splitserve.contracts.kit.procs import pid_alive
from tests.graphs import start_graph
from tests.e2e.helpers import dynamo, metric

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
GRAPH = "graphs.disagg:Frontend"
CONFIG = "configs/mocker_disagg.yaml"
FAST = ("--DecodeWorker.engine_args.speedup_ratio=20",
        "--PrefillWorker.engine_args.speedup_ratio=20")
LONG = "Summarise the history of the printing press in Europe. " * 40  # ~450 tokens
SHORT = "hi"


def fleet_total(run, component: str, name: str, **labels: str) -> float:
    """A metric summed over every replica of ``component`` whose labels include ``labels``."""
    return sum(metric(replica["metrics"], name, **labels) for replica in run.replicas(component))


def engine_pids(run) -> set[int]:
    """The mocker children of every worker replica (read from /proc, Linux)."""
    pids = set()
    for component in ("DecodeWorker", "PrefillWorker"):
        for replica in run.replicas(component):
            path = Path(f"/proc/{replica['pid']}/task/{replica['pid']}/children")
            if path.exists():
                pids |= {int(p) for p in path.read_text().split()}
    return pids


def stop_and_check(run) -> None:
    children = engine_pids(run)
    run.seen_pids |= children  # kill_all's last resort covers them too
    assert run.stop() == 0, run.output()[-3000:]
    assert [p for p in children if pid_alive(p)] == []
    # every worker and mocker child registered a model without Dynamo's warning that it
    # keeps the model's metadata in etcd rather than on a system port it never opens
    assert "self_host_metadata" not in run.output()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    run, url = start_graph(tmp_path_factory.mktemp("mocker-disagg"), GRAPH, CONFIG, *FAST,
                           timeout_s=90)
    try:
        assert len(engine_pids(run)) == 2 * 2 + 2  # decode + local per decode, one per prefill
        yield run, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=30)
    finally:
        stop_and_check(run)


def test_openai_client_streaming_and_not(fleet):
    _, client = fleet
    for content in (SHORT, LONG):
        msgs = [{"role": "user", "content": content}]
        r = client.chat.completions.create(model=MODEL, max_tokens=8, messages=msgs)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
        chunks = list(client.chat.completions.create(model=MODEL, max_tokens=5, stream=True,
                                                     messages=msgs))
        assert chunks[-1].choices[0].finish_reason == "length"
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 1
    r = client.chat.completions.create(model=MODEL, max_tokens=1,
                                       messages=[{"role": "user", "content": LONG}])
    assert r.usage.completion_tokens == 1  # the prefill worker's token alone


def test_long_prompts_go_remote_and_short_ones_stay_local(fleet):
    run, client = fleet
    decisions = "splitserve_disagg_decisions_total"
    remote0 = fleet_total(run, "DecodeWorker", decisions, where="remote")
    local0 = fleet_total(run, "DecodeWorker", decisions, where="local",
                         reason="below-min-score")
    done0 = fleet_total(run, "PrefillWorker", "splitserve_prefill_jobs_total", outcome="done")
    for i in range(4):
        for content in (f"{i} {LONG}", f"{i} {SHORT}"):
            r = client.chat.completions.create(model=MODEL, max_tokens=4,
                                               messages=[{"role": "user", "content": content}])
            assert r.usage.completion_tokens == 4
    assert fleet_total(run, "DecodeWorker", decisions, where="remote") - remote0 == 4
    assert fleet_total(run, "DecodeWorker", decisions, where="local",
                       reason="below-min-score") - local0 == 4
    assert fleet_total(run, "PrefillWorker", "splitserve_prefill_jobs_total",
                       outcome="done") - done0 == 4
    assert fleet_total(run, "DecodeWorker", "splitserve_disagg_fallbacks_total") == 0
    # Round-robin routing spreads requests, so both decode workers decided some.
    assert all(metric(r["metrics"], decisions) > 0 for r in run.replicas("DecodeWorker"))


def test_a_repeated_prompt_is_queued_for_the_prefill_worker_that_computed_it(fleet):
    """Prefix affinity: the decode worker remembers which prefill worker ran a prompt and
    queues the next job of that prompt for it; that worker takes it from its own queue."""
    run, client = fleet
    affinity, taken = "splitserve_disagg_prefill_affinity_total", "splitserve_prefill_jobs_taken_total"
    held0 = fleet_total(run, "DecodeWorker", affinity, reason="held")
    own0 = fleet_total(run, "PrefillWorker", taken, queue="own")
    all0 = fleet_total(run, "PrefillWorker", taken)
    content = f"affinity {LONG}"
    for _ in range(4):  # each decode worker sees it at least twice, whatever the routing
        r = client.chat.completions.create(model=MODEL, max_tokens=2,
                                           messages=[{"role": "user", "content": content}])
        assert r.usage.completion_tokens == 2
    assert fleet_total(run, "DecodeWorker", affinity, reason="held") - held0 >= 2
    assert fleet_total(run, "PrefillWorker", taken, queue="own") - own0 >= 2
    assert fleet_total(run, "PrefillWorker", taken) - all0 == 4  # each job taken once
    # every placement is told to the other decode worker (prefill_affinity.share): with
    # two decode workers each message sent is received once, by the one that did not
    # send it
    shared = "splitserve_disagg_prefill_affinity_shared_total"
    deadline = time.monotonic() + 10
    while True:
        sent = fleet_total(run, "DecodeWorker", shared, direction="sent")
        received = fleet_total(run, "DecodeWorker", shared, direction="received")
        if (sent > 0 and received == sent) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sent >= 4 and received == sent
    assert fleet_total(run, "DecodeWorker", shared, direction="unreadable") == 0


def test_latency_by_pool_on_the_workers_and_in_dynamo_status(fleet):
    """Each pool's TTFT and ITL (decode workers) and prefill queue wait, compute and KV
    transfer (prefill workers) are labelled by pool and model, and `dynamo status
    --latency --json` reads quantiles for each pool and the frontend's model."""
    run, client = fleet
    for content in (f"latency {LONG}", f"latency {SHORT}"):
        chunks = list(client.chat.completions.create(
            model=MODEL, max_tokens=6, stream=True,
            messages=[{"role": "user", "content": content}]))
        assert chunks[-1].choices[0].finish_reason == "length"
    stages = {"DecodeWorker": ("ttft", "itl"),
              "PrefillWorker": ("prefill_queue_wait", "prefill_compute", "kv_transfer")}
    series = {"ttft": "splitserve_pool_ttft_seconds", "itl": "splitserve_pool_itl_seconds",
              "prefill_queue_wait": "splitserve_pool_prefill_queue_wait_seconds",
              "prefill_compute": "splitserve_pool_prefill_compute_seconds",
              "kv_transfer": "splitserve_pool_kv_transfer_seconds"}
    for pool, names in stages.items():
        for name in names:
            count = fleet_total(run, pool, f"{series[name]}_count", pool=pool, model=MODEL)
            assert count >= 1, (pool, name)
    res = dynamo(run, "status", "--latency", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["unreadable"] == [] and "upper bound" in out["quantiles"]
    rows = {(r["pool"], r["model"]): r for r in out["pools"]}
    assert set(rows) == {("DecodeWorker", MODEL), ("PrefillWorker", MODEL)}
    for pool, names in stages.items():
        for name in names:
            q = rows[(pool, MODEL)][name]
            assert q["count"] >= 1 and 0 < q["p50"] <= q["p95"] <= q["p99"], (pool, name, q)
    front = {r["model"]: r for r in out["frontend"]}
    assert front[MODEL]["ttft"]["count"] >= 2 and front[MODEL]["itl"]["p50"] is not None


def test_without_prefill_workers_long_prompts_complete_locally(tmp_path):
    run, url = start_graph(tmp_path, GRAPH, CONFIG, *FAST, "--PrefillWorker.replicas=0",
                           "--DecodeWorker.replicas=1", timeout_s=90)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=30)
        r = client.chat.completions.create(model=MODEL, max_tokens=6,
                                           messages=[{"role": "user", "content": LONG}])
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
        assert fleet_total(run, "DecodeWorker", "splitserve_disagg_decisions_total",
                           where="local", reason="no-prefill-workers") == 1
        assert fleet_total(run, "DecodeWorker", "splitserve_disagg_decisions_total",
                           where="remote") == 0
    finally:
        stop_and_check(run)
