"""Bringing an engine up inside a DecodeWorker / PrefillWorker process, per engine kind.

The decode and prefill worker processes (``engine_processes.py``) are the same for every
engine; only this step differs: what is started before the engine can serve, which
metrics registry is served, who publishes load reports, and how the engine's death is
noticed.  ``host_engine`` does it for ``torch`` (model on a runner thread plus a NIXL
agent), ``mocker`` (one child process per role) and the in-process engines (vLLM,
SGLang, TensorRT-LLM, through ``make_engine``), and registers every clean-up on the
caller's exit stack.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from splitserve.serve.component import ComponentContext

from .metrics import WorkerMetrics

log = logging.getLogger("splitserve.engine_worker")

MOCKER_ROLES = {"decode": {"decode": "decode", "local": "agg"},
                "prefill": {"prefill": "prefill"}}


@dataclass
class Hosted:
    """A started engine and what the worker process needs around it."""

    engine: Any
    endpoint: Any
    worker_id: int
    metrics: WorkerMetrics
    """Served on the replica's metrics port; the worker adds its own metrics to it."""
    died: asyncio.Future
    """Resolves with the exception to raise when the engine dies on its own."""
    publishes_load: bool = False
    """True when the engine's shell already publishes load reports (torch)."""
    report_kv: bool = True
    """False when the engine's KV figures are estimates the router should not see."""
    ready_fields: dict[str, Any] = field(default_factory=dict)
    detail: str = ""


async def host_engine(ctx: ComponentContext, cfg, role: str,
                      stack: contextlib.AsyncExitStack) -> Hosted | None:
    """Start ``cfg``'s engine for ``role`` (decode or prefill); None when the component
    was asked to stop before the engine came up."""
    engine = getattr(cfg, "engine", "torch")
    if engine == "torch":
        return await _host_torch(ctx, cfg, role, stack)
    if engine == "mocker":
        return await _host_mocker(ctx, cfg, role, stack)
    return await _host_in_process(ctx, cfg, role, stack)


def _never() -> asyncio.Future:
    return asyncio.get_running_loop().create_future()


async def _host_torch(ctx, cfg, role: str, stack) -> Hosted:
    from splitserve.components.kv_transfer import KvTransferAgent

    from .torch_engine import TorchEngine
    from .torch_worker import start_torch_worker

    w = await start_torch_worker(ctx, cfg, publish_kv=role == "decode")
    stack.push_async_callback(w.close)
    agent = KvTransferAgent(f"{role}-{w.worker_id:x}", w.core.kv_pool(),
                            etcd_endpoints=os.environ["ETCD_ENDPOINTS"],
                            config=cfg.kv_transfer.model_copy(
                                update={"namespace": ctx.namespace}))
    await agent.start()
    stack.push_async_callback(agent.close)
    if role == "decode":
        agent.start_poller()
    # A reservation abandoned on timeout is held until the job's deadline has passed
    # (plus a margin): a late write could still land in its blocks.
    hold = getattr(cfg, "remote_prefill_timeout_s", 30.0) + 5.0
    eng = TorchEngine(w.core, w.runner, cfg.engine_args.block_size, agent,
                      arrival_timeout_s=cfg.kv_transfer.timeout_s, late_write_hold_s=hold)
    stack.push_async_callback(eng.shutdown)
    # The runner itself leaves (deregisters, exit 70) when its engine fails.
    return Hosted(eng, w.endpoint, w.worker_id, w.metrics, _never(), publishes_load=True,
                  detail=f"agent {agent.name}")


async def _host_mocker(ctx, cfg, role: str, stack) -> Hosted | None:
    from splitserve.components.mocker_worker.engines import (
        ENGINE_STOP_GRACE_S,
        first_exit,
        start_engines,
        stop_engines,
    )
    from splitserve.components.mocker_worker.mocker_engine import MockerEngine

    args = cfg.engine_args
    children = await start_engines(ctx, args, MOCKER_ROLES[role])
    if children is None:
        return None
    stack.push_async_callback(stop_engines, children,
                              args.stop_grace_s(ENGINE_STOP_GRACE_S))
    endpoint = ctx.endpoint(ctx.run.component, "generate")
    worker_id = endpoint.connection_id()
    metrics = WorkerMetrics()
    ctx.serve_metrics(metrics.registry)
    eng = MockerEngine({c.role: c for c in children}, ctx.run.common.model,
                       args.block_size, args.num_gpu_blocks, cfg.engine_idle_timeout_s)
    died = asyncio.ensure_future(first_exit(children))
    stack.callback(died.cancel)
    return Hosted(eng, endpoint, worker_id, metrics, died, report_kv=False,
                  ready_fields={"instance_id": worker_id,
                                "engine_pids": [c.proc.pid for c in children]})


async def _host_in_process(ctx, cfg, role: str, stack) -> Hosted:
    from .engine_processes import make_engine

    eng = make_engine(ctx, cfg, role)
    ctx.report("loading", detail=f"starting {eng.info.name} ({role})")
    endpoint = ctx.endpoint(ctx.run.component, "generate")
    worker_id = endpoint.connection_id()
    stack.push_async_callback(eng.shutdown, 0.0)
    if role == "decode":
        from dynamo.llm import KvEventPublisher

        from splitserve.components.engines.vllm.worker import publish_kv_events

        publisher = KvEventPublisher(endpoint, kv_block_size=eng.info.kv_block_size)
        relay_ready = asyncio.Event()
        relay = asyncio.create_task(eng.run_kv_events(
            lambda evs: publish_kv_events(publisher, evs), relay_ready))
        stack.push_async_callback(_cancel, relay)
        await asyncio.wait_for(relay_ready.wait(), 10)
    await eng.start()
    metrics = WorkerMetrics()
    ctx.serve_metrics(metrics.registry)
    died = asyncio.ensure_future(_watch_failure(eng))
    stack.callback(died.cancel)
    return Hosted(eng, endpoint, worker_id, metrics, died)


async def _watch_failure(engine, every_s: float = 0.5) -> BaseException:
    """Engines that can tell (``failure()``: vLLM's engine process died) end the
    replica, which the supervisor restarts."""
    failure = getattr(engine, "failure", None)
    if failure is None:
        await _never()
    while True:
        exc = failure()
        if exc is not None:
            log.error("%s engine failed: %s", engine.info.name, exc)
            return RuntimeError(f"{engine.info.name} engine failed: {exc}")
        await asyncio.sleep(every_s)


async def _cancel(task: asyncio.Future) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
