"""Frontend process: `python -m splitserve.components.frontend.main --config FILE`."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from splitserve.contracts.kit.component import ComponentContext, endpoint_path, run
from splitserve.contracts.kit.shared_listener import InheritedListener, inherited_listener

from . import formats
from .app import FrontendState, build_app
from .backend import BackendMetrics, DirectBackend, RoutedBackend
from .capabilities import graph_engines
from .config import FrontendConfig
from .http_server import FrontendServer, HttpLimits, server_config
from .inproc import InProcessBackend
from .loop_lag import LoopLag
from .loras import AdapterCatalog, EtcdAdapterStore
from .metrics import FrontendMetrics
from .progress import ProgressFeed, ProgressMetrics
from .state import ModelLane
from .textcodec import TextCodec, TokenizerBackend

log = logging.getLogger("splitserve.frontend")


def _context_factory():
    from dynamo.runtime import Context

    return lambda request_id: Context(id=request_id)


async def main(ctx: ComponentContext) -> None:
    cfg = ctx.config(FrontendConfig)
    links = ctx.run.links
    metrics = FrontendMetrics()
    backend_metrics = BackendMetrics(metrics.registry)
    routing = None
    watches: list[asyncio.Task] = []
    adapters = AdapterCatalog()
    if cfg.routing == "in_process":
        backend, routing = await _in_process_backend(ctx, cfg, metrics, backend_metrics)
    else:
        backend = await _backend(ctx, cfg, ctx.namespace, backend_metrics, watches, adapters)
    state = FrontendState(model_name=ctx.run.common.served_model_name, codec=None, backend=backend,
                          metrics=metrics,
                          max_inflight=cfg.max_inflight,
                          default_max_tokens=cfg.default_max_tokens,
                          first_token_timeout_s=cfg.first_token_timeout_s,
                          inter_token_timeout_s=cfg.inter_token_timeout_s,
                          priority_header=cfg.priority_header.lower(),
                          context_factory=_context_factory(),
                          max_body_bytes=cfg.max_body_bytes, body_timeout_s=cfg.body_timeout_s,
                          max_pending_prepares=cfg.max_pending_tokenizations,
                          max_tokenization_wait_s=cfg.max_tokenization_wait_s,
                          max_loop_lag_s=cfg.max_loop_lag_ms / 1000.0, loop_lag=LoopLag(),
                          prepare_pool=ThreadPoolExecutor(cfg.tokenizer_threads,
                                                          "frontend-tokenize"),
                          dependencies_down=ctx.watch_dependencies(),
                          engines=graph_engines(ctx.run),
                          tool_call_parser=cfg.tool_call_parser,
                          reasoning_parser=cfg.reasoning_parser,
                          namespace=ctx.namespace, model_source=ctx.run.common.model,
                          adapters=adapters,
                          lora_load_timeout_s=cfg.lora_load_timeout_s,
                          **_adapter_management())
    limits = HttpLimits(header_timeout_s=cfg.header_timeout_s,
                        body_timeout_s=cfg.body_timeout_s,
                        keep_alive_timeout_s=cfg.keep_alive_timeout_s,
                        max_connections=cfg.max_connections,
                        max_header_bytes=cfg.max_header_bytes)
    host = cfg.host or ctx.run.common.bind_host
    server = FrontendServer(server_config(build_app(state), host, cfg.port, limits))
    shared = inherited_listener()
    server.shared = shared is not None
    watches.append(asyncio.create_task(state.loop_lag.run(
        ctx.stopping, metrics.loop_lag, busy=lambda: state.inflight > 0)))
    serve_task = None
    if shared is None or shared.early:  # accept now; requests get 503 while it loads
        serve_task = await _start_serving(server, shared)
        if serve_task is None:
            return
    if shared is not None and ctx.run.config.get("replicas", 1) > 1:
        # The API port's /metrics answers from whichever replica accepts: each replica's
        # own counters are on a port of its own (`dynamo status` lists them).
        ctx.serve_metrics(metrics.registry)
    port = shared.port if shared is not None else server.servers[0].sockets[0].getsockname()[1]
    url = f"http://{host}:{port}"
    ctx.report("loading", endpoint=url, detail="loading tokenizer")
    state.codec = await asyncio.to_thread(_load_codec, cfg.model_dir, ctx.run.common.model,
                                          ctx.run.common.effective_context_length(),
                                          cfg.tokenizer)
    log.info("tokenising with %s", state.codec.encoder)
    await asyncio.to_thread(_choose_formats, state, cfg.tool_call_parser,
                            cfg.reasoning_parser)
    preload = (asyncio.create_task(_preload_formats([state.first_lane()]))
               if cfg.preload_parsers else None)
    for pool, common in ctx.run.pools.items():
        state.pools[common.served_model_name] = await _pool_lane(
            ctx, cfg, pool, common, backend_metrics, watches, adapters)
    await _follow_adapters(adapters, [lane.namespace for lane in state.lanes()])
    if preload is not None:
        ctx.report("loading", endpoint=url, detail="importing the tool-call parsers")
        await preload
        await _preload_formats(list(state.pools.values()))
    if serve_task is None:  # one of several replicas: accept only once it can answer
        serve_task = await _start_serving(server, shared)
        if serve_task is None:
            return
    ctx.report("ready", endpoint=url)
    log.info("serving %s at %s (links: %s)", ", ".join(lane.name for lane in state.lanes()),
             url, ", ".join(links))
    await ctx.stopping.wait()
    ctx.report("stopping", endpoint=url)
    server.should_exit = True  # stop accepting, answer what was accepted, finish in-flight
    await asyncio.wait_for(serve_task, ctx.run.common.shutdown_timeout_s)
    await adapters.close()
    for lane in state.lanes():
        feed = getattr(lane.backend, "progress_feed", None)
        if feed is not None:
            await feed.close()
    if routing is not None:
        await routing.close()


async def _start_serving(server: FrontendServer,
                         shared: InheritedListener | None) -> asyncio.Task | None:
    """Start accepting (on the socket the supervisor shares, or on one of its own);
    returns the server's task once it accepts, None when it ended first (its error raised)."""
    serve_task = asyncio.create_task(server.serve(
        sockets=[shared.sock] if shared is not None else None))
    while not server.started:
        if serve_task.done():
            serve_task.result()
            return None
        await asyncio.sleep(0.02)
    return serve_task


