"""The frontend's backends against fake worker clients and a real router core: retry of a
request whose worker failed before producing output, and truthful readiness."""

from __future__ import annotations

import asyncio
import copy
import time

import pytest

from splitserve.components.frontend.backend import (
    BackendMetrics,
    DirectBackend,
    RoutedBackend,
    StreamMeta,
)
from splitserve.components.frontend.errors import APIError
from splitserve.components.frontend.migration import DRAINED_MOVES
from splitserve.components.frontend.request import WorkerCall
from splitserve.contracts.wire import PROTOCOL_VERSION, drained_chunk
from splitserve.components.router.service import RouterService
from splitserve.components.router.service_config import load_policy
from splitserve.components.router.service_config import RouterComponentConfig

pytestmark = pytest.mark.unit

ENDPOINT = "ns.worker.generate"


class Workers:
    """A worker client: instance ids from discovery; ``dead`` ones refuse connections,
    ``breaking`` ones send one token and then their stream breaks."""

    def __init__(self, ids, dead=(), breaking=(), truncating=(), script=(), stalling=(),
                 slow_first: float = 0.0) -> None:
        self.ids, self.dead, self.breaking = list(ids), set(dead), set(breaking)
        self.stalling = set(stalling)  # one token, then silence (a host cut off)
        self.slow_first = slow_first  # seconds before the first token
        self.truncating = set(truncating)  # end after one token, with no finish reason
        # what the n-th stream does, whichever worker serves it ("drain": hand the
        # request back after one token, "break", "ok"); past its end: by worker
        self.script = list(script)
        self.sent: list[int] = []
        self.requests: list[dict] = []

    def instance_ids(self):
        return list(self.ids)

    async def direct(self, request, worker_id, context=None):
        self.sent.append(worker_id)
        self.requests.append(copy.deepcopy(request))
        if worker_id in self.dead:
            raise ConnectionRefusedError(f"instance {worker_id} unreachable")
        return self._stream(worker_id)

    async def _stream(self, worker_id):
        n = len(self.sent) - 1
        step = self.script[n] if n < len(self.script) else None
        await asyncio.sleep(self.slow_first)
        yield {"token_ids": [worker_id], "finish_reason": None}
        if worker_id in self.stalling:
            await asyncio.sleep(3600)
        if step == "break" or (step is None and worker_id in self.breaking):
            raise ConnectionResetError("stream reset")
        if worker_id in self.truncating:
            return
        if step == "drain":
            yield drained_chunk()
            return
        if step in ("park", "park-stale"):  # kept the KV; two tokens made, not sent
            held = len(self.requests[-1]["token_ids"]) + 3 - 1
            yield drained_chunk([7, 8], {"request_id": "rq", "tokens": held
                                         + (step == "park-stale")})
            return
        yield {"token_ids": [0], "finish_reason": "length"}


class RouterClient:
    """Dynamo's client to the router's endpoints, calling a real RouterService."""

    def __init__(self, svc: RouterService, handler, instance_id: int = 99) -> None:
        self.svc, self.handler, self.instance_id = svc, handler, instance_id

    def instance_ids(self):
        return [self.instance_id]

    async def round_robin(self, request, context=None):
        return self.handler(request)

    async def direct(self, request, instance_id, context=None):
        assert instance_id == self.instance_id
        return self.handler(request)


def request(max_tokens: int = 2, min_tokens: int | None = None) -> WorkerCall:
    return WorkerCall(model="m", token_ids=(1, 2, 3), max_tokens=max_tokens, request_id="r",
                      priority="default", min_tokens=min_tokens)


def collect(backend, meta=None, req=None) -> list[dict]:
    async def go():
        return [c async for c in backend.stream(req or request(),
                                                meta or StreamMeta("r", None), None)]
    return asyncio.run(go())


def migrations(backend, reason: str) -> float:
    return backend.metrics.registry.get_sample_value(
        "splitserve_frontend_migrations_total", {"reason": reason}) or 0.0


def routed(workers: Workers, migration_limit=1, router_ids=None):
    cfg = RouterComponentConfig(policy="round_robin", use_kv_events=False)
    svc = RouterService(cfg, load_policy(cfg), Workers(router_ids or workers.ids),
                        worker_endpoint=ENDPOINT)

    async def connect(path):
        assert path == ENDPOINT
        return workers

    backend = RoutedBackend(RouterClient(svc, svc.route), connect,
                            migration_limit=migration_limit,
                            status_client=RouterClient(svc, svc.status_handler),
                            metrics=BackendMetrics())
    return backend, svc


def retries(backend) -> float:
    return backend.metrics.registry.get_sample_value(
        "splitserve_frontend_request_retries_total") or 0.0


