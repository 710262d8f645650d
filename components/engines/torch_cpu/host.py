"""Bringing the torch engine up in a worker process, for any role.

Loads the graph's model (``Common.model``, reporting progress; the endpoint is registered only once it is loaded,
so readiness means "can answer"), runs the engine core on its own thread
(``EngineRunner``) and, where the role publishes KV events, sends the core's events to
Dynamo's KvEventPublisher straight from the runner.  Disaggregated roles get a NIXL
agent: the prefill side writes KV into blocks the decode side reserved.  A failed
engine thread makes the replica leave (deregister, exit 70) so it is restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

from splitserve.contracts.kit.fatal import leave_after_engine_failure
from splitserve.contracts.kit.hosting import (
    PUBLISHES_KV,
    Hosted,
    Role,
    never,
    publish_kv_events,
    serve_announce_requests,
    start_tier_events,
)
from splitserve.contracts.kit.worker_metrics import WorkerMetrics
from splitserve.contracts.kit.component import ComponentContext

from .adapter import TorchEngine
from .runner import EngineRunner


def build_core(args, model: str, threads: int, progress):
    """Load ``model`` and build the engine core (runs in a thread: it takes seconds)."""
    from . import EngineConfig, EngineCore, configure_threads, load_model
    from .grammar import JsonGrammars

    configure_threads(threads)
    loaded = load_model(model, progress=progress)
    cfg = EngineConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                       max_running=args.max_num_seqs, max_prefill_tokens=args.max_prefill_tokens,
                       max_chunk_tokens=args.max_chunk_tokens, max_loras=args.max_loras,
                       max_lora_rank=args.max_lora_rank,
                       host_kv_cache_gib=args.host_kv_cache_gib,
                       disk_kv_cache_dir=args.disk_kv_cache_dir,
                       disk_kv_cache_gib=args.disk_kv_cache_gib)
    grammars = JsonGrammars(loaded.tokenizer, loaded.config.vocab_size)
    return EngineCore(loaded.weights, loaded.config, cfg, grammars=grammars)


async def host_torch(ctx: ComponentContext, cfg, role: Role,
                     stack: contextlib.AsyncExitStack, factory=None) -> Hosted:
    """The registry's host for ``engine: torch``: model, runner thread, KV events (agg and
    decode) and, for the disaggregated roles, the NIXL agent."""
    from .loader import default_num_threads

    args = cfg.engine_args
    threads = args.threads or default_num_threads(cfg.replicas)
    ctx.report("loading", detail="loading model")

    def progress(stage: str, fraction: float) -> None:
        ctx.report("loading", detail=f"{stage} {fraction:.0%}")

    core = await asyncio.to_thread(build_core, args, ctx.run.common.model, threads, progress)
    endpoint = ctx.endpoint(ctx.run.component, "generate")
    on_events = None
    tier_publisher = None
    if role in PUBLISHES_KV:
        from dynamo.llm import KvEventPublisher

        publisher = KvEventPublisher(endpoint, kv_block_size=args.block_size)
        stack.callback(publisher.shutdown)
        tier_publisher = await _start_tier_events(ctx, core, endpoint.connection_id(), stack)

        def on_events(evs: list) -> None:
            publish_kv_events(publisher, evs)  # the pool's
            if tier_publisher is not None:
                tier_publisher.submit(evs, core.kv.restore_costs())  # the host and disk tiers'
    leaving: set[asyncio.Task] = set()

    def on_fatal(exc: BaseException) -> None:
        leaving.add(asyncio.ensure_future(leave_after_engine_failure(
            exc, ctx.report, endpoint.unregister_endpoint_instance)))

    runner = EngineRunner(core, asyncio.get_running_loop(), on_kv_events=on_events,
                          on_fatal=on_fatal)
    runner.start()
    if role in PUBLISHES_KV:
        from splitserve.contracts.block_events import kv_announce_subject

        await serve_announce_requests(
            os.environ["NATS_SERVER"], kv_announce_subject(ctx.namespace, ctx.run.component),
            endpoint.connection_id(), runner.announce_cache, stack)
    stack.callback(core.close)  # after the runner stopped: the disk tier's writer and files
    stack.callback(runner.stop)
    worker_id = endpoint.connection_id()
    metrics = WorkerMetrics()
    if core.kv.tier_stats():
        from .tier_metrics import TierMetrics

        metrics.registry.register(TierMetrics(core.kv, tier_publisher))
    ctx.serve_metrics(metrics.registry)
    agent = await _start_agent(ctx, cfg, role, core, worker_id, stack)
    # A reservation abandoned on timeout is held until the job's deadline has passed
    # (plus a margin): a late write could still land in its blocks.
    hold = (cfg.remote_prefill_timeout_s if role == "decode" else 30.0) + 5.0
    eng = TorchEngine(core, runner, args.block_size, agent,
                      arrival_timeout_s=cfg.kv_transfer.timeout_s if agent else 10.0,
                      late_write_hold_s=hold, kv_moves=getattr(cfg, "kv_moves", False),
                      park_hold_s=getattr(cfg, "kv_move_hold_s", 15.0))
    stack.push_async_callback(eng.shutdown)
    # The runner itself leaves (deregisters, exit 70) when its engine fails.
    return Hosted(eng, endpoint, worker_id, metrics, never(),
                  detail=f"agent {agent.name}" if agent else "")


async def _start_tier_events(ctx: ComponentContext, core, worker_id: int,
                             stack: contextlib.AsyncExitStack):
    """With offload tiers, start publishing their events to the routers on this
    project's tier subject (``tier_events``); None without tiers."""
    capacity = core.kv.tier_capacity_blocks()
    if not capacity:
        return None
    from splitserve.contracts.block_events import tier_event_subject

    return await start_tier_events(os.environ["NATS_SERVER"], worker_id, capacity,
                                   tier_event_subject(ctx.namespace, ctx.run.component),
                                   stack)


async def _start_agent(ctx: ComponentContext, cfg, role: Role, core, worker_id: int,
                       stack: contextlib.AsyncExitStack):
    """The NIXL agent of a decode or prefill replica, or of an aggregated one with live
    KV moves (None for other aggregated ones)."""
    if role == "agg" and not cfg.kv_moves:
        return None
    from splitserve.components.engines.torch_cpu.kv_transfer import KvTransferAgent

    agent = KvTransferAgent(f"{role}-{worker_id:x}", core.kv_pool(),
                            etcd_endpoints=os.environ["ETCD_ENDPOINTS"],
                            config=cfg.kv_transfer.model_copy(
                                update={"namespace": ctx.namespace}))
    await agent.start()
    stack.push_async_callback(agent.close)
    if role != "prefill":  # it receives KV
        agent.start_poller()
    return agent