def _adapter_management() -> dict:
    """The control token and the etcd store of the LoRA management endpoints, from the
    variables the supervisor sets (its token file, ETCD_ENDPOINTS); without them the
    endpoints refuse every request."""
    from splitserve.contracts.kit.credentials import read_secret

    found: dict = {}
    token_file = os.environ.get("SPLITSERVE_CONTROL_TOKEN_FILE")
    if token_file:
        try:
            found["control_token"] = read_secret(token_file)
        except (OSError, ValueError) as exc:
            log.warning("LoRA adapter management is off: the control token cannot be read "
                        "(%s)", exc)
    if os.environ.get("ETCD_ENDPOINTS"):
        found["adapter_store"] = EtcdAdapterStore(os.environ["ETCD_ENDPOINTS"])
    return found


async def _follow_adapters(adapters: AdapterCatalog, namespaces: list[str],
                           first_read_s: float = 5.0) -> None:
    """Follow the LoRA adapters of every served model's namespace; returns after each
    was read once (or ``first_read_s``), so a restarted frontend serves them at once."""
    endpoints = os.environ.get("ETCD_ENDPOINTS")
    if not endpoints:
        return
    firsts = [adapters.follow(endpoints, ns) for ns in namespaces]
    await asyncio.wait([asyncio.ensure_future(f.wait()) for f in firsts],
                       timeout=first_read_s)


async def _backend(ctx: ComponentContext, cfg: FrontendConfig, namespace: str,
                   backend_metrics: BackendMetrics, watches: list[asyncio.Task],
                   adapters: AdapterCatalog):
    """The backend of the model pool in Dynamo namespace ``namespace``: its Router
    process when the graph routes, else its workers directly (an adapter request to
    those that have it loaded)."""
    links = ctx.run.links

    async def client(component: str, endpoint: str):
        return await ctx.runtime.endpoint(endpoint_path(namespace, component,
                                                        endpoint)).client()

    if "Router" in links:
        async def connect(path: str):
            return await ctx.runtime.endpoint(path).client()

        backend = RoutedBackend(await client("Router", "route"), connect,
                                cfg.route_timeout_s, migration_limit=cfg.migration_limit,
                                status_client=await client("Router", "status"),
                                metrics=backend_metrics, stall_s=cfg.stall_migration_s)
        backend.release_client = await client("Router", "release")
        if cfg.progress_interval_ms > 0:
            backend.progress_feed = ProgressFeed(
                await client("Router", "progress"), cfg.progress_interval_ms / 1000.0,
                metrics=_progress_metrics(backend_metrics))
        watches.append(asyncio.create_task(backend.watch(ctx.stopping)))
        return backend
    target = next((n for n in links if n.endswith("Worker")), "Worker")
    return DirectBackend(await client(target, "generate"),
                         migration_limit=cfg.migration_limit, metrics=backend_metrics,
                         adapter_workers=adapters.holders(namespace),
                         stall_s=cfg.stall_migration_s)


def _progress_metrics(backend_metrics: BackendMetrics) -> ProgressMetrics:
    """The progress feeds' counters, one set in the registry whatever the pools."""
    found = backend_metrics.progress
    if found is None:
        found = backend_metrics.progress = ProgressMetrics(backend_metrics.registry)
    return found


