"""The stages of a generating request: parse → prepare → admit and route → stream.

Each stage takes the previous stage's typed value (``request.py``) and returns its own;
``app.handle`` runs them in order and hands the events to the endpoint's renderer
(``render.py``).  Parsing and preparing run in the tokenizer pool, off the event loop;
admission and routing happen in the backend (``backend.py``: the router's placement, or
the in-process service's) when a choice's stream starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

from splitserve.contracts import tracing
from splitserve.contracts.kit.deadline import MovingDeadline
from splitserve.contracts.wire import FinishReason, chunk_logprobs, chunk_prompt_logprobs

from . import formats
from .backend import StreamMeta
from .chat_input import chat_history, output_plan, parse_request
from .chat_output import OutputPlan
from .errors import bad_request, overloaded, upstream_error
from .request import Endpoint, Parsed, Prepared, WorkerCall
from .responses import Event, openai_finish_reason
from .state import FrontendState
from .textcodec import TextCodec


def parse(state: FrontendState, endpoint: Endpoint, raw: bytes, priority: str) -> Parsed:
    """Stage 1: the body validated for ``endpoint``; APIError(400) on a client mistake,
    404 ``model_not_found`` for a model this graph does not serve (as OpenAI answers)."""
    req, responses = parse_request(endpoint, raw, state.engines)
    state.lane(req.model)  # 404 for a model this graph does not serve
    return Parsed(endpoint, req, priority, responses)


def prepare(state: FrontendState, parsed: Parsed) -> Prepared:
    """Stage 2: the prompt's token ids, checked against the vocabulary and the context
    window, the output budget, the request id and (templated endpoints) the output
    plan; APIError(400) on a client mistake, 503 while the tokenizer loads."""
    lane = state.lane(parsed.req.model)
    codec = lane.codec
    if codec is None:
        raise overloaded("the model is still loading", retry_after_s=5, code="not_ready")
    req, where = parsed.req, parsed.endpoint.prompt_param
    plan = OutputPlan()
    if parsed.endpoint.templated:
        plan = output_plan(req, lane.tool_call_parser, lane.reasoning_parser, codec.tok)
        msgs, tools = chat_history(req, lane.tool_call_parser, codec.template_has_tools)
        _check_length(codec, sum(len(m["content"]) for m in msgs), where)
        ids = codec.chat_ids(msgs, tools)
    elif req.given_ids() is not None:
        ids = req.given_ids()
        bad = next((t for t in ids if not 0 <= t < codec.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is out of range: this model's vocabulary has "
                              f"ids 0..{codec.vocab_size - 1}", "prompt", "invalid_token_id")
    else:
        text = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
        _check_length(codec, len(text), where)
        ids = codec.prompt_ids(text)
    if not ids:
        raise bad_request("prompt is empty after tokenisation", "prompt", "empty_prompt")
    bad = next((t for t in req.bias_ids() if t >= codec.vocab_size), None)
    if bad is not None:
        raise bad_request(f"logit_bias: token id {bad} is out of range: this model's "
                          f"vocabulary has ids 0..{codec.vocab_size - 1}", "logit_bias",
                          "invalid_token_id")
    room = codec.context_length - len(ids)
    asked = req.requested_max_tokens()
    if room <= 0 or (asked is not None and asked > room):
        need = len(ids) + (asked or 1)
        raise bad_request(f"this model's maximum context length is {codec.context_length} "
                          f"tokens; the request needs {need} ({len(ids)} in the prompt)",
                          where, "context_length_exceeded")
    max_tokens = asked if asked is not None else min(state.default_max_tokens, room)
    return Prepared(parsed.endpoint, req, parsed.priority, parsed.responses,
                    token_ids=ids, max_tokens=max_tokens,
                    request_id=f"{parsed.endpoint}-{uuid.uuid4().hex}", plan=plan,
                    base_model=lane.base_model, lora=lane.lora)


def _check_length(codec: TextCodec, chars: int, param: str) -> None:
    if codec.surely_too_long(chars):
        raise bad_request(f"this model's maximum context length is {codec.context_length} "
                          f"tokens; a prompt of {chars} characters cannot fit", param,
                          "context_length_exceeded")


INLINE_PREPARE_BYTES = 16 * 1024
"""Request bodies up to this size are parsed and tokenised on the event loop."""
INLINE_IDS_BYTES = 128 * 1024
"""Bodies up to this size are parsed on the event loop, and prepared there too when their
prompt is token ids: nothing to tokenise (an 8,000-id prompt, 54 KB, is parsed and checked
in ~0.9 ms), while a hand-off to the pool costs two thread wake-ups and the interpreter
lock (groups of ten such prompts: 4.9-5.1 CPU-ms per request on the loop against 6.6-7.5
through the pool; docs/results/heldout.md)."""


async def parse_and_prepare(state: FrontendState, endpoint: Endpoint, raw: bytes,
                            priority: str) -> Prepared:
    """Stages 1 and 2: a small body on the event loop, any other in the bounded tokenizer
    pool (a multi-megabyte prompt takes seconds to tokenise); 503 when what already waits
    for the pool would take longer than ``max_tokenization_wait_s`` (or too many wait)."""
    backlog, size = state.backlog, len(raw)
    parsed = None
    if size <= INLINE_PREPARE_BYTES:
        # A small request is parsed and tokenised in well under a millisecond: handing it
        # to the pool would cost more than the work (two thread wake-ups and the GIL).
        # Not one whose tools may need vLLM's parsers imported first (seconds, once).
        parsed = parse(state, endpoint, raw, priority)
        if not getattr(parsed.req, "tools", None) or formats.imported():
            return prepare(state, parsed)
    elif size <= INLINE_IDS_BYTES:
        parsed = parse(state, endpoint, raw, priority)
        if _given_ids(parsed.req):
            return prepare(state, parsed)
    why = backlog.refusal(size)
    if why is not None:
        raise overloaded(f"{why}; retry later", retry_after_s=1)
    backlog.enter(size)
    busy: list[float] = []

    def timed() -> Prepared:
        t0 = time.perf_counter()
        out = prepare(state, parsed or parse(state, endpoint, raw, priority))
        busy.append(time.perf_counter() - t0)
        return out

    try:
        return await asyncio.get_running_loop().run_in_executor(state.prepare_pool, timed)
    finally:
        backlog.leave(size, busy[0] if busy else None)


def _given_ids(req) -> bool:
    """Whether the request's prompt is token ids (a completions request that sent ids)."""
    given = getattr(req, "given_ids", None)
    return given is not None and given() is not None


