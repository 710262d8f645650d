"""Bringing Dynamo's mocker up in a worker process.

Aggregated (``serve_aggregated``): the mocker child registers the replica's `generate`
endpoint itself, so requests go straight to it with no Python hop (a mocker fleet is
for scale tests; ``workers_per_process`` packs many simulated engines in one child).
Decode and prefill (``host_mocker``): one child per engine role behind the
``MockerEngine`` adapter, which the decode and prefill shells drive like any engine.
"""

from __future__ import annotations

import asyncio
import contextlib

from splitserve.contracts.kit.hosting import Hosted, Role
from splitserve.contracts.kit.worker_metrics import WorkerMetrics
from splitserve.contracts.kit.component import ComponentContext

from .adapter import MockerEngine
from .children import ENGINE_STOP_GRACE_S, first_exit, start_engines, stop_engines

CHILD_MODES = {"decode": {"decode": "decode", "local": "agg"},
               "prefill": {"prefill": "prefill"}}
"""Engine role of each child -> its mocker ``--disaggregation-mode``, per worker role."""


async def host_mocker(ctx: ComponentContext, cfg, role: Role,
                      stack: contextlib.AsyncExitStack, factory=None) -> Hosted | None:
    """The registry's host for ``engine: mocker`` (decode and prefill roles); None when
    the component was asked to stop before the children registered."""
    args = cfg.engine_args
    children = await start_engines(ctx, args, CHILD_MODES[role])
    if children is None:
        return None
    stack.push_async_callback(stop_engines, children,
                              args.stop_grace_s(ENGINE_STOP_GRACE_S))
    endpoint = ctx.endpoint(ctx.run.component, "generate")
    worker_id = endpoint.connection_id()
    metrics = WorkerMetrics()
    ctx.serve_metrics(metrics.registry)
    eng = MockerEngine({c.role: c for c in children}, ctx.run.common.served_model_name,
                       args.block_size, args.num_gpu_blocks, cfg.engine_idle_timeout_s)
    died = asyncio.ensure_future(first_exit(children))
    stack.callback(died.cancel)
    return Hosted(eng, endpoint, worker_id, metrics, died, report_kv=False,
                  ready_fields={"instance_id": worker_id,
                                "engine_pids": [c.proc.pid for c in children]})


async def serve_aggregated(ctx: ComponentContext, cfg) -> None:
    """The registry's aggregated main for ``engine: mocker``: the child serves
    `generate` itself; exits non-zero if it dies."""
    from .process import run_mocker

    await run_mocker(ctx, cfg.engine_args, drain_timeout_s=cfg.drain_timeout_s)