@pytest.mark.parametrize("make", ["routed", "direct"])
def test_a_dead_worker_is_retried_once_and_dropped(make):
    workers = Workers([1, 2], dead=[1])
    if make == "routed":
        backend, svc = routed(workers)
    else:
        backend = DirectBackend(workers, metrics=BackendMetrics())
    outs = [collect(backend) for _ in range(4)]
    assert all(o[-1]["finish_reason"] == "length" for o in outs)
    assert workers.sent.count(1) == 1, "the dead worker must get no second request"
    assert retries(backend) == 1
    if make == "routed":
        assert svc.status().workers == [2]


@pytest.mark.parametrize("limit", [0, 1, 2])
def test_migration_limit_bounds_the_retries(limit):
    workers = Workers([1, 2, 3], dead=[1, 2, 3])
    backend = DirectBackend(workers, migration_limit=limit, metrics=BackendMetrics())
    with pytest.raises(APIError) as err:
        collect(backend)
    assert err.value.status == 503
    assert len(workers.sent) == limit + 1 and len(set(workers.sent)) == limit + 1
    assert retries(backend) == limit


def make_backend(make: str, workers: Workers, limit: int = 1, stall_s: float = 0.0):
    if make == "routed":
        backend = routed(workers, migration_limit=limit)[0]
        backend.stall_s = stall_s
        return backend
    return DirectBackend(workers, migration_limit=limit, metrics=BackendMetrics(),
                         stall_s=stall_s)


@pytest.mark.parametrize("make", ["routed", "direct"])
def test_a_stream_gone_silent_mid_answer_resumes_on_another_worker(make):
    """A worker whose host lost its network sends no reset: its stream just stops."""
    workers = Workers([1, 2], stalling=[1])
    backend = make_backend(make, workers, stall_s=0.05)
    got = collect(backend, req=request(max_tokens=4))
    assert [c["token_ids"] for c in got] == [[1], [2], [0]]
    assert workers.requests[1]["token_ids"] == [1, 2, 3, 1]
    assert migrations(backend, "worker-stalled") == 1
    assert migrations(backend, "worker-failed-mid-stream") == 0


@pytest.mark.parametrize("make", ["routed", "direct"])
def test_a_slow_first_token_is_not_a_stall(make):
    workers = Workers([1, 2], slow_first=0.2)
    backend = make_backend(make, workers, stall_s=0.05)
    got = collect(backend)
    assert [c["token_ids"] for c in got] == [[workers.sent[0]], [0]]
    assert migrations(backend, "worker-stalled") == 0


def test_a_stall_limit_is_shorter_than_the_inter_token_timeout():
    from splitserve.components.frontend.config import FrontendConfig

    assert FrontendConfig().stall_migration_s == 10
    FrontendConfig(stall_migration_s=0)
    with pytest.raises(ValueError, match="stall_migration_s"):
        FrontendConfig(stall_migration_s=30, inter_token_timeout_s=30)
    # unset under a shorter inter-token timeout: half of it, kept through a round trip
    short = FrontendConfig(inter_token_timeout_s=8)
    assert short.stall_migration_s == 4
    assert FrontendConfig.model_validate(short.model_dump()).stall_migration_s == 4


@pytest.mark.parametrize("make", ["routed", "direct"])
def test_a_stream_that_breaks_resumes_after_its_tokens_on_another_worker(make):
    workers = Workers([1, 2], breaking=[1])
    backend = make_backend(make, workers)
    got = collect(backend, req=request(max_tokens=4, min_tokens=3))
    # the client's stream goes on: worker 1's token, then worker 2's
    assert [c["token_ids"] for c in got] == [[1], [2], [0]]
    assert got[-1]["finish_reason"] == "length"
    assert workers.sent == [1, 2]
    resumed = workers.requests[1]
    assert resumed["token_ids"] == [1, 2, 3, 1]  # the prompt, then what was streamed
    assert resumed["stop_conditions"] == {"max_tokens": 3, "min_tokens": 2}
    assert migrations(backend, "worker-failed-mid-stream") == 1
    assert retries(backend) == 0


@pytest.mark.parametrize("make", ["routed", "direct"])
@pytest.mark.parametrize("limit", [0, 1, 2])
def test_mid_stream_migrations_are_bounded(make, limit):
    workers = Workers([1, 2, 3], breaking=[1, 2, 3])
    backend = make_backend(make, workers, limit)
    got: list[dict] = []

    async def go():
        async for c in backend.stream(request(max_tokens=10), StreamMeta("r", None), None):
            got.append(c)
    with pytest.raises(APIError) as err:
        asyncio.run(go())
    assert err.value.status == 502
    assert len(workers.sent) == limit + 1 and len(got) == limit + 1
    assert migrations(backend, "worker-failed-mid-stream") == limit


