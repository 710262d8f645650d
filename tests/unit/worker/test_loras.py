"""A worker's LoRA adapters: the wire's adapter reaching the engine, refusals by name,
and ``AdapterSet`` keeping an engine in line with etcd's records (a fake engine that
behaves as the contract says: tests/unit/worker/lora_engine.py)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from splitserve.components.worker.agg import make_handler
from splitserve.components.worker.coordinator import check_adapter_prefill, job_carries
from splitserve.components.worker.loras import AdapterSet, Step, plan_steps, static_records
from splitserve.components.worker.wire import check_adapter, params_from_wire
from splitserve.contracts.kit.loras import LoraRecord, LoraStatus
from splitserve.contracts.kit.worker_metrics import WorkerMetrics
from splitserve.contracts.wire import WorkerRequest, worker_request
from tests.unit.worker.lora_engine import FakeLoraEngine, adapter_dir

pytestmark = pytest.mark.unit


def wire(lora: str | None = None) -> dict:
    return worker_request(model="base", token_ids=[1, 2, 3], max_tokens=4, temperature=0.0,
                          top_p=None, seed=None, eos_token_ids=[2], request_id="r",
                          priority="default", lora=lora)


# ---- the wire ---------------------------------------------------------------------------

def test_the_wires_adapter_is_the_engines_lora():
    assert wire("sql")["extra_args"]["splitserve"]["lora"] == "sql"
    assert params_from_wire(WorkerRequest.model_validate(wire("sql"))).lora == "sql"
    assert params_from_wire(WorkerRequest.model_validate(wire())).lora is None


def test_an_engine_without_lora_refuses_an_adapter_request_by_name():
    params = params_from_wire(WorkerRequest.model_validate(wire("sql")))
    with pytest.raises(ValueError, match="'sql'.*the fake engine serves no LoRA"):
        check_adapter(params, FakeLoraEngine(serves=False).info)
    check_adapter(params, FakeLoraEngine().info)  # one that serves LoRA: validate decides
    check_adapter(params_from_wire(WorkerRequest.model_validate(wire())),
                  FakeLoraEngine(serves=False).info)


@pytest.mark.parametrize(("serves", "lora", "refusal"), [
    (False, "sql", "request refused: the LoRA adapter 'sql' cannot be served: the fake "
                   "engine serves no LoRA adapters"),
    (True, "sql", "request refused: the LoRA adapter 'sql' is not loaded"),
    (False, None, None),
])
def test_the_aggregated_shell_refuses_before_anything_is_queued(serves, lora, refusal):
    handler = make_handler(FakeLoraEngine(serves=serves), WorkerMetrics())

    async def run():
        return [c async for c in handler(wire(lora))]

    chunks = asyncio.run(run())
    if refusal is None:
        assert chunks[-1]["finish_reason"] == "eos"
    else:
        assert chunks == [{"token_ids": [], "finish_reason": "error", "error": refusal}]


def test_an_adapter_request_the_prefill_pool_lacks_is_prefilled_where_it_decodes():
    params = params_from_wire(WorkerRequest.model_validate(wire("sql")))
    assert job_carries(params)  # the sampling alone would travel in a job...
    lacks, has = (lambda name: False), (lambda name: name == "sql")
    check_adapter_prefill(params, True, "fake", lacks)  # ...but it stays here
    with pytest.raises(ValueError, match="cannot prefill locally, and not every live "
                                         "prefill worker has the adapter loaded"):
        check_adapter_prefill(params, False, "sglang", lacks)
    check_adapter_prefill(params, False, "sglang", has)  # the prefill pool computes it


# ---- which engine calls ---------------------------------------------------------------------

PLANS = {
    "nothing to do": ({"a": "/a"}, {"a": "/a"}, {}, []),
    "load a new one": ({"a": "/a", "b": "/b"}, {"a": "/a"}, {},
                       [Step("load", "b", "/b")]),
    "unload a gone one": ({}, {"a": "/a"}, {}, [Step("unload", "a")]),
    "moved: unload, then load": ({"a": "/a2"}, {"a": "/a"}, {},
                                 [Step("unload", "a"), Step("load", "a", "/a2")]),
    "failed from this path: not again": ({"a": "/a"}, {}, {"a": "/a"}, []),
    "failed from another path: again": ({"a": "/a2"}, {}, {"a": "/a"},
                                        [Step("load", "a", "/a2")]),
    "unloads first, by name": ({"c": "/c"}, {"b": "/b", "a": "/a"}, {},
                               [Step("unload", "a"), Step("unload", "b"),
                                Step("load", "c", "/c")]),
}


@pytest.mark.parametrize(("wanted", "loaded", "failed", "steps"), PLANS.values(),
                         ids=PLANS.keys())
def test_plan_steps(wanted, loaded, failed, steps):
    assert plan_steps(wanted, loaded, failed) == steps


# ---- AdapterSet ---------------------------------------------------------------------------

class Published:
    """Records what the set publishes, as etcd would hold it."""

    def __init__(self) -> None:
        self.now: dict[str, LoraStatus] = {}

    async def __call__(self, name: str, status: LoraStatus | None) -> None:
        if status is None:
            self.now.pop(name, None)
        else:
            self.now[name] = status


def records(**paths) -> dict[str, LoraRecord]:
    return {n: LoraRecord(path=str(p), base_model="base") for n, p in paths.items()}


def test_the_engine_follows_the_records_and_each_status_is_published(tmp_path):
    engine, published = FakeLoraEngine(), Published()
    adapters = AdapterSet(engine, "Worker", published)
    a, b = adapter_dir(tmp_path, "a"), adapter_dir(tmp_path, "b")
    asyncio.run(adapters.apply(records(a=a, b=b)))
    assert engine.loras() == {"a": str(a), "b": str(b)}
    assert adapters.loaded() == ["a", "b"] and adapters.errors() == {}
    assert {n: s.state for n, s in published.now.items()} == {"a": "loaded", "b": "loaded"}
    asyncio.run(adapters.apply(records(b=b)))
    assert engine.loras() == {"b": str(b)} and set(published.now) == {"b"}


def test_a_bad_path_is_reported_and_the_replica_serves_on(tmp_path):
    engine, published = FakeLoraEngine(), Published()
    adapters = AdapterSet(engine, "Worker", published)
    good = adapter_dir(tmp_path, "good")
    asyncio.run(adapters.apply(records(good=good, bad=tmp_path / "missing")))
    assert adapters.loaded() == ["good"]
    assert "no adapter_config.json" in adapters.errors()["bad"]
    assert published.now["bad"].state == "failed"
    assert "no adapter_config.json" in published.now["bad"].error
    # the same records again: the failed load is not tried over and over
    engine.calls.clear()
    asyncio.run(adapters.apply(records(good=good, bad=tmp_path / "missing")))
    assert engine.calls == []
    # fixed under another path: tried again; removed: its status goes
    fixed = adapter_dir(tmp_path, "fixed")
    asyncio.run(adapters.apply(records(good=good, bad=fixed)))
    assert adapters.loaded() == ["bad", "good"] and adapters.errors() == {}
    asyncio.run(adapters.apply(records(good=good)))
    assert set(published.now) == {"good"}


def test_no_slot_left_is_a_failure_of_that_adapter_only(tmp_path):
    engine = FakeLoraEngine(slots=1)
    adapters = AdapterSet(engine, "Worker", Published())
    asyncio.run(adapters.apply(records(a=adapter_dir(tmp_path, "a"),
                                       b=adapter_dir(tmp_path, "b"))))
    assert adapters.loaded() == ["a"] and "no LoRA slot left" in adapters.errors()["b"]


def test_an_unload_waits_for_the_adapters_requests(tmp_path):
    engine, published = FakeLoraEngine(), Published()
    adapters = AdapterSet(engine, "Worker", published)
    a = adapter_dir(tmp_path, "a")
    asyncio.run(adapters.apply(records(a=a)))
    engine.busy["a"] = 1
    asyncio.run(adapters.apply({}))
    assert adapters.loaded() == ["a"] and adapters.busy == {"a"}
    asyncio.run(adapters.retry())  # still in use
    assert adapters.loaded() == ["a"]
    engine.busy["a"] = 0
    asyncio.run(adapters.retry())
    assert adapters.loaded() == [] and adapters.busy == set() and published.now == {}


def test_a_moved_adapter_is_not_loaded_over_its_busy_old_path(tmp_path):
    engine = FakeLoraEngine()
    adapters = AdapterSet(engine, "Worker", Published())
    old, new = adapter_dir(tmp_path, "old"), adapter_dir(tmp_path, "new")
    asyncio.run(adapters.apply(records(a=old)))
    engine.busy["a"] = 1
    asyncio.run(adapters.apply(records(a=new)))
    assert engine.loras() == {"a": str(old)}
    engine.busy["a"] = 0
    asyncio.run(adapters.retry())
    assert engine.loras() == {"a": str(new)}


def test_an_engine_without_lora_reports_every_adapter_unsupported(tmp_path):
    engine, published = FakeLoraEngine(serves=False), Published()
    adapters = AdapterSet(engine, "Worker", published)
    asyncio.run(adapters.apply(records(a=adapter_dir(tmp_path, "a"))))
    assert published.now["a"].state == "unsupported"
    assert published.now["a"].error == "the fake engine serves no LoRA adapters"
    assert adapters.loaded() == [] and "serves no LoRA" in adapters.errors()["a"]
    asyncio.run(adapters.apply({}))
    assert published.now == {}


def test_a_new_lease_gets_every_status_again(tmp_path):
    adapters = AdapterSet(FakeLoraEngine(), "Worker")  # etcd away: nothing published
    asyncio.run(adapters.apply(records(a=adapter_dir(tmp_path, "a"))))
    published = Published()
    adapters.publish = published
    asyncio.run(adapters.republish())
    assert published.now["a"].state == "loaded"


def test_a_failing_publish_does_not_stop_the_loads(tmp_path):
    async def broken(name, status):
        raise ConnectionError("etcd is down")

    adapters = AdapterSet(FakeLoraEngine(), "Worker", broken)
    asyncio.run(adapters.apply(records(a=adapter_dir(tmp_path, "a"))))
    assert adapters.loaded() == ["a"] and adapters.reported["a"].state == "loaded"


def test_static_adapters_are_config_records():
    got = static_records({"sql": "/adapters/sql"}, "base")
    assert got == {"sql": LoraRecord(path="/adapters/sql", base_model="base",
                                     source="config")}


# ---- the sections' loras ----------------------------------------------------------------

def test_a_sections_static_adapters_are_checked_before_anything_starts(tmp_path):
    from pydantic import ValidationError

    from splitserve.contracts.sections import EnginePrefillSection, WorkerCommon

    good = adapter_dir(tmp_path, "good")
    assert WorkerCommon(loras={"good": str(good)}).preflight() == []
    problems = WorkerCommon(loras={"typo": str(tmp_path / "nope")}).preflight()
    assert problems == [f"loras.typo: '{tmp_path / 'nope'}' is not a LoRA adapter "
                        "directory (no adapter_config.json)"]
    with pytest.raises(ValidationError, match="not a valid adapter name"):
        WorkerCommon(loras={"a/b": str(good)})
    with pytest.raises(ValidationError, match="a prefill worker loads the adapters its "
                                              "decode workers serve"):
        EnginePrefillSection(loras={"good": str(good)})


# ---- the decode coordinator ------------------------------------------------------------------

class RemoteAlways:
    """A decider that would offload every prompt."""

    def decide(self, request, snapshot):
        from splitserve.components.disagg import OffloadDecision

        return OffloadDecision(remote=True, reason="forced")


class NoQueue:
    def __init__(self) -> None:
        self.jobs: list = []

    async def enqueue(self, job) -> None:
        self.jobs.append(job)
        raise AssertionError("an adapter request must not be offloaded")


def decode_coordinator(engine, queue=None):
    from splitserve.components.worker.coordinator import (
        CoordinatorSettings,
        EngineDecodeCoordinator,
    )
    from splitserve.components.worker.disagg_metrics import DisaggMetrics
    from splitserve.components.worker.handoff import HandoffInbox

    metrics = WorkerMetrics()
    queue = NoQueue() if queue is None else queue
    coord = EngineDecodeCoordinator(
        engine, RemoteAlways(), queue, HandoffInbox(), "subject", 0xABC,
        live_prefill_workers=lambda: 2, queue_depth=lambda: 0,
        metrics=DisaggMetrics(metrics.registry), settings=CoordinatorSettings(),
        requests=metrics.requests)
    return coord, queue, metrics


def test_a_decode_worker_prefills_an_adapter_request_itself(tmp_path):
    engine = FakeLoraEngine()
    asyncio.run(engine.load_lora("sql", str(adapter_dir(tmp_path, "sql"))))
    coord, queue, metrics = decode_coordinator(engine)

    async def run(req):
        return [c async for c in coord.generate(req)]

    chunks = asyncio.run(run(wire("sql")))
    assert chunks[-1]["finish_reason"] == "eos" and chunks[-1]["token_ids"] == [3]
    assert queue.jobs == []
    assert metrics.registry.get_sample_value(
        "splitserve_disagg_decisions_total",
        {"where": "local", "reason": "lora-local-prefill"}) == 1
    # a decode engine that cannot prefill locally refuses it by name
    engine.info.capabilities = dataclasses.replace(engine.info.capabilities,
                                                   local_prefill=False)
    chunks = asyncio.run(run(wire("sql")))
    assert chunks[0]["finish_reason"] == "error"
    assert "'sql' cannot be served: the fake decode engine cannot prefill locally" in \
        chunks[0]["error"]


def test_explain_reads_the_adapters_own_prefix_cache(tmp_path):
    """An adapter's KV is its own: the explained prefix hit of an adapter request is the
    one the engine holds for that adapter, not the base model's."""
    engine = FakeLoraEngine()
    engine.info.capabilities = dataclasses.replace(engine.info.capabilities,
                                                   prefix_lookup=True)
    asked: list[tuple[tuple[int, ...], str | None]] = []

    async def cached_prefix_tokens(token_ids, lora=None):
        asked.append((tuple(token_ids), lora))
        return 16 if lora is None else 0

    engine.cached_prefix_tokens = cached_prefix_tokens
    coord, _, _ = decode_coordinator(engine)

    async def explain(lora):
        return [c async for c in coord.explain({"token_ids": list(range(1, 33)),
                                                "lora": lora})][-1]

    base, adapter = asyncio.run(explain(None)), asyncio.run(explain("sql"))
    assert asked == [(tuple(range(1, 33)), None), (tuple(range(1, 33)), "sql")]
    assert base["request"]["prefix_cached_length"] == 16
    assert adapter["request"]["prefix_cached_length"] == 0
    assert adapter["decision"]["reason"] == "lora-local-prefill"


