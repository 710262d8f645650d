"""The OpenAI-compatible HTTP app (Starlette).

``build_app(state)`` is pure wiring: the same app runs in the frontend process and in
unit tests with a fake backend.  Request handling: parse and validate the body, render
and tokenise, check the context window, admit (early 503 when saturated), then stream
the worker's tokens through the detokenizer as SSE or collect them into one answer.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from splitserve.contracts.wire import FinishReason, chunk_logprobs, chunk_prompt_logprobs

from .backend import StreamMeta
from .errors import APIError, bad_request, overloaded, upstream_error
from .intake import check_content_type, read_body
from .chat_input import chat_history, output_plan, parse_request
from .chat_output import OutputPlan
from .choices import (
    choice_metas,
    choice_request,
    choice_shapes,
    merged,
)
from .answers import answer_body, chat_chunks, event_data, response_events, sse_data
from .responses import Event, openai_finish_reason
from .responses_api import new_id
from .responses_stream import ResponseEvents
from .state import FrontendState, Prepared
from .textcodec import TextCodec

# The request-kind label of the frontend's metrics.
ENDPOINTS = {"chat": "chat", "completion": "completions", "responses": "responses"}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers())


def prepare(state: FrontendState, kind: str, raw: bytes, priority: str) -> Prepared:
    """Parse, validate and tokenise a body; raises APIError(400) on any client mistake.

    Runs in ``state.prepare_pool`` (see ``handle``): it may take seconds for a large body.
    """
    req, responses = parse_request(kind, raw, state.engines)
    if req.model != state.model_name:
        raise APIError(400, f"model '{req.model}' is not served here; available: "
                       f"{state.model_name}", param="model", code="model_not_found")
    codec = state.codec
    if codec is None:
        raise overloaded("the model is still loading", retry_after_s=5, code="not_ready")
    where = {"completion": "prompt", "responses": "input"}.get(kind, "messages")
    if kind != "completion":
        plan = output_plan(req, state.tool_call_parser, state.reasoning_parser)
        msgs, tools = chat_history(req, state.tool_call_parser, codec.template_has_tools)
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
    return Prepared(kind, req, ids, max_tokens, f"{kind}-{uuid.uuid4().hex}", priority,
                    plan if kind != "completion" else OutputPlan(), responses)


def _check_length(codec: TextCodec, chars: int, param: str) -> None:
    if codec.surely_too_long(chars):
        raise bad_request(f"this model's maximum context length is {codec.context_length} "
                          f"tokens; a prompt of {chars} characters cannot fit", param,
                          "context_length_exceeded")


async def prepare_off_loop(state: FrontendState, kind: str, raw: bytes,
                           priority: str) -> Prepared:
    """``prepare`` in the bounded tokenizer pool; 503 when what already waits for it would
    take longer than ``max_tokenization_wait_s`` (or too many wait)."""
    backlog, size = state.backlog, len(raw)
    why = backlog.refusal(size)
    if why is not None:
        raise overloaded(f"{why}; retry later", retry_after_s=1)
    backlog.enter(size)
    busy: list[float] = []

    def timed() -> Prepared:
        t0 = time.perf_counter()
        out = prepare(state, kind, raw, priority)
        busy.append(time.perf_counter() - t0)
        return out

    try:
        return await asyncio.get_running_loop().run_in_executor(state.prepare_pool, timed)
    finally:
        backlog.leave(size, busy[0] if busy else None)


async def next_chunk(state: FrontendState, chunks: AsyncIterator[dict], meta: StreamMeta
                     ) -> dict:
    """The worker's next chunk within the first-token or inter-token deadline; raises the
    HTTP error the client gets for a stalled stream, a refusal or a worker error."""
    timeout = (state.first_token_timeout_s if meta.first_token_at is None
               else state.inter_token_timeout_s)
    try:
        chunk = await asyncio.wait_for(anext(chunks), timeout)
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


def account_tokens(state: FrontendState, meta: StreamMeta, n: int, started: float,
                   last: float) -> float:
    """Record ``n`` new output tokens (TTFT for the first, ITL after); returns now."""
    now = time.monotonic()
    if meta.first_token_at is None:
        meta.first_token_at = now
        state.metrics.ttft.observe(now - started)
    else:
        state.metrics.itl.observe((now - last) / n)
    meta.output_tokens += n
    return now


async def token_events(state: FrontendState, p: Prepared, meta: StreamMeta, started: float,
                       index: int = 0) -> AsyncIterator[Event]:
    """Yield choice ``index``'s events (text delta, finish reason or None, tokens and
    their log-probabilities) until it ends.

    Enforces the first-token and inter-token deadlines so a stalled or dead worker
    becomes an error within a bounded time, and stops the worker early when a stop
    string matched.
    """
    detok = state.codec.detokenizer(p.req.stop_list())
    wreq = choice_request(state, p, index, meta.request_id)
    context = state.context_factory(meta.request_id) if state.context_factory else None
    chunks = state.backend.stream(wreq, meta, context).__aiter__()
    last = started
    finish: str | None = None
    try:
        while finish is None:
            chunk = await next_chunk(state, chunks, meta)
            ids = chunk.get("token_ids") or []
            if ids:
                last = account_tokens(state, meta, len(ids), started, last)
            usage = chunk.get("completion_usage")
            if usage:
                meta.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                    "cached_tokens", 0) or 0
            text = detok.push(ids)
            if detok.stopped:
                finish = openai_finish_reason(FinishReason.STOP)
            elif chunk.get("finish_reason"):
                finish = openai_finish_reason(FinishReason.from_wire(chunk["finish_reason"]))
                text += detok.flush()
            yield Event(index, text, finish, list(ids), chunk_logprobs(chunk),
                        chunk_prompt_logprobs(chunk))
    finally:
        if finish is None or detok.stopped:
            if context is not None:
                context.stop_generating()
        await chunks.aclose()


async def handle(request: Request, kind: str) -> Response:
    state: FrontendState = request.app.state.frontend
    endpoint = ENDPOINTS[kind]
    started = time.monotonic()
    priority = request.headers.get(state.priority_header)
    try:
        check_content_type(request.headers.get("content-type"))
        raw = await read_body(request, state.max_body_bytes, state.body_timeout_s)
        if state.inflight >= state.max_inflight:
            raise overloaded(f"server is at its limit of {state.max_inflight} concurrent "
                             "requests; retry later", retry_after_s=1)
        p = await prepare_off_loop(state, kind, raw, priority or "default")
    except APIError as err:
        err = state.outage(err)
        state.metrics.requests.labels(endpoint, "rejected" if err.status == 503 else
                                      "invalid", str(err.status)).inc()
        return error_response(err)
    metas = choice_metas(p, priority)
    state.metrics.prompt_tokens.inc(len(p.token_ids))
    state.inflight += 1
    state.metrics.inflight.inc()
    events = merged([token_events(state, p, m, started, i) for i, m in enumerate(metas)])
    if not p.req.stream:
        return await _collect(state, p, metas, started, endpoint, events)
    # Peek the first event before committing to a 200: a rejection (503 with
    # Retry-After) or a worker failure before the first token is a real HTTP error.
    try:
        first = await events.__anext__()
    except APIError as err:
        err = state.outage(err)
        state.inflight -= 1
        state.metrics.inflight.dec()
        state.metrics.requests.labels(endpoint, "rejected" if err.status == 503 else
                                      "error", str(err.status)).inc()
        _account(state, metas, started)
        return error_response(err)
    return StreamingResponse(_sse(state, p, metas, started, endpoint, first, events),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _collect(state: FrontendState, p: Prepared, metas: list[StreamMeta],
                   started: float, endpoint: str, events: AsyncIterator[Event]) -> Response:
    """The non-streamed answer: every choice's events gathered into one body."""
    shapes = choice_shapes(state, p)
    try:
        async for ev in events:
            shape = shapes[ev.index]
            shape.parts.append(shape.text_of(ev))
            shape.first = False
            lp = shape.logprobs_of(ev)
            if lp is not None:
                shape.logprobs.append(lp)
            shape.finish = ev.finish or shape.finish
    except APIError as err:
        err = state.outage(err)
        state.metrics.requests.labels(endpoint, "rejected" if err.status == 503 else "error",
                                      str(err.status)).inc()
        return error_response(err)
    finally:
        # A client that left cancels this handler: close the choices so a fan-out's
        # other workers stop too.
        await events.aclose()
        state.inflight -= 1
        state.metrics.inflight.dec()
        _account(state, metas, started)
    state.metrics.requests.labels(endpoint, "ok", "200").inc()
    return JSONResponse(answer_body(state, p, shapes, metas))


