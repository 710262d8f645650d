"""The torch engine behind the shared decode coordinator: a request that leaves while
its prefill is remote gives back its reserved blocks and its stream, at once when no
write can come and after the hold when one still could.

The real model and engine core run on the runner thread; the prefill queue and the NIXL
agent are stand-ins (their own tests cover them), so every path is deterministic.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import pytest_asyncio

from splitserve.components.disagg import build_decider
from splitserve.components.worker.handoff import HandoffInbox, PrefillHandoff
from splitserve.components.prefill_queue import Enqueued, QueueFull
from splitserve.contracts.wire import worker_request
from splitserve.components.worker.coordinator import (
    CoordinatorSettings,
    EngineDecodeCoordinator,
)
from splitserve.components.worker.disagg_metrics import DisaggMetrics
from splitserve.contracts.kit.worker_metrics import WorkerMetrics
from splitserve.components.engines.torch_cpu.runner import EngineRunner
from splitserve.components.engines.torch_cpu.adapter import TorchEngine

pytestmark = [pytest.mark.unit, pytest.mark.asyncio]

FORCED_REMOTE = {"enable": True, "decider": "forced", "remote": True}


class Arrival:
    def __init__(self, payload: bytes) -> None:
        self.payload = payload


class FakeAgent:
    """The decode side of a NIXL agent: arrivals are announced by the test."""

    name = "decode-test"

    def __init__(self) -> None:
        self.arrived: dict[str, asyncio.Future] = {}
        self.cancelled: list[str] = []
        self.expected = 0

    def _fut(self, rid: str) -> asyncio.Future:
        return self.arrived.setdefault(rid, asyncio.get_running_loop().create_future())

    def announce(self, rid: str, first_token: int) -> None:
        self._fut(rid).set_result(Arrival(json.dumps(
            {"request_id": rid, "first_token": first_token}).encode()))

    def expect(self) -> None:
        """Blocks were reserved: the real agent polls fast from now (counted here)."""
        self.expected += 1

    async def wait_for(self, rid: str, timeout_s: float):
        return await asyncio.wait_for(self._fut(rid), timeout_s)

    def cancel(self, rid: str) -> None:
        self.cancelled.append(rid)


class Queue:
    """``mode``: 'silent' (the job is never served), 'full', or 'serve' (the prefill
    worker's KV write is announced, then the handoff sent, first token 42)."""

    def __init__(self, inbox: HandoffInbox, agent: FakeAgent, mode: str) -> None:
        self.inbox, self.agent, self.mode = inbox, agent, mode
        self.jobs: list = []

    async def enqueue(self, job) -> Enqueued:
        if self.mode == "full":
            raise QueueFull("stream limits reached")
        self.jobs.append(job)
        if self.mode == "serve":
            self.agent.announce(job.request_id, 42)
            msg = PrefillHandoff(request_id=job.request_id, first_token=42,
                                 disaggregated_params={"kind": "torch-blocks",
                                                       "nixl_agent": self.agent.name,
                                                       "block_ids": job.destination.block_ids,
                                                       "block_size": job.destination.block_size},
                                 prefill_worker_id="p1", compute_s=0.0, transfer_s=0.0)
            asyncio.get_running_loop().call_soon(self.inbox.take, msg.encode())
        return Enqueued(stream_seq=len(self.jobs), level=0, duplicate=False)


@pytest_asyncio.fixture
async def rig(make_engine):
    core = make_engine(block_size=16, num_blocks=64)
    runner = EngineRunner(core, asyncio.get_running_loop())
    runner.start()
    agent = FakeAgent()
    engine = TorchEngine(core, runner, 16, agent, arrival_timeout_s=2.0,
                         late_write_hold_s=0.3)
    inbox = HandoffInbox()

    def make(mode: str, timeout_s: float = 5.0) -> tuple[EngineDecodeCoordinator, Queue]:
        queue = Queue(inbox, agent, mode)
        coord = EngineDecodeCoordinator(
            engine, build_decider(FORCED_REMOTE), queue, inbox, "subj", 0xD,
            live_prefill_workers=lambda: 1, queue_depth=lambda: 0,
            metrics=DisaggMetrics(WorkerMetrics().registry),
            settings=CoordinatorSettings(remote_prefill_timeout_s=timeout_s))
        return coord, queue

    yield make, core, runner, agent
    runner.stop()


def request(rid: str, max_tokens: int = 64) -> dict:
    return worker_request(model="m", token_ids=list(range(100, 140)), max_tokens=max_tokens,
                          temperature=0.0, top_p=None, seed=None, eos_token_ids=[],
                          request_id=rid, priority="default")


async def used_blocks(runner: EngineRunner, core) -> int:
    return (await runner.call(core.stats)).kv_blocks_used


async def settle(runner: EngineRunner, core, want: int, within_s: float = 3.0) -> int:
    """KV blocks in use once the engine thread has applied what was queued."""
    for _ in range(int(within_s / 0.05)):
        n = await used_blocks(runner, core)
        if n == want:
            return n
        await asyncio.sleep(0.05)
    return await used_blocks(runner, core)


async def test_client_gone_while_the_prefill_is_remote_frees_blocks_and_stream(rig):
    make, core, runner, agent = rig
    coord, queue = make("silent")
    task = asyncio.create_task(anext(coord.generate(request("gone"))))
    for _ in range(100):
        if queue.jobs:
            break
        await asyncio.sleep(0.02)
    (job,) = queue.jobs
    assert len(job.destination.block_ids) == 3  # 40 tokens / 16
    assert job.destination.nixl_agent == "decode-test"
    assert await used_blocks(runner, core) == 3 and runner.inflight() == 1
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert runner.inflight() == 0 and coord.inflight == 0
    assert agent.cancelled == ["gone"]  # a late staged payload is dropped
    # A late write could still land: the blocks stay held for the hold, then go.
    assert await used_blocks(runner, core) == 3
    assert await settle(runner, core, 0) == 0


async def test_queue_refusal_releases_at_once_and_prefills_locally(rig):
    make, core, runner, agent = rig
    coord, _ = make("full")
    chunks = [c async for c in coord.generate(request("full", max_tokens=3))]
    assert chunks[-1]["finish_reason"] == "length"
    assert sum(len(c["token_ids"]) for c in chunks) == 3
    assert agent.cancelled == []  # nothing was ever sent
    assert agent.expected == 1  # the reservation told the agent a transfer was coming
    assert await settle(runner, core, 0) == 0 and runner.inflight() == 0


async def test_cancel_mid_stream_after_a_remote_prefill_aborts_in_the_engine(rig):
    make, core, runner, _ = rig
    coord, _ = make("serve")
    stream = coord.generate(request("mid", max_tokens=200))
    first = await anext(stream)
    assert first["token_ids"] == [42]  # the prefill worker's token comes first
    await anext(stream)
    assert runner.inflight() == 1
    await stream.aclose()
    assert runner.inflight() == 0 and coord.inflight == 0
    assert await settle(runner, core, 0) == 0


async def test_remote_timeout_holds_the_blocks_then_releases_them(rig):
    make, core, runner, agent = rig
    coord, _ = make("silent", timeout_s=0.2)
    chunks = [c async for c in coord.generate(request("slow", max_tokens=2))]
    assert chunks[-1]["finish_reason"] == "length"  # served locally after the timeout
    assert agent.cancelled == ["slow"]
    assert await settle(runner, core, 0) == 0 and runner.inflight() == 0
