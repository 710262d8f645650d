"""Fakes for the mocker disaggregated path: engines, queue, depth and prefill pool."""

from __future__ import annotations

import asyncio
from typing import Any

from splitserve.contracts.engine import OpaqueHandoff
from splitserve.components.engines.mocker.sections import MockerDecodeWorkerConfig
from splitserve.components.worker.handoff import HandoffInbox, PrefillHandoff
from splitserve.components.engines.mocker.adapter import MockerEngine
from splitserve.components.prefill_queue import Enqueued, QueueFull
from splitserve.contracts.wire import worker_request
from splitserve.components.worker.coordinator import EngineDecodeCoordinator
from splitserve.components.worker.disagg_metrics import DisaggMetrics
from splitserve.components.worker.decode import coordinator_settings
from splitserve.contracts.kit.worker_metrics import WorkerMetrics

SEED_POLICY = {
    "enable": True,
    "policies": [
        {"metric": "prefill_length", "threshold": 256, "action": "prefer_remote",
         "weight": 0.7},
        {"metric": "prefill_queue_depth", "threshold": 10, "action": "prefer_local",
         "weight": 0.3}],
    "remote_prefill_min_score": 0.5,
}


class FakeEngine:
    """Answers like a mocker: one chunk per token, then a terminal 'length' chunk."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.requests: list[dict] = []

    async def stream(self, request: dict, idle_timeout_s: float):
        self.requests.append(request)
        for i in range(request["stop_conditions"]["max_tokens"]):
            yield {"token_ids": [1000 + i], "finish_reason": None}
        yield {"token_ids": [], "finish_reason": "length"}


class FakeQueue:
    """Records jobs; ``answer`` decides what happens after each enqueue."""

    def __init__(self, inbox: HandoffInbox, answer: str = "handoff") -> None:
        self.inbox = inbox
        self.answer = answer
        self.jobs: list = []
        self.targets: list[str | None] = []  # the prefill worker each job was queued for
        self.ran_on = "p1"  # the worker that runs a shared job

    async def enqueue(self, job, worker: str | None = None) -> Enqueued:
        if self.answer == "full":
            raise QueueFull("stream limits reached")
        self.jobs.append(job)
        self.targets.append(worker)
        if self.answer == "handoff":
            opaque = OpaqueHandoff(disaggregated_params="dummy").model_dump(mode="json")
            handoff = PrefillHandoff(request_id=job.request_id, first_token=7,
                                     disaggregated_params=opaque,
                                     prefill_worker_id=worker or self.ran_on,
                                     compute_s=0.01, transfer_s=0.002)
            # Delivered later, as a NATS callback would be.
            asyncio.get_running_loop().call_soon(self.inbox.take, handoff.encode())
        elif self.answer == "finished":  # its first token ended the request
            handoff = PrefillHandoff(request_id=job.request_id, first_token=2,
                                     prefill_worker_id="p1", compute_s=0.01, transfer_s=0.0,
                                     finish_reason="eos")
            asyncio.get_running_loop().call_soon(self.inbox.take, handoff.encode())
        elif self.answer == "refused":  # the prefill engine refused the job itself
            handoff = PrefillHandoff(request_id=job.request_id, first_token=0,
                                     prefill_worker_id="p1", compute_s=0.0,
                                     transfer_s=0.0, refused="vllm: min_tokens > max_tokens")
            asyncio.get_running_loop().call_soon(self.inbox.take, handoff.encode())
        # "duplicate": the server already holds an identical job and did not store this
        return Enqueued(stream_seq=len(self.jobs), level=0, duplicate=self.answer == "duplicate")


class FakeDepth:
    def __init__(self, depth: int | None = 0) -> None:
        self.depth = depth


class FakePrefillPool:
    def __init__(self, n: int) -> None:
        self.n = n

    def instance_ids(self) -> list[int]:
        return list(range(self.n))


def coordinator(*, answer: str = "handoff", prefill_workers: int = 2, **cfg: Any
                ) -> tuple[EngineDecodeCoordinator, dict[str, FakeEngine], FakeQueue]:
    """The shared decode coordinator over a mocker engine of fakes, with the seed's score
    policy unless overridden."""
    config = MockerDecodeWorkerConfig.model_validate(
        {"disaggregated_router": SEED_POLICY, "remote_prefill_timeout_s": 0.2, **cfg})
    from splitserve.components.disagg import build_decider

    inbox = HandoffInbox()
    engines = {"decode": FakeEngine("decode"), "local": FakeEngine("local")}
    queue = FakeQueue(inbox, answer)
    args = config.engine_args
    engine = MockerEngine(engines, "m", args.block_size, args.num_gpu_blocks,
                          config.engine_idle_timeout_s)
    metrics = WorkerMetrics()
    pool, depth = FakePrefillPool(prefill_workers), FakeDepth()
    coord = EngineDecodeCoordinator(
        engine, build_decider(config.disaggregated_router), queue, inbox,
        "splitserve.ns.decodeworker.handoff.abc", 0xABC,
        live_prefill_workers=lambda: len(pool.instance_ids()),
        queue_depth=lambda: depth.depth or 0, metrics=DisaggMetrics(metrics.registry),
        settings=coordinator_settings(config), requests=metrics.requests)
    return coord, engines, queue


def request(prompt_tokens: int, max_tokens: int = 4, request_id: str = "req-1") -> dict:
    """A frontend-shaped worker request with a prompt of distinct tokens."""
    return worker_request(model="m", token_ids=list(range(10, 10 + prompt_tokens)),
                          max_tokens=max_tokens, temperature=None, top_p=None, seed=None,
                          eos_token_ids=[2], request_id=request_id, priority="default")


async def collect(coord: EngineDecodeCoordinator, req: dict) -> list[dict]:
    return [chunk async for chunk in coord.generate(req)]


def sample(coord: EngineDecodeCoordinator, name: str, **labels: str) -> float:
    """A metric sample's value from the coordinator's registry (0 when absent)."""
    value = coord.metrics.registry.get_sample_value(name, labels)
    return value or 0.0
