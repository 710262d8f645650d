"""Router process: `python -m splitserve.components.router.main --config FILE`."""

from __future__ import annotations

import asyncio
import logging

from splitserve.contracts.kit.component import ComponentContext, run

from .feeds import start_routing
from .service_config import RouterComponentConfig

log = logging.getLogger("splitserve.router")


async def main(ctx: ComponentContext) -> None:
    cfg = ctx.config(RouterComponentConfig)
    route_ep = ctx.endpoint("Router", "route")
    release_ep = ctx.endpoint("Router", "release")
    status_ep = ctx.endpoint("Router", "status")
    progress_ep = ctx.endpoint("Router", "progress")
    # Placements shared with the other replicas routing to the same workers (a Router
    # replica sees only the requests the frontends sent to it).
    feeds = await start_routing(ctx, cfg, f"{route_ep.connection_id():x}", share=True)
    service = feeds.service
    ctx.serve_metrics(service.metrics.registry)
    serving = [asyncio.ensure_future(route_ep.serve_endpoint(service.route)),
               asyncio.ensure_future(release_ep.serve_endpoint(service.release)),
               asyncio.ensure_future(status_ep.serve_endpoint(service.status_handler)),
               asyncio.ensure_future(progress_ep.serve_endpoint(service.progress))]
    ctx.report("ready", endpoint=f"{ctx.namespace}.router.route",
               detail=f"policy {cfg.policy if isinstance(cfg.policy, str) else 'inline'}")
    await ctx.stopping.wait()
    ctx.report("stopping")
    for ep in (route_ep, release_ep, status_ep, progress_ep):
        try:
            await ep.unregister_endpoint_instance()
        except Exception as exc:  # noqa: BLE001
            log.warning("deregistration failed: %s", exc)
    for t in serving:
        t.cancel()
    await feeds.close()


if __name__ == "__main__":
    run(main)