def _account(state: FrontendState, metas: list[StreamMeta], started: float) -> None:
    state.metrics.duration.observe(time.monotonic() - started)
    for meta in metas:
        state.metrics.output_tokens.inc(meta.output_tokens)
        state.metrics.cached_tokens.inc(meta.cached_tokens)


async def _chain(first, rest):
    yield first
    async for item in rest:
        yield item


async def _sse(state: FrontendState, p: Prepared, metas: list[StreamMeta], started: float,
               endpoint: str, first_event: Event, events) -> AsyncIterator[bytes]:
    """SSE body; the caller already counted the request in flight and read its first event."""
    created = int(time.time())
    outcome, status = "ok", "200"
    shapes = choice_shapes(state, p)
    every = _chain(first_event, events)
    revents = (ResponseEvents(p.responses, new_id("resp"), created)
               if p.kind == "responses" else None)
    body = (response_events(p, metas, shapes, revents, every) if revents is not None
            else chat_chunks(state, p, metas, shapes, created, every))
    try:
        async for data in body:
            yield data
    except APIError as err:
        outcome, status = "error", str(err.status)
        if revents is None:
            yield sse_data(err.body())
        else:
            yield event_data(revents.error(err.code, err.message, err.param))
    except asyncio.CancelledError:
        outcome, status = "cancelled", "499"
        raise
    finally:
        await body.aclose()
        await events.aclose()
        state.inflight -= 1
        state.metrics.inflight.dec()
        state.metrics.requests.labels(endpoint, outcome, status).inc()
        _account(state, metas, started)
    if revents is None:
        yield b"data: [DONE]\n\n"