def worker_calls(state: FrontendState, p: Prepared) -> list[WorkerCall]:
    """Stage 3's input: one worker call per choice (``n`` > 1 fans out), named for the
    base model's workers (an adapter request carries its adapter: ``p.lora``)."""
    lane = state.lane(p.req.model)
    return [WorkerCall.of_choice(p, i, p.base_model or lane.name, lane.codec.eos_token_ids)
            for i in range(p.n)]


def choice_metas(p: Prepared, priority: str | None, received_at: float | None = None
                 ) -> list[StreamMeta]:
    """What each choice's backend reports back (to the router, to the metrics);
    ``received_at``: when the frontend began handling the request."""
    return [StreamMeta(request_id=p.choice_id(i), priority=priority,
                       prompt_tokens=len(p.token_ids), user=p.req.user,
                       metadata=p.req.metadata, received_at=received_at)
            for i in range(p.n)]


async def next_chunk(state: FrontendState, chunks: AsyncIterator[dict], meta: StreamMeta,
                     deadline: MovingDeadline) -> dict:
    """The worker's next chunk within the first-token or inter-token deadline (the
    stream's ``deadline``: one timer per stream, not one per chunk); raises the HTTP
    error the client gets for a stalled stream, a refusal or a worker error."""
    timeout = (state.first_token_timeout_s if meta.first_token_at is None
               else state.inter_token_timeout_s)
    try:
        chunk = await deadline.within(anext(chunks), timeout)
    except StopAsyncIteration:
        raise upstream_error("worker stream ended without a finish reason") from None
    except TimeoutError:
        raise upstream_error(f"no token from the worker within {timeout:.0f}s", 504,
                             "worker_timeout") from None
    if chunk.get("retry_after_s") is not None and meta.first_token_at is None:
        # A worker that refuses the request before any token (e.g. no prefill
        # worker for an engine that cannot prefill locally): 503 + Retry-After.
        raise overloaded(f"worker: {chunk.get('error')}",
                         retry_after_s=float(chunk["retry_after_s"]),
                         code="worker_overloaded")
    if chunk.get("error") or chunk.get("finish_reason") in (FinishReason.ERROR,
                                                            FinishReason.CANCELLED):
        raise upstream_error(f"worker error: {chunk.get('error') or chunk.get('text')}")
    return chunk


