"""Placements shared between frontend processes routing in process (``router.share``):
each follows the others' requests, so admission judges the whole fleet's queue and
batch; a sibling that starts is sent what is in flight, one that stops or goes silent
has its requests dropped; nothing is sent while a process is alone; each process's
calibration counts only its own requests."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from splitserve.components.router.qos import QosConfig
from splitserve.components.router.service import RouterService
from splitserve.components.router.service_config import RouterComponentConfig, load_policy
from splitserve.components.router.share import PlacementShare, share_subject
from splitserve.contracts.wire import ReleaseCall, RouteCall
from tests.unit.router.fakes import FakeClient, teach

pytestmark = pytest.mark.unit


class Clock:
    """The shares' clock: the service's own (``time.monotonic``) when made, moved by hand
    (placements older than the service's TTL would expire)."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


class Bus:
    """Core NATS as the processes use it: a message reaches every other process."""

    def __init__(self) -> None:
        self.shares: list[PlacementShare] = []
        self.messages = 0

    def join(self, svc: RouterService, clock: Clock, origin: str) -> PlacementShare:
        async def publish(payload: bytes) -> None:
            self.messages += 1
            for other in self.shares:
                if other is not share:
                    other.receive(payload)

        share = PlacementShare(svc, publish, origin=origin, clock=clock)
        svc.share = share
        self.shares.append(share)
        return share


def service() -> RouterService:
    qos = QosConfig.model_validate({
        "mode": "enforce", "low_priority_threshold_ms": 0,
        "classes": [{"name": "default", "ttft_ms": 2000, "tpot_ms": 50, "may_reject": True}]})
    cfg = RouterComponentConfig(policy="round_robin", qos=qos)
    svc = RouterService(cfg, load_policy(cfg), FakeClient((1, 2)))
    teach(svc, 1)
    return svc


def place(svc: RouterService, rid: str) -> dict:
    async def go():
        return await svc.place(RouteCall(request_id=rid, token_ids=list(range(10))))
    return asyncio.run(go()).model_dump()


def ticks(*shares: PlacementShare, rounds: int = 2) -> None:
    async def go() -> None:
        for _ in range(rounds):
            for s in shares:
                await s.tick()
    asyncio.run(go())


def pair():
    """Two processes routing to the same workers, each having heard the other."""
    clock, bus = Clock(), Bus()
    a, b = service(), service()
    sa, sb = bus.join(a, clock, "a"), bus.join(b, clock, "b")
    ticks(sa, sb)
    return clock, bus, a, b, sa, sb


def confusion(svc: RouterService) -> float:
    return sum(s.value for m in svc.qos.metrics.confusion.collect() for s in m.samples
               if s.name.endswith("_total"))


def test_a_sibling_admits_on_the_whole_fleet_and_refuses_what_one_process_alone_would_not():
    clock, bus = Clock(), Bus()
    a, b = service(), service()
    sa, sb = bus.join(a, clock, "a"), bus.join(b, clock, "b")
    ticks(sa, sb)  # each says it is there
    assert sa.siblings.keys() == {"b"} and sb.siblings.keys() == {"a"}
    replies = [place(a, f"r{i}") for i in range(14)]  # 7 per worker: at the TPOT target
    assert all(r["worker_id"] in (1, 2) for r in replies)
    ticks(sa)
    assert set(b.fleet.placed) == {f"r{i}" for i in range(14)}
    assert set(b.qos.predictor.tickets) >= set(a.fleet.placed)
    for wid in ("1", "2"):
        assert b.qos.predictor.load(wid) == a.qos.predictor.load(wid)
    refused = place(b, "probe")
    assert refused["worker_id"] is None and refused["reason"] == "rejected-tpot-slo-risk"

    alone = service()  # the same process without the sibling's placements admits it
    assert place(alone, "probe")["worker_id"] in (1, 2)


def test_first_tokens_progress_and_releases_follow_and_calibration_stays_each_ones_own():
    clock, bus, a, b, sa, sb = pair()
    place(a, "x")
    ticks(sa)
    clock.now += 0.1
    a.first_token("x")
    ticks(sa)
    clock.now += 0.5
    a.decode_progress("x", 16)
    ticks(sa)
    assert "x" in b.qos.predictor.first_tokens
    assert b.qos.predictor.progress.get("x") is not None
    before = confusion(b)
    wid = a.fleet.placed["x"].worker_id
    a.complete(ReleaseCall(request_id="x", worker_id=wid, output_tokens=20, ttft_s=0.05,
                           duration_s=0.5))
    ticks(sa)
    assert "x" not in b.fleet.placed and "x" not in b.qos.predictor.tickets
    assert confusion(b) == before  # a sibling's request is not in this one's table
    assert confusion(a) == before + 1
    events = {(s.labels["direction"], s.labels["kind"]): s.value
              for m in sb.metrics.events.collect() for s in m.samples
              if s.name.endswith("_total")}
    assert events[("applied", "place")] == 1 and events[("applied", "release")] == 1
    assert events[("applied", "first")] == 1 and events[("applied", "progress")] == 1


def test_a_process_alone_sends_nothing_but_that_it_is_there():
    clock, bus = Clock(), Bus()
    a = service()
    sa = bus.join(a, clock, "a")
    ticks(sa)
    for i in range(5):
        place(a, f"r{i}")
    assert sa.pending == [] and len(sa.own) == 5
    assert not any(isinstance(e[4], dict) for e in sa.own.values())  # not encoded yet
    ticks(sa)  # no heartbeat due yet, nothing pending: nothing sent
    assert bus.messages == 1


def test_a_sibling_that_starts_is_sent_what_is_in_flight_and_one_that_stops_is_forgotten():
    clock, bus = Clock(), Bus()
    a, b = service(), service()
    sa = bus.join(a, clock, "a")
    ticks(sa)
    place(a, "early")
    a.first_token("early")
    sb = bus.join(b, clock, "b")
    ticks(sb, sa)  # b says hello; a sends it what it has in flight
    assert "early" in b.fleet.placed and "early" in b.qos.predictor.first_tokens
    ticks(sb, sa)  # sent again to nobody new: followed once
    assert len(b.fleet.placed) == 1

    place(a, "late")
    ticks(sa)
    assert set(b.fleet.placed) == {"early", "late"}
    clock.now += 10.0  # a is killed: silent past the timeout
    bus.shares.remove(sa)
    ticks(sb)
    assert not b.fleet.placed and not b.qos.predictor.tickets and not sb.siblings


def test_a_sibling_saying_it_stops_is_forgotten_at_once_and_junk_is_ignored():
    clock, bus, a, b, sa, sb = pair()
    place(a, "x")
    ticks(sa)
    assert "x" in b.fleet.placed
    assert sb.receive(b"not msgpack \xff") == 0
    bad = msgspec.msgpack.encode({"v": 1, "o": "a", "e": [["place", "y"], ["what", 1, 2]]})
    assert sb.receive(bad) == 0
    assert sb.receive(sa._envelope([["first", "x", 99]])) == 0  # from another worker
    stopping = asyncio.Event()
    stopping.set()
    asyncio.run(sa.run(stopping))
    assert not b.fleet.placed and not sb.siblings
    assert share_subject("dynamo", "Worker") == "splitserve.dynamo.worker.placements"


def test_a_large_batch_goes_as_several_messages_and_a_lost_release_heals_at_the_heartbeat():
    clock, bus = Clock(), Bus()
    a, b = service(), service()
    sa = bus.join(a, clock, "a")
    sa.max_bytes = 4096
    ticks(sa)
    hashes = list(range(2**40, 2**40 + 300))  # a long prompt's blocks

    for i in range(20):  # in flight before the sibling starts
        a.fleet.place(f"r{i}", 1, clock.now)
        sa.placed(f"r{i}", 1, hashes, None, None)
    sb = bus.join(b, clock, "b")
    sent = bus.messages
    ticks(sb, sa)
    assert set(b.fleet.placed) == {f"r{i}" for i in range(20)}
    assert bus.messages - sent >= 5  # 20 places of ~3 KB each, under 4 KiB a message

    release = sa._send  # the release of r0 is lost on the way
    sa._send = lambda event: None
    a.complete(ReleaseCall(request_id="r0", worker_id=1))
    sa._send = release
    ticks(sa)
    assert "r0" in b.fleet.placed
    clock.now += 1.0  # a's next heartbeat lists what it has in flight
    ticks(sa)
    assert "r0" not in b.fleet.placed and len(b.fleet.placed) == 19


def test_what_could_not_be_sent_is_sent_next_time_in_order():
    clock, bus, a, b, sa, sb = pair()
    deliver = sa.publish
    failing = True

    async def publish(payload: bytes) -> None:
        if failing:
            raise ConnectionError("reconnecting")
        await deliver(payload)
    sa.publish = publish
    place(a, "x")
    with pytest.raises(ConnectionError):
        ticks(sa, rounds=1)
    assert [e[1] for e in sa.pending] == ["x"]
    failing = False
    place(a, "y")
    ticks(sa)
    assert set(b.fleet.placed) == {"x", "y"}
