"""A RouterService and the feeds that keep it current, built in one place.

Used by the router process (``router/main.py``, which serves the service's endpoints) and
by the frontend when it routes in its own process (``Frontend.routing: in_process``), so
both observe the fleet the same way:

- discovery: the worker client's instance ids (read on every decision);
- KV events: ``KvEventIndex`` over NATS, for prefix overlap (``use_kv_events``): the
  pool's through Dynamo's subject, the host and disk tiers' through this project's
  (``tier_event_subject``), with lost messages counted on /metrics (``TierFeedMetrics``);
- load reports: ``watch_loads`` on the workers' load subject;
- policy versions: ``ComponentContext.follow_policy`` (router and QoS sections of `dynamo policy apply`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from splitserve.contracts.metrics import PREFIX

from splitserve.contracts.wire import load_subject

from .seed_policy import SeedRouting
from .service import RouterMetrics, RouterService, watch_loads
from .service_config import load_policy
from .service_config import RouterComponentConfig

log = logging.getLogger("splitserve.router")


def routed_component(cfg: RouterComponentConfig, links: list[str]) -> str:
    """The component whose workers are routed to: ``worker_component`` if set, else the
    first linked component whose name ends in "Worker" (the router's own links are only
    workers; the frontend's may also name the Planner)."""
    return cfg.worker_component or next((n for n in links if n.endswith("Worker")), "Worker")


@dataclass
class RouterFeeds:
    """A running RouterService with its feeds; ``close`` stops them (after ``stopping``)."""

    service: RouterService
    component: str
    worker_client: Any
    indexer: Any
    loads: asyncio.Task
    watcher: Any
    serving: list[asyncio.Future] = field(default_factory=list)
    sharing: asyncio.Task | None = None
    """Placements shared with sibling frontend processes (``share.start_sharing``)."""

    async def close(self) -> None:
        """Called once the component's ``stopping`` event is set: stop following policy
        versions, wait for the load subscription to drain, close the KV event index,
        stop serving the endpoints in ``serving``."""
        for task in self.serving:
            task.cancel()
        if self.watcher is not None:
            await self.watcher.stop()
        try:
            await asyncio.wait_for(self.loads, 5)
        except (TimeoutError, Exception) as exc:  # noqa: BLE001 - shutting down anyway
            log.debug("load reports did not stop cleanly: %s", exc)
        if self.sharing is not None:
            try:
                await asyncio.wait_for(self.sharing, 5)
            except (TimeoutError, Exception) as exc:  # noqa: BLE001 - shutting down anyway
                log.debug("placement sharing did not stop cleanly: %s", exc)
        if self.indexer is not None:
            await self.indexer.close()


class TierFeedMetrics(Collector):
    """The KV tier event feed of one router's index on its /metrics: messages applied and
    messages found missing (each drops a worker's host and disk blocks until reported
    again; docs/kv_tiers.md)."""

    def __init__(self, indexer) -> None:
        self.indexer = indexer

    def collect(self):
        applied = CounterMetricFamily(f"{PREFIX}_router_kv_tier_event_messages",
                                      "Lower-tier KV event messages applied to the index")
        applied.add_metric([], self.indexer.tier_messages)
        yield applied
        gaps = CounterMetricFamily(f"{PREFIX}_router_kv_tier_event_gaps", "Gaps in a "
                                   "worker's lower-tier KV event sequence (messages lost)")
        gaps.add_metric([], self.indexer.tier_gaps)
        yield gaps
        asked = CounterMetricFamily(f"{PREFIX}_router_kv_announce_requests", "Requests for "
                                    "workers to announce their KV caches again (at start, "
                                    "and after a gap in a worker's tier events)")
        asked.add_metric([], self.indexer.announce_requests)
        yield asked
        indexed = GaugeMetricFamily(f"{PREFIX}_router_kv_indexed_blocks", "KV blocks the "
                                    "router's index holds, per tier, over every worker",
                                    labels=["tier"])
        for tier, n in self.indexer.tiers.block_counts().items():
            indexed.add_metric([tier], n)
        yield indexed


def block_hasher(block_size: int) -> Callable[[list[int], str | None], list[int]]:
    """``hash_blocks(token_ids, lora)``: the prompt's block hashes as the prefix index
    keys them, with the LoRA adapter's name mixed in as the workers' KV events mix it in
    (their publisher is given it), so a base-model prefix is never credited to an
    adapter's request, nor one adapter's to another's."""
    from dynamo.llm import compute_block_hash_for_seq

    def hash_blocks(tokens: list[int], lora: str | None = None) -> list[int]:
        return compute_block_hash_for_seq(tokens, block_size, lora_name=lora)

    return hash_blocks


def policy_applier(service: RouterService, cfg: RouterComponentConfig):
    """The function ``follow_policy`` calls with each policy version for this service."""

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

    return apply_policy


async def start_routing(ctx, cfg: RouterComponentConfig, instance: str,
                        registry: CollectorRegistry | None = None,
                        share: bool = False) -> RouterFeeds:
    """Build the RouterService for ``ctx``'s graph and start its feeds.

    ``instance`` names this process in `dynamo policy show`; ``registry`` is where the
    router's metrics go (the frontend passes its own, so they appear on its /metrics);
    ``share``: placements are shared with every other process that routes to the same
    workers with it (``share.PlacementShare``: frontend processes routing in process).
    Returns once discovery, KV events, load reports and the policy watcher are running.
    """
    component = routed_component(cfg, ctx.run.links)
    router = load_policy(cfg)
    client = await ctx.endpoint(component, "generate").client()
    indexer = None
    hash_blocks = None
    if cfg.use_kv_events:
        from .kv_index import KvEventIndex

        indexer = KvEventIndex(ctx.namespace, component)
        await indexer.start(os.environ["NATS_SERVER"])
        hash_blocks = block_hasher(cfg.block_size)
    service = RouterService(cfg, router, client, indexer, metrics=RouterMetrics(registry),
                            hash_blocks=hash_blocks,
                            worker_endpoint=f"{ctx.namespace}.{component.lower()}.generate")
    if indexer is not None:
        service.metrics.registry.register(TierFeedMetrics(indexer))
    loads = asyncio.create_task(watch_loads(
        os.environ["NATS_SERVER"], load_subject(ctx.namespace, component), service,
        ctx.stopping))
    sharing = None
    if share:
        from .share import share_subject, start_sharing

        _, sharing = await start_sharing(os.environ["NATS_SERVER"],
                                         share_subject(ctx.namespace, component), service,
                                         ctx.stopping)
    watcher = await ctx.follow_policy("Router", instance, policy_applier(service, cfg))
    log.info("routing to %s.%s with profiles %s", ctx.namespace, component.lower(),
             router.profile_names)
    return RouterFeeds(service=service, component=component, worker_client=client,
                       indexer=indexer, loads=loads, watcher=watcher, sharing=sharing)