class RecordingQueue:
    """Takes the job, then refuses it like a full stream (the request falls back)."""

    def __init__(self) -> None:
        self.jobs: list = []

    async def enqueue(self, job) -> None:
        from splitserve.components.prefill_queue.enqueue import QueueFull

        self.jobs.append(job)
        raise QueueFull()


def test_a_decode_worker_offloads_an_adapter_request_the_prefill_pool_has(tmp_path):
    """While every live prefill worker has the adapter, its request is decided like the
    base model's: its prefix lookup is the adapter's own and its job names the adapter."""
    engine = FakeLoraEngine()
    engine.info.capabilities = dataclasses.replace(engine.info.capabilities,
                                                   prefix_lookup=True)
    asked: list[str | None] = []

    async def cached_prefix_tokens(token_ids, lora=None):
        asked.append(lora)
        return 0

    engine.cached_prefix_tokens = cached_prefix_tokens
    asyncio.run(engine.load_lora("sql", str(adapter_dir(tmp_path, "sql"))))
    coord, queue, metrics = decode_coordinator(engine, RecordingQueue())
    coord.prefill_serves = lambda name: name == "sql"

    async def run(req):
        return [c async for c in coord.generate(req)]

    chunks = asyncio.run(run(wire("sql")))
    assert chunks[-1]["finish_reason"] == "eos"  # the full queue: prefilled here instead
    assert [job.lora for job in queue.jobs] == ["sql"] and asked == ["sql"]
    sample = metrics.registry.get_sample_value
    assert sample("splitserve_disagg_decisions_total",
                  {"where": "remote", "reason": "forced"}) == 1
    assert sample("splitserve_disagg_decisions_total",
                  {"where": "local", "reason": "lora-local-prefill"}) is None
    # the explain endpoint agrees
    verdict = asyncio.run(_last(coord.explain({"token_ids": [1, 2, 3], "lora": "sql"})))
    assert verdict["decision"]["reason"] == "forced"