class TokenTimer:
    """One choice's TTFT and ITL observations, its metric children looked up once (a
    ``labels`` lookup per streamed chunk costs more than the observation)."""

    __slots__ = ("_itl", "_labels", "_metrics", "last", "started")

    def __init__(self, state: FrontendState, started: float, model: str,
                 base_model: str = "") -> None:
        self._metrics = state.metrics
        self._labels = (model, base_model or model)
        self._itl = None
        self.started = self.last = started

    def tokens(self, meta: StreamMeta, n: int) -> None:
        """Record ``n`` new output tokens (TTFT for the first, ITL after)."""
        now = time.monotonic()
        if meta.first_token_at is None:
            meta.first_token_at = now
            self._metrics.ttft.labels(*self._labels).observe(now - self.started)
        else:
            if self._itl is None:
                self._itl = self._metrics.itl.labels(*self._labels)
            self._itl.observe((now - self.last) / n)
        meta.output_tokens += n
        self.last = now


async def choice_events(state: FrontendState, p: Prepared, call: WorkerCall,
                        meta: StreamMeta, started: float, index: int = 0
                        ) -> AsyncIterator[Event]:
    """Stage 3 and 4 for one choice: the backend admits and routes ``call``, then the
    choice's events (text delta, finish reason or None, tokens and their
    log-probabilities) until it ends.

    Enforces the first-token and inter-token deadlines so a stalled or dead worker
    becomes an error within a bounded time, and stops the worker early when a stop
    string matched.
    """
    lane = state.lane(p.req.model)
    detok = lane.codec.detokenizer(p.req.stop_list(),
                                   keep_special_tokens=not p.plan.skip_special_tokens)
    context = state.context_factory(meta.request_id) if state.context_factory else None
    meta.trace = trace = tracing.stream_span(meta, context)
    chunks = lane.backend.stream(call, meta, context).__aiter__()
    timer = TokenTimer(state, started, lane.name, lane.base_model)
    finish: str | None = None
    deadline = MovingDeadline()
    try:
        while finish is None:
            chunk = await next_chunk(state, chunks, meta, deadline)
            ids = chunk.get("token_ids") or []
            if ids and trace and meta.first_token_at is None:
                trace.record("first_token", trace.start_ns, tracing.now_ns())
            if ids:
                timer.tokens(meta, len(ids))
            usage = chunk.get("completion_usage")
            if usage:
                meta.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                    "cached_tokens", 0) or 0
            text = detok.push(ids)
            text_ids = detok.text_ids
            if detok.stopped:
                finish = openai_finish_reason(FinishReason.STOP)
            elif chunk.get("finish_reason"):
                finish = openai_finish_reason(FinishReason.from_wire(chunk["finish_reason"]))
                tail = detok.flush()
                if tail:
                    text, text_ids = text + tail, None
            yield Event(index, text, finish, list(ids), chunk_logprobs(chunk),
                        chunk_prompt_logprobs(chunk), text_ids)
    finally:
        deadline.close()
        if finish is None or detok.stopped:
            if context is not None:
                context.stop_generating()
        await chunks.aclose()
        tracing.end_stream(trace, meta, finish)


def events(state: FrontendState, p: Prepared, metas: list[StreamMeta], started: float
           ) -> AsyncIterator[Event]:
    """Stages 3 and 4 for every choice: their events, merged as they come."""
    return merged([choice_events(state, p, call, meta, started, i) for i, (call, meta)
                   in enumerate(zip(worker_calls(state, p), metas, strict=True))])


async def merged(streams: list[AsyncIterator[Event]]) -> AsyncIterator[Event]:
    """The events of every choice as they come (``n`` > 1 fans out); the first error of
    any choice ends them all.

    The other choices start once the first has produced its first event: its prompt is
    then in the worker's prefix cache (and known to KV-aware routers), so they reuse it
    instead of all computing it at once."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for ev in only:
                yield ev
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator[Event]) -> None:
        try:
            async for ev in stream:
                await queue.put(ev)
            await queue.put(done)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(streams[0]))]
    left = len(streams)
    try:
        while left:
            item = await queue.get()
            if len(tasks) == 1:
                tasks += [asyncio.create_task(pump(st)) for st in streams[1:]]
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
