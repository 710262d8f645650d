"""Bringing an engine up inside a worker process, for any role (agg, decode, prefill).

A *host* starts the engine and what must run before it can serve, and registers every
clean-up on the caller's exit stack; the role shells (``agg.py``, ``decode.py``,
``prefill.py``) then do the rest the same way for every engine.  Most engines run in
this process and need only a factory (``host_in_process``); engines with more to set up
(torch: a model on a runner thread and a NIXL agent; the mocker: child processes) have
their own host in their folder.  The registry (``registry.py``) says which host and
factory each engine uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from splitserve.contracts.engine import Engine
from splitserve.contracts.kit.component import ComponentContext

from .worker_metrics import WorkerMetrics

log = logging.getLogger("splitserve.worker")

Role = Literal["agg", "decode", "prefill"]

PUBLISHES_KV: frozenset[str] = frozenset({"agg", "decode"})
"""Roles whose KV events reach the routers (a prefill engine's would go nowhere)."""


@dataclass
class Hosted:
    """A started engine and what the worker process needs around it."""

    engine: Any
    endpoint: Any
    worker_id: int
    metrics: WorkerMetrics
    """Served on the replica's metrics port; the shell adds its own metrics to it."""
    died: asyncio.Future
    """Resolves with the exception to raise when the engine dies on its own."""
    report_kv: bool = True
    """False when the engine's KV figures are estimates the router should not see."""
    ready_fields: dict[str, Any] = field(default_factory=dict)
    detail: str = ""


def never() -> asyncio.Future:
    """A future that never resolves: ``Hosted.died`` of an engine that cannot tell."""
    return asyncio.get_running_loop().create_future()


def publish_kv_events(publisher, events: list) -> None:
    """Forward converted BlockStored / BlockRemoved events to Dynamo's publisher: those
    of the engine's own pool only (Dynamo 1.6.1's publisher has no tier, so a block
    stored in a host or disk tier would read as a pool block to the routers)."""
    for ev in events:
        if getattr(ev, "tier", "device") != "device":
            continue
        if hasattr(ev, "token_ids"):
            publisher.publish_stored(list(ev.token_ids), list(ev.num_block_tokens),
                                     list(ev.block_hashes), ev.parent_hash,
                                     lora_name=ev.lora_name)
        else:
            publisher.publish_removed(list(ev.block_hashes))


async def relay_kv_events(engine, endpoint, stack: contextlib.AsyncExitStack,
                          ready_timeout_s: float = 10.0, tier_subject: str | None = None,
                          ) -> None:
    """Start relaying ``engine``'s KV events to the routers: its pool's through Dynamo's
    publisher, and, when the engine keeps tiers below its pool (``info.lower_tiers``)
    and ``tier_subject`` is given, theirs on that subject (``tier_events``); returns
    once the relay listens (called before ``engine.start()``: the engine's own publisher
    connects to it)."""
    from dynamo.llm import KvEventPublisher

    publisher = KvEventPublisher(endpoint, kv_block_size=engine.info.kv_block_size)
    stack.callback(publisher.shutdown)  # after the relays below have stopped
    tiers = None
    if engine.info.lower_tiers and tier_subject is not None:
        tiers = await start_tier_events(os.environ["NATS_SERVER"], endpoint.connection_id(),
                                        engine.info.lower_tiers, tier_subject, stack)

    def sink(evs: list) -> None:
        publish_kv_events(publisher, evs)
        if tiers is not None:
            tiers.submit(evs)

    ready = asyncio.Event()
    relay = asyncio.create_task(engine.run_kv_events(sink, ready))
    stack.push_async_callback(cancel_and_wait, relay)
    await asyncio.wait_for(ready.wait(), ready_timeout_s)


async def serve_announce_requests(nats_url: str, subject: str, worker_id: int,
                                  announce: Callable[[], None],
                                  stack: contextlib.AsyncExitStack) -> None:
    """Call ``announce`` (the engine re-announces its KV cache on its event streams)
    whenever a router asks on ``subject`` (``kv_announce_subject``) for this worker or
    for every worker, until ``stack`` closes."""
    import json

    from .connect import close_nats, connect_nats

    async def on_request(msg) -> None:
        try:
            wanted = json.loads(msg.data or b"{}").get("worker_id")
        except (ValueError, AttributeError):
            log.warning("ignoring a malformed KV announce request on %s", subject)
            return
        if wanted is None or int(wanted) == worker_id:
            announce()

    nc = await connect_nats(nats_url, name="splitserve-worker-kv-announce",
                            max_reconnect_attempts=-1)
    stack.push_async_callback(close_nats, nc, "KV announce")
    await nc.subscribe(subject, cb=on_request)


async def start_tier_events(nats_url: str, worker_id: int, capacity, subject: str,
                            stack: contextlib.AsyncExitStack):
    """Connect to NATS and publish ``worker_id``'s lower-tier envelopes on ``subject``
    until ``stack`` closes; ``capacity``: blocks per lower tier the engine keeps (None:
    not known).  Returns the ``TierEventPublisher`` (``submit`` each event batch)."""
    from .connect import close_nats, connect_nats
    from .tier_events import TierEnvelopes, TierEventPublisher

    nc = await connect_nats(nats_url, name="splitserve-worker-kv-tiers",
                            max_reconnect_attempts=-1)
    stack.push_async_callback(close_nats, nc, "KV tier event")
    publisher = TierEventPublisher(TierEnvelopes(worker_id, capacity), subject)
    sender = asyncio.create_task(publisher.run(nc))
    stack.push_async_callback(cancel_and_wait, sender)
    return publisher


async def host_in_process(ctx: ComponentContext, cfg, role: Role,
                          stack: contextlib.AsyncExitStack,
                          factory: Callable[..., Any] | None = None) -> Hosted:
    """Host an engine that runs in this process (vLLM, SGLang, TensorRT-LLM):
    ``factory(ctx, cfg, role)`` builds it, not started."""
    if factory is None:
        raise ValueError("an in-process engine needs a factory in the registry")
    eng = factory(ctx, cfg, role)
    ctx.report("loading", detail=f"starting {eng.info.name} ({role})")
    endpoint = ctx.endpoint(ctx.run.component, "generate")
    worker_id = endpoint.connection_id()
    stack.push_async_callback(eng.shutdown, 0.0)
    if role in PUBLISHES_KV:
        from splitserve.contracts.block_events import tier_event_subject

        await relay_kv_events(eng, endpoint, stack, tier_subject=tier_event_subject(
            ctx.namespace, ctx.run.component))
    await eng.start()
    metrics = WorkerMetrics()
    ctx.serve_metrics(metrics.registry)
    died = asyncio.ensure_future(watch_failure(eng))
    stack.callback(died.cancel)
    return Hosted(eng, endpoint, worker_id, metrics, died)


async def watch_failure(engine: Engine, every_s: float = 0.5) -> BaseException:
    """Engines that can tell (``capabilities.reports_failure``: vLLM's engine process or
    TensorRT-LLM's executor died) end the replica, which the supervisor restarts;
    returns the error.  For the others this never returns."""
    if not engine.info.capabilities.reports_failure:
        await never()
    while True:
        exc = engine.failure()
        if exc is not None:
            log.error("%s engine failed: %s", engine.info.name, exc)
            return RuntimeError(f"{engine.info.name} engine failed: {exc}")
        await asyncio.sleep(every_s)


async def cancel_and_wait(task: asyncio.Future) -> None:
    """Cancel ``task`` and wait until it has ended (its error, if any, is dropped)."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