async def chat(request: Request) -> Response:
    return await handle(request, "chat")


async def completions(request: Request) -> Response:
    return await handle(request, "completion")


async def responses(request: Request) -> Response:
    return await handle(request, "responses")


async def models(request: Request) -> Response:
    """The served model, listed only once a request for it would be served now."""
    state: FrontendState = request.app.state.frontend
    data = ([{"id": state.model_name, "object": "model", "created": 0,
              "owned_by": "splitserve"}] if state.is_ready() else [])
    return JSONResponse({"object": "list", "data": data})


async def live(request: Request) -> Response:
    return JSONResponse({"status": "alive"})


async def ready(request: Request) -> Response:
    state: FrontendState = request.app.state.frontend
    ok = state.is_ready()
    down = state.dependencies_down()
    detail = "ready" if ok else (state.loading_detail if state.codec is None
                                 else f"{', '.join(down)} down" if down
                                 else "waiting for workers")
    return JSONResponse({"status": "ready" if ok else "not ready", "detail": detail,
                         "inflight": state.inflight}, status_code=200 if ok else 503)


async def metrics(request: Request) -> Response:
    state: FrontendState = request.app.state.frontend
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def internal_error(request: Request, exc: Exception) -> Response:
    return error_response(APIError(500, f"internal error: {exc.__class__.__name__}",
                                   type_="server_error", code="internal_error"))


async def not_found(request: Request, exc) -> Response:
    return error_response(APIError(404, f"no route {request.method} {request.url.path}",
                                   code="not_found"))


async def method_not_allowed(request: Request, exc) -> Response:
    return error_response(APIError(405, f"method {request.method} not allowed here",
                                   code="method_not_allowed"))


def build_app(state: FrontendState) -> Starlette:
    """The ASGI app with every route; ``state`` is shared by all handlers."""
    routes = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", ready, methods=["GET"]),
        Route("/live", live, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={404: not_found,
                                                       405: method_not_allowed,
                                                       Exception: internal_error})
    app.state.frontend = state
    return app
