"""The torch (CPU reference) worker: the real SmolLM2 model behind Dynamo's runtime.

Loads the model (reporting progress; the endpoint is registered only once it is loaded,
so readiness means "can answer"), runs the engine core on its own thread, serves
`generate`, publishes KV events through Dynamo's KvEventPublisher (so routers' radix
trees see this worker's prefix cache) and load reports over NATS.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import uuid
from dataclasses import dataclass

from splitserve.components.engines.interface import GenerateParams, params_from_wire
from splitserve.components.protocol import (
    NO_LOGPROB,
    TokenLogprobs,
    WorkerLoad,
    WorkerRequest,
    load_subject,
    output_chunk,
)
from splitserve.serve.component import ComponentContext, serve_until_stopped

from .cancel import until_stopped
from .config import TorchWorkerConfig
from .fatal import leave_after_engine_failure
from .loadreport import ReportFailures, publish_load
from .metrics import WorkerMetrics
from .readiness import report_ready_when_registered
from .runner import EngineRunner

log = logging.getLogger("splitserve.worker")

FINISH = {"stop": "eos", "length": "length", "abort": "cancelled"}


def torch_request(request_id: str, params: GenerateParams, **extra):
    """The engine core's request for ``params`` (``extra``: core-only fields such as
    ``prefill_only``); raises ValueError if invalid."""
    from splitserve.components.engines.torch_cpu import Request

    return Request(
        request_id=request_id, prompt_token_ids=params.token_ids,
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
        seed=params.seed, stop_token_ids=params.stop_token_ids, priority=params.priority,
        top_k=params.top_k, min_p=params.min_p, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, logit_bias=params.logit_bias,
        min_tokens=params.min_tokens, logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs, json_schema=params.json_schema, **extra)


def engine_request(wreq: WorkerRequest, request_id: str):
    """Map the wire request onto the engine core's request (raises ValueError if invalid)."""
    return torch_request(request_id, params_from_wire(wreq))


def output_logprobs(out) -> tuple[TokenLogprobs | None, TokenLogprobs | None]:
    """A core ``RequestOutput``'s sampled-token and prompt log-probabilities, if any."""
    def wire(values, tops) -> TokenLogprobs:
        return TokenLogprobs(logprobs=[v if math.isfinite(v) else NO_LOGPROB for v in values],
                             top=[[(t, v if math.isfinite(v) else NO_LOGPROB) for t, v in top]
                                  for top in tops or ()])

    sampled = prompt = None
    if out.logprobs is not None:
        sampled = wire(out.logprobs, out.top_logprobs)
    if out.prompt_logprobs is not None:
        prompt = wire(out.prompt_logprobs, out.prompt_top_logprobs)
    return sampled, prompt


def build_engine(args, threads: int, progress):
    """Load SmolLM2 and build the engine core (runs in a thread: it takes seconds)."""
    from splitserve.components.engines.torch_cpu import (
        EngineConfig,
        EngineCore,
        configure_threads,
        load_smollm2,
    )

    from splitserve.components.engines.torch_cpu.grammar import JsonGrammars

    configure_threads(threads)
    loaded = load_smollm2(progress=progress)
    cfg = EngineConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                       max_running=args.max_num_seqs, max_prefill_tokens=args.max_prefill_tokens,
                       max_chunk_tokens=args.max_chunk_tokens)
    grammars = JsonGrammars(loaded.tokenizer, loaded.config.vocab_size)
    return EngineCore(loaded.weights, loaded.config, cfg, grammars=grammars)


async def stream_outputs(runner: EngineRunner, q, rid: str, metrics: WorkerMetrics,
                         produced: int = 0):
    """Yield wire chunks for one engine request until it finishes; aborts it if abandoned.

    Shared by the aggregated handler and the decode worker (after a remote prefill the
    request's first output arrives on the same kind of queue).
    """
    finished = False
    try:
        while not finished:
            out = await q.get()
            if isinstance(out, BaseException):
                finished = True
                metrics.requests.labels("error").inc()
                yield output_chunk([], "error", error=str(out))
                return
            finished = out.finished
            if out.finish_reason == "error":
                metrics.requests.labels("error").inc()
                yield output_chunk(list(out.new_token_ids), "error", error=out.error)
                return
            produced += len(out.new_token_ids)
            reason = FINISH.get(out.finish_reason, "eos") if finished else None
            usage = {}
            if finished:
                usage = dict(prompt_tokens=out.num_prompt_tokens,
                             cached_tokens=out.num_cached_tokens, completion_tokens=produced)
                metrics.requests.labels(out.finish_reason or "stop").inc()
            sampled, prompt = output_logprobs(out)
            yield output_chunk(list(out.new_token_ids), reason, logprobs=sampled,
                               prompt_logprobs=prompt, **usage)
    finally:
        if not finished:
            runner.abort(rid)


