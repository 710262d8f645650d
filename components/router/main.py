"""Router process: `python -m splitserve.components.router.main --config FILE`."""

from __future__ import annotations

import asyncio
import logging
import os

from splitserve.components.protocol import load_subject
from splitserve.serve.component import ComponentContext, run

from .kv_index import KvEventIndex
from .seed_policy import SeedRouting
from .service import RouterService, load_policy, watch_loads
from .service_config import RouterComponentConfig

log = logging.getLogger("splitserve.router")


async def main(ctx: ComponentContext) -> None:
    cfg = ctx.config(RouterComponentConfig)
    component = cfg.worker_component or (ctx.run.links[0] if ctx.run.links else "Worker")
    router = load_policy(cfg)
    worker_ep = ctx.endpoint(component, "generate")
    client = await worker_ep.client()
    indexer = None
    hash_blocks = None
    if cfg.use_kv_events:
        from dynamo.llm import compute_block_hash_for_seq

        indexer = KvEventIndex(ctx.namespace, component)
        await indexer.start(os.environ["NATS_SERVER"])

        def hash_blocks(tokens: list[int]) -> list[int]:
            return compute_block_hash_for_seq(tokens, cfg.block_size)
    service = RouterService(cfg, router, client, indexer, hash_blocks=hash_blocks,
                            worker_endpoint=f"{ctx.namespace}.{component.lower()}.generate")
    ctx.serve_metrics(service.metrics.registry)
    loads = asyncio.create_task(watch_loads(
        os.environ["NATS_SERVER"], load_subject(ctx.namespace, component), service,
        ctx.stopping))
    route_ep = ctx.endpoint("Router", "route")
    release_ep = ctx.endpoint("Router", "release")
    status_ep = ctx.endpoint("Router", "status")
    serving = [asyncio.ensure_future(route_ep.serve_endpoint(service.route)),
               asyncio.ensure_future(release_ep.serve_endpoint(service.release)),
               asyncio.ensure_future(status_ep.serve_endpoint(service.status_handler))]
    def apply_policy(policy, version: int) -> None:
        # Build everything first, then swap: a failure leaves the running policy intact.
        router_core = service.router
        if policy.router is not None:
            router_core = load_policy(cfg.model_copy(update={"policy": policy.router}))
        if policy.qos is not None:
            service.qos.reconfigure(policy.qos)
        # The routing sections (cache, split_policy, hotspot prevention) of this version.
        service.router = router_core.with_seed(SeedRouting.from_policy(policy))
        log.info("policy v%d routing: %s", version, service.router.seed.describe())

    from splitserve.policy.component import follow_policy

    watcher = await follow_policy(ctx.namespace, "Router", f"{route_ep.connection_id():x}",
                                  apply_policy)
    ctx.report("ready", endpoint=f"{ctx.namespace}.router.route",
               detail=f"policy {cfg.policy if isinstance(cfg.policy, str) else 'inline'}")
    log.info("routing to %s.%s with profiles %s", ctx.namespace, component.lower(),
             router.profile_names)
    await ctx.stopping.wait()
    ctx.report("stopping")
    for ep in (route_ep, release_ep, status_ep):
        try:
            await ep.unregister_endpoint_instance()
        except Exception as exc:  # noqa: BLE001
            log.warning("deregistration failed: %s", exc)
    await watcher.stop()
    for t in serving:
        t.cancel()
    await asyncio.wait_for(loads, 5)
    if indexer is not None:
        await indexer.close()


if __name__ == "__main__":
    run(main)