async def _pool_lane(ctx: ComponentContext, cfg: FrontendConfig, pool: str, common,
                     backend_metrics: BackendMetrics, watches: list[asyncio.Task],
                     adapters: AdapterCatalog) -> ModelLane:
    """One more model of the graph (a ``Models`` pool): its tokenizer and formats from
    its own files, its pool's router or workers in the pool's namespace."""
    ctx.report("loading", detail=f"loading the tokenizer of {common.served_model_name}")
    lane = ModelLane(common.served_model_name,
                     await _backend(ctx, cfg, common.namespace, backend_metrics, watches,
                                    adapters), namespace=common.namespace,
                     source=common.model)
    lane.codec = await asyncio.to_thread(_load_codec, None, common.model,
                                         common.effective_context_length(), cfg.tokenizer)
    await asyncio.to_thread(_choose_formats, lane, None, None)
    log.info("model pool %s: serving %s (namespace %s)", pool, lane.name, common.namespace)
    return lane


async def _in_process_backend(ctx: ComponentContext, cfg: FrontendConfig,
                              metrics: FrontendMetrics, backend_metrics: BackendMetrics):
    """The router's service and feeds in this process (``routing: in_process``); its
    metrics join the frontend's /metrics.  Returns the backend and the feeds to close."""
    from splitserve.components.router.feeds import start_routing

    instance = f"frontend-{ctx.run.replica}-{os.getpid():x}"
    routing = await start_routing(ctx, cfg.router_settings(), instance, metrics.registry,
                                  share=True)
    # `dynamo route explain` reaches this replica's routing here (read-only: explain is
    # forced on, nothing is recorded).
    routing.serving.append(asyncio.ensure_future(
        ctx.endpoint("Frontend", "explain").serve_endpoint(routing.service.explain)))
    backend = InProcessBackend(routing.service, routing.worker_client, cfg.route_timeout_s,
                               migration_limit=cfg.migration_limit, metrics=backend_metrics,
                               stall_s=cfg.stall_migration_s)
    log.info("routing in process (no Router process); placements shared with the "
             "other frontend processes routing to the same workers")
    return backend, routing


def _choose_formats(lane: FrontendState | ModelLane, tool_call_parser: str | None,
                    reasoning_parser: str | None) -> None:
    """A model's tool-call and reasoning formats: named in the config (the first
    model's), else from the model's chat template (``formats.resolve``); logged once.
    vLLM's parsers are imported now when a parser was named or the model thinks (then
    every request needs one), else before the frontend reports ready
    (``_preload_formats``, ``Frontend.preload_parsers``) or on the first request with
    tools (seconds, once: ``formats.load``)."""
    codec = lane.codec
    chosen = formats.resolve(tool_call_parser, reasoning_parser,
                             codec.tok.chat_template, codec.template_has_tools)
    lane.tool_call_parser, lane.reasoning_parser = chosen.tool, chosen.reasoning
    log.info("tool calls: %s, reasoning: %s (%s)", chosen.tool or "none",
             chosen.reasoning or "none", chosen.why)
    named = tool_call_parser is not None or reasoning_parser is not None
    if not named and chosen.reasoning is None:
        return
    try:
        formats.load(chosen.tool, chosen.reasoning, codec.tok)
    except ValueError as exc:  # the tokenizer lacks the format's markers
        if named:
            raise  # a parser the operator named must fit: fail the start
        log.warning("answers are not split into reasoning: %s", exc)
        lane.reasoning_parser = None


async def _preload_formats(lanes: list) -> None:
    """Import vLLM's parsers for each model with a tool-call format, in a thread, before
    the frontend reports ready (beside the rest of its start, the workers' too): a first
    request with tools would otherwise wait for the import (seconds), and while the
    import holds the interpreter every other request's tokens would be late."""
    for lane in lanes:
        if lane.tool_call_parser is None:
            continue
        t0 = time.monotonic()
        try:
            await asyncio.to_thread(formats.load, lane.tool_call_parser,
                                    lane.reasoning_parser, lane.codec.tok)
        except ValueError as exc:  # requests with tools get 500 output_format_unavailable
            log.warning("tool calls of %s cannot be read: %s", lane.name, exc)
            continue
        except Exception as exc:  # noqa: BLE001 - serve on: a request with tools retries
            log.warning("could not import the tool-call parser %s for %s (a request with "
                        "tools will try again): %s", lane.tool_call_parser, lane.name, exc)
            continue
        log.info("tool-call parser %s for %s ready in %.1fs", lane.tool_call_parser,
                 lane.name, time.monotonic() - t0)


def _load_codec(model_dir: str | None, model: str, context_length: int,
                encoder: TokenizerBackend = "auto") -> TextCodec:
    """The tokenizer of ``Frontend.model_dir`` when set, else of ``Common.model``'s own
    directory (the packaged model's export for the default)."""
    from splitserve.contracts.model_files import model_dir as dir_of

    return TextCodec.from_dir(Path(model_dir) if model_dir else dir_of(model), context_length,
                              encoder)


def runtime_env(run_cfg) -> dict[str, str]:
    """Dynamo's runtime settings from the section (``Frontend.runtime_threads``)."""
    threads = FrontendConfig.model_validate(run_cfg.config).runtime_threads
    return {} if threads is None else {"DYN_RUNTIME_NUM_WORKER_THREADS": str(threads)}


if __name__ == "__main__":
    run(main, runtime_env=runtime_env)