@pytest.mark.parametrize("make", ["routed", "direct"])
@pytest.mark.parametrize("limit", [0, 1])
def test_requests_handed_back_by_draining_workers_move_without_using_the_limit(make, limit):
    """A worker at its drain deadline ends a stream with a ``drained`` chunk: the client
    never sees it, the request resumes elsewhere even with migrations off, and the moves
    do not count against ``migration_limit`` (a failure after them may still move)."""
    script = ["drain", "drain", "break"] if limit else ["drain", "drain"]
    workers = Workers([1, 2, 3, 4], script=script)
    backend = make_backend(make, workers, limit)
    got = collect(backend, req=request(max_tokens=6))
    assert all(not c.get("drained") for c in got)
    assert [c["token_ids"] for c in got] == [[w] for w in workers.sent] + [[0]]
    assert len(workers.sent) == len(script) + 1 == len(set(workers.sent))
    assert got[-1]["finish_reason"] == "length"
    assert migrations(backend, "worker-drained") == 2
    assert migrations(backend, "worker-failed-mid-stream") == (1 if limit else 0)
    # resumed after both tokens streamed before the hand-backs
    assert workers.requests[2]["token_ids"] == [1, 2, 3, *workers.sent[:2]]


@pytest.mark.parametrize("make", ["routed", "direct"])
def test_a_drained_worker_that_kept_the_kv_names_it_for_the_next_worker(make):
    """Live KV moves: the drained chunk's unsent tokens reach the client, and the resumed
    request names the parked KV, unless its token count does not match the request
    (then the next worker recomputes)."""
    workers = Workers([1, 2, 3], script=["park", "park-stale"])
    backend = make_backend(make, workers)
    got = collect(backend, req=request(max_tokens=12))
    w1, w2, w3 = workers.sent
    assert [c["token_ids"] for c in got] == [[w1], [7, 8], [w2], [7, 8], [w3], [0]]
    assert got[-1]["finish_reason"] == "length"
    second, third = workers.requests[1], workers.requests[2]
    assert second["token_ids"] == [1, 2, 3, w1, 7, 8]
    assert second["stop_conditions"]["max_tokens"] == 9
    assert second["extra_args"]["splitserve"]["kv_source"] == {
        "worker_id": w1, "request_id": "rq", "tokens": 5}
    assert third["token_ids"] == [1, 2, 3, w1, 7, 8, w2, 7, 8]
    assert "kv_source" not in third["extra_args"]["splitserve"]
    assert migrations(backend, "worker-drained") == 2


@pytest.mark.parametrize("make", ["routed", "direct"])
def test_drained_moves_are_bounded(make):
    n = DRAINED_MOVES + 2
    workers = Workers(list(range(1, n + 1)), script=["drain"] * n)
    backend = make_backend(make, workers)
    with pytest.raises(APIError) as err:
        collect(backend, req=request(max_tokens=50))
    assert err.value.status == 502
    assert migrations(backend, "worker-drained") == DRAINED_MOVES


def test_a_stream_that_ends_without_a_finish_reason_is_resumed():
    workers = Workers([1, 2], truncating=[1])
    got = collect(make_backend("routed", workers), req=request(max_tokens=3))
    assert [c["token_ids"] for c in got] == [[1], [2], [0]]
    assert workers.requests[1]["token_ids"] == [1, 2, 3, 1]


@pytest.mark.parametrize("make", ["routed", "direct"])
def test_a_worker_that_dies_after_the_last_token_ends_the_request(make):
    workers = Workers([1, 2], breaking=[1])
    backend = make_backend(make, workers)
    got = collect(backend, req=request(max_tokens=1))
    assert [c["token_ids"] for c in got] == [[1], []]
    assert got[-1]["finish_reason"] == "length"
    assert workers.sent == [1], "nothing was left to generate elsewhere"


def test_routed_retry_with_no_other_worker_says_so():
    backend, _ = routed(Workers([1], dead=[1]))
    with pytest.raises(APIError) as err:
        collect(backend)
    assert err.value.status == 503 and "failed" in err.value.message
    assert "no other worker of m can take the request after worker 1" in err.value.message


def test_no_worker_at_all_names_the_model():
    """A graph may serve several models: which one has no worker now is in the answer."""
    backend, _ = routed(Workers([]))
    with pytest.raises(APIError) as err:
        collect(backend)
    assert err.value.status == 503 and err.value.retry_after_s == 2
    assert err.value.message.startswith("no worker of m can take the request")


def test_routed_ready_needs_a_worker_the_router_would_route_to():
    workers = Workers([])
    backend, svc = routed(workers, router_ids=[])
    assert not backend.ready(), "no status yet"
    asyncio.run(backend.refresh_status())
    assert not backend.ready(), "the router knows no worker"
    svc.client.ids = [7]
    asyncio.run(backend.refresh_status())
    assert not backend.ready(), "this frontend's discovery does not know worker 7 yet"
    workers.ids = [7]
    assert backend.ready()
    svc.mark_down(7, time.monotonic())
    asyncio.run(backend.refresh_status())
    assert not backend.ready(), "the only worker was found dead"