def make_handler(runner: EngineRunner, metrics: WorkerMetrics | None = None):
    """The `generate` endpoint handler: one engine request, streamed step by step."""
    metrics = metrics or WorkerMetrics()

    async def generate(request: dict, context=None):
        try:
            wreq = WorkerRequest.model_validate(request)
            rid = wreq.meta().request_id or uuid.uuid4().hex
            ereq = engine_request(wreq, rid)
            runner.core.check_token_ids(ereq.prompt_token_ids, rid)
            q = runner.submit(ereq)
        except Exception as exc:  # noqa: BLE001 - bad request, engine gone or refused
            metrics.requests.labels("rejected").inc()
            yield output_chunk([], "error", error=f"request refused: {exc}")
            return
        async for chunk in until_stopped(stream_outputs(runner, q, rid, metrics), context):
            yield chunk

    return generate


def publish_kv_events(publisher, events: list) -> None:
    """Forward the engine's BlockStored / BlockRemoved events to Dynamo's publisher."""
    for ev in events:
        if hasattr(ev, "token_ids"):
            publisher.publish_stored(list(ev.token_ids), list(ev.num_block_tokens),
                                     list(ev.block_hashes), ev.parent_hash)
        else:
            publisher.publish_removed(list(ev.block_hashes))


@dataclass
class TorchWorker:
    """A loaded engine on its thread, registered endpoint, metrics and load reports."""

    core: object
    runner: EngineRunner
    endpoint: object
    metrics: WorkerMetrics
    worker_id: int
    reporter: asyncio.Task
    publisher: object | None = None

    async def close(self) -> None:
        self.runner.stop()
        if self.publisher is not None:
            self.publisher.shutdown()
        await asyncio.wait_for(self.reporter, 5)


async def start_torch_worker(ctx: ComponentContext, cfg, publish_kv: bool = True
                             ) -> TorchWorker:
    """Load the model (reporting progress), start the engine thread, metrics and load
    reports.  Called by every torch-engine worker (aggregated, decode, prefill)."""
    args = cfg.engine_args
    threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, cfg.replicas))
    ctx.report("loading", detail="loading model")

    def progress(stage: str, fraction: float) -> None:
        ctx.report("loading", detail=f"{stage} {fraction:.0%}")

    core = await asyncio.to_thread(build_engine, args, threads, progress)
    endpoint = ctx.endpoint(ctx.run.component, "generate")
    publisher = None
    if publish_kv:
        from dynamo.llm import KvEventPublisher

        publisher = KvEventPublisher(endpoint, kv_block_size=args.block_size)
    loop = asyncio.get_running_loop()
    on_events = (lambda evs: publish_kv_events(publisher, evs)) if publisher else None
    leaving: set[asyncio.Task] = set()

    def on_fatal(exc: BaseException) -> None:
        leaving.add(asyncio.ensure_future(leave_after_engine_failure(
            exc, ctx.report, endpoint.unregister_endpoint_instance)))

    runner = EngineRunner(core, loop, on_kv_events=on_events, on_fatal=on_fatal)
    runner.start()
    worker_id = endpoint.connection_id()
    metrics = WorkerMetrics()
    ctx.serve_metrics(metrics.registry)

    def sample() -> WorkerLoad:
        st = runner.last_stats or core.stats()
        metrics.update(st.num_running, st.num_waiting, st.kv_blocks_used, st.kv_blocks_total)
        return WorkerLoad(worker_id=worker_id, active=st.num_running, waiting=st.num_waiting,
                          kv_used_blocks=st.kv_blocks_used, kv_total_blocks=st.kv_blocks_total)

    reporter = asyncio.create_task(publish_load(
        os.environ["NATS_SERVER"], load_subject(ctx.namespace, ctx.run.component), sample,
        cfg.load_report_interval_s, ctx.stopping, ReportFailures(metrics.load_report_failures)))
    return TorchWorker(core, runner, endpoint, metrics, worker_id, reporter, publisher)


async def run_torch_worker(ctx: ComponentContext, cfg: TorchWorkerConfig) -> None:
    """Component main for ``engine: torch`` (aggregated serving)."""
    w = await start_torch_worker(ctx, cfg)
    ready = asyncio.create_task(report_ready_when_registered(
        ctx.report, w.endpoint, w.worker_id,
        endpoint=f"{ctx.namespace}.{ctx.run.component.lower()}.generate",
        detail=f"instance {w.worker_id:x}"))
    try:
        await serve_until_stopped(ctx, w.endpoint, make_handler(w.runner, w.metrics),
                                  drain_timeout_s=cfg.drain_timeout_s, inflight=w.runner.inflight)
    finally:
        ready.cancel()
        await w.close()