async def _last(stream):
    return [c async for c in stream][-1]


def _view(*statuses: tuple[int, str, str]):
    """A view with adapter ``sql`` at /a and (worker, state, role) statuses."""
    from splitserve.contracts.kit.loras import LoraView

    return LoraView(adapters={"sql": LoraRecord(path="/a", base_model="base")},
                    statuses={"sql": {w: LoraStatus(state=state, path="/a", role=role)
                                      for w, state, role in statuses}})


PREFILL_POOLS = {
    "both prefill workers have it": ([(1, "loaded", "prefill"), (2, "loaded", "prefill")],
                                     2, True),
    "one of two still loading": ([(1, "loaded", "prefill")], 2, False),
    "one failed": ([(1, "loaded", "prefill"), (2, "failed", "prefill")], 2, False),
    "an engine without LoRA": ([(1, "loaded", "prefill"), (2, "unsupported", "prefill")],
                               1, False),
    "only decode workers have it": ([(1, "loaded", "serve"), (2, "loaded", "serve")], 2,
                                    False),
    "no live prefill worker": ([(1, "loaded", "prefill")], 0, False),
}


@pytest.mark.parametrize(("statuses", "live", "serves"), PREFILL_POOLS.values(),
                         ids=PREFILL_POOLS.keys())
