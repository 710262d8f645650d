"""Steps every role shell takes around a hosted engine: load reports, readiness, LoRA
adapters, serving until stopped or until the engine dies, bounded clean-up.  Called by
``agg.py``, ``decode.py`` and ``prefill.py``."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Literal

from splitserve.contracts.wire import WorkerLoad, load_subject
from splitserve.contracts.kit.component import ComponentContext

from splitserve.contracts.kit.hosting import Hosted
from .loadreport import ReportFailures, publish_load
from .loras import AdapterSet, follow_adapters, static_records
from .readiness import report_ready_when_registered

log = logging.getLogger("splitserve.worker")


def start_load_reports(ctx: ComponentContext, h: Hosted, interval_s: float,
                       extra_waiting: Callable[[], int] = lambda: 0,
                       adapters: AdapterSet | None = None) -> asyncio.Task:
    """Publish the engine's load every ``interval_s`` (and refresh the worker's gauges);
    ``extra_waiting`` counts requests the shell holds that the engine does not see yet
    (a decode worker's requests waiting for their remote prefill); ``adapters``: the
    replica's LoRA adapters, whose loaded names and load errors each report carries.
    The task ends after its last ("draining") report once the component stops."""
    engine, metrics, worker_id = h.engine, h.metrics, h.worker_id

    def sample() -> WorkerLoad:
        ld = engine.load()
        kv = (ld.kv_used_blocks, ld.kv_total_blocks) if h.report_kv else (0, 0)
        waiting = ld.waiting + extra_waiting()
        metrics.update(ld.active, waiting, *kv)
        loras = adapters.loaded() if adapters is not None else []
        errors = adapters.errors() if adapters is not None else {}
        return WorkerLoad(worker_id=worker_id, active=ld.active, waiting=waiting,
                          kv_used_blocks=kv[0], kv_total_blocks=kv[1], loras=loras,
                          lora_errors=errors)

    return asyncio.create_task(publish_load(
        os.environ["NATS_SERVER"], load_subject(ctx.namespace, ctx.run.component), sample,
        interval_s, ctx.stopping, ReportFailures(metrics.load_report_failures)))


def start_adapters(ctx: ComponentContext, h: Hosted, cfg, tasks: list[asyncio.Future],
                   role: Literal["serve", "prefill"] = "serve") -> AdapterSet:
    """The replica's LoRA adapters, following etcd in a task added to ``tasks`` (with no
    etcd in the environment, a component started by hand, only none are served)."""
    from splitserve.contracts.kit.etcd import etcd_client
    from splitserve.contracts.kit.loras import LoraKeys

    adapters = AdapterSet(h.engine, ctx.run.component, role=role)
    endpoints = os.environ.get("ETCD_ENDPOINTS")
    if not endpoints:
        log.info("no ETCD_ENDPOINTS: LoRA adapters are not followed")
        return adapters
    static = static_records(cfg.loras, ctx.run.common.served_model_name)
    tasks.append(asyncio.create_task(follow_adapters(
        adapters, LoraKeys(ctx.namespace), h.worker_id, lambda: etcd_client(endpoints),
        static), name="lora-adapters"))
    return adapters


def report_ready(ctx: ComponentContext, h: Hosted, extra: str = "") -> asyncio.Task:
    """Report "ready" once discovery lists this instance (before that no router or
    frontend can reach it)."""
    ns, component = ctx.namespace, ctx.run.component
    detail = f"instance {h.worker_id:x} ({h.engine.info.name})"
    detail += "".join(f", {d}" for d in (extra, h.detail) if d)
    return asyncio.create_task(report_ready_when_registered(
        ctx.report, h.endpoint, h.worker_id, endpoint=f"{ns}.{component.lower()}.generate",
        detail=detail, **h.ready_fields))


async def serve_or_die(serving: asyncio.Future, died: asyncio.Future) -> None:
    """Serve until stopped; an engine that dies first ends the replica with its error
    (the supervisor restarts it)."""
    await asyncio.wait({serving, died}, return_when=asyncio.FIRST_COMPLETED)
    if died.done() and not serving.done():
        raise died.result()
    serving.result()


async def bounded(close, timeout_s: float = 5.0) -> None:
    """Run one clean-up step for at most ``timeout_s``; a failure is logged, not raised."""
    try:
        await asyncio.wait_for(close(), timeout_s)
    except Exception as exc:  # noqa: BLE001 - shutdown continues regardless
        log.warning("cleanup step failed: %s", exc)


async def cancel_all(tasks: list[asyncio.Future]) -> None:
    """Cancel ``tasks`` and wait until they have ended."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