def test_direct_ready_ignores_workers_found_dead():
    workers = Workers([1], dead=[1])
    backend = DirectBackend(workers, migration_limit=0)
    assert backend.ready()
    with pytest.raises(APIError):
        collect(backend)
    assert not backend.ready()


def test_a_consumer_that_stops_after_the_last_chunk_releases_as_ok():
    backend, svc = routed(Workers([1]))
    sent: list[dict] = []

    class Release:
        def instance_ids(self):
            return [99]

        async def direct(self, call, instance_id, context=None):
            sent.append(call)
            return RouterClient(svc, svc.release).handler(call)

    backend.release_client = Release()

    async def go():
        agen = backend.stream(request(), StreamMeta("r", None), None)
        async for chunk in agen:
            if chunk.get("finish_reason"):
                break
        await agen.aclose()
        await asyncio.sleep(0)  # one turn of the loop: the release is already on its way
        assert [c["outcome"] for c in sent] == ["ok"]
        await asyncio.sleep(0.05)
    asyncio.run(go())
    assert svc.fleet.placed == {}


class Replicas:
    """Dynamo's client to one endpoint of several router replicas (real RouterServices):
    ``round_robin`` cycles through them like Dynamo's, ``direct`` reaches the one named."""

    def __init__(self, handlers: dict[int, object]) -> None:
        self.handlers = handlers
        self.turn = 0

    def instance_ids(self):
        return list(self.handlers)

    async def round_robin(self, request, context=None):
        self.turn += 1
        return self.handlers[list(self.handlers)[self.turn % len(self.handlers)]](request)

    async def direct(self, request, instance_id, context=None):
        return self.handlers[instance_id](request)


def test_each_release_reaches_the_router_replica_that_placed_the_request():
    workers = Workers([1, 2])
    cfg = RouterComponentConfig(policy="round_robin", use_kv_events=False)
    svcs = {rid: RouterService(cfg, load_policy(cfg), Workers(workers.ids),
                               worker_endpoint=ENDPOINT) for rid in (11, 12)}

    async def connect(path):
        return workers

    backend = RoutedBackend(Replicas({r: s.route for r, s in svcs.items()}), connect,
                            metrics=BackendMetrics())
    backend.release_client = Replicas({r: s.release for r, s in svcs.items()})
    # Routes and releases interleave differently under load: a release client that
    # cycles on its own would send this release to the other replica.
    backend.release_client.turn = 1

    async def go():
        for i in range(5):
            meta = StreamMeta(f"r{i}", None)
            assert [c async for c in backend.stream(request(), meta, None)]
            await asyncio.sleep(0.01)  # the release is sent in the background
    asyncio.run(go())
    assert {r: s.fleet.placed for r, s in svcs.items()} == {11: {}, 12: {}}


QOS_CLASSES = [{"name": n, "ttft_ms": 1000, "tpot_ms": 100 + 10 * i}
               for i, n in enumerate(("high", "default", "low", "batch"))]


@pytest.mark.parametrize(("header", "name", "level"), [
    ("high", "high", 0), ("default", "default", 1), ("low", "low", 2), ("batch", "batch", 3),
    (None, "default", 1), ("Batch", "batch", 3), ("urgent", "default", 1)])
def test_the_worker_gets_the_class_and_level_the_router_resolved(header, name, level):
    from splitserve.components.router.qos import QosConfig
    from splitserve.components.worker.wire import params_from_wire
    from splitserve.contracts.wire import WorkerRequest

    workers = Workers([1])
    cfg = RouterComponentConfig(policy="round_robin", use_kv_events=False,
                                qos=QosConfig.model_validate({"classes": QOS_CLASSES}))
    svc = RouterService(cfg, load_policy(cfg), Workers([1]), worker_endpoint=ENDPOINT)

    async def connect(path):
        return workers

    backend = RoutedBackend(RouterClient(svc, svc.route), connect, metrics=BackendMetrics())
    collect(backend, StreamMeta("r", header))
    sent = workers.requests[-1]
    own = sent["extra_args"]["splitserve"]
    assert own.pop("request_id") == "r" and own.pop("version") == PROTOCOL_VERSION
    # and the class's TPOT target, which the decode worker's stall guard protects it to
    assert own == {"priority": name, "priority_level": level, "tpot_ms": 100 + 10 * level}
    assert params_from_wire(WorkerRequest.model_validate(sent)).priority == level
    assert WorkerRequest.model_validate(sent).meta().tpot_ms == 100 + 10 * level