def test_the_prefill_pool_serves_an_adapter_only_when_every_live_worker_has_it(
        statuses, live, serves):
    adapters = AdapterSet(FakeLoraEngine(), "DecodeWorker")
    adapters.view = _view(*statuses)
    assert adapters.prefill_serves("sql", live) is serves
    assert adapters.prefill_serves("other", live) is False


def test_the_frontend_serves_an_adapter_only_where_requests_are_routed():
    """A prefill worker's status counts for offloading, not for serving: an adapter loaded
    only on prefill workers is not served (no decode worker could take its request)."""
    view = _view((1, "loaded", "prefill"), (2, "failed", "serve"))
    assert view.loaded_on("sql") == set() and view.loaded_on("sql", role="prefill") == {1}
    assert view.problems("sql") == {2: "failed"} and view.problems("sql", "prefill") == {}


def test_a_prefill_worker_reports_its_adapters_under_its_role(tmp_path):
    published: list[tuple[str, LoraStatus | None]] = []

    async def publish(name, status):
        published.append((name, status))

    adapters = AdapterSet(FakeLoraEngine(), "PrefillWorker", publish, role="prefill")
    path = str(adapter_dir(tmp_path, "sql"))
    asyncio.run(adapters.apply({"sql": LoraRecord(path=path, base_model="base")}))
    assert [(n, s.state, s.role, s.component) for n, s in published] == [
        ("sql", "loaded", "prefill", "PrefillWorker")]
