"""The OpenAI-compatible HTTP app (Starlette).

``build_app(state)`` is pure wiring: the same app runs in the frontend process and in
unit tests with a fake backend.  Request handling: parse and validate the body, render
and tokenise, check the context window, admit (early 503 when saturated), then stream
the worker's tokens through the detokenizer as SSE or collect them into one answer.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from splitserve.components.protocol import worker_request

from .backend import Backend, StreamMeta
from .errors import APIError, bad_request, overloaded, service_unavailable, upstream_error
from .intake import check_content_type, read_body
from .metrics import FrontendMetrics
from .openai_types import ChatCompletionRequest, CompletionRequest, parse_json, validate
from .textcodec import TextCodec

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


@dataclass
class FrontendState:
    """Everything a request handler needs; built once per process."""

    model_name: str
    codec: TextCodec | None
    backend: Backend
    metrics: FrontendMetrics = field(default_factory=FrontendMetrics)
    max_inflight: int = 256
    default_max_tokens: int = 512
    first_token_timeout_s: float = 120.0
    inter_token_timeout_s: float = 30.0
    priority_header: str = "x-priority"
    context_factory: Any = None
    max_body_bytes: int = 4 * 1024 * 1024
    body_timeout_s: float = 30.0
    max_pending_prepares: int = 64
    # Parsing and tokenising run here, never on the event loop: a multi-megabyte prompt
    # takes seconds to tokenise and would stall every other connection meanwhile.
    prepare_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        2, thread_name_prefix="frontend-tokenize"))
    inflight: int = 0
    pending_prepares: int = 0
    loading_detail: str = "loading tokenizer"

    # Names of the graph's dependencies (etcd, NATS) unreachable now; set by main.
    dependencies_down: Callable[[], list[str]] = field(default=list)

    def is_ready(self) -> bool:
        return self.codec is not None and self.backend.ready() and not self.dependencies_down()

    def outage(self, err: APIError) -> APIError:
        """A 503 answered while etcd or NATS is down says so (service_unavailable)."""
        down = self.dependencies_down() if err.status == 503 else []
        if not down:
            return err
        return service_unavailable(f"the service is unavailable: {', '.join(down)} is down "
                                   f"({err.message}); retry later",
                                   retry_after_s=max(2.0, err.retry_after_s or 0))


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers())


@dataclass
class Prepared:
    """A validated request, tokenised and ready to send."""

    kind: str  # "chat" or "completion"
    req: Any
    token_ids: list[int]
    max_tokens: int
    request_id: str
    priority: str


def prepare(state: FrontendState, kind: str, raw: bytes, priority: str) -> Prepared:
    """Parse, validate and tokenise a body; raises APIError(400) on any client mistake.

    Runs in ``state.prepare_pool`` (see ``handle``): it may take seconds for a large body.
    """
    model = ChatCompletionRequest if kind == "chat" else CompletionRequest
    req = validate(model, parse_json(raw))
    if req.model != state.model_name:
        raise APIError(400, f"model '{req.model}' is not served here; available: "
                       f"{state.model_name}", param="model", code="model_not_found")
    codec = state.codec
    if codec is None:
        raise overloaded("the model is still loading", retry_after_s=5, code="not_ready")
    where = "messages" if kind == "chat" else "prompt"
    if kind == "chat":
        msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in req.messages]
        _check_length(codec, sum(len(m["content"]) for m in msgs), where)
        ids = codec.chat_ids(msgs)
    elif isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], int):
        ids = list(req.prompt)
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
    room = codec.context_length - len(ids)
    asked = req.requested_max_tokens()
    if room <= 0 or (asked is not None and asked > room):
        need = len(ids) + (asked or 1)
        raise bad_request(f"this model's maximum context length is {codec.context_length} "
                          f"tokens; the request needs {need} ({len(ids)} in the prompt)",
                          where, "context_length_exceeded")
    max_tokens = asked if asked is not None else min(state.default_max_tokens, room)
    return Prepared(kind, req, ids, max_tokens, f"{kind}-{uuid.uuid4().hex}", priority)


def _check_length(codec: TextCodec, chars: int, param: str) -> None:
    if codec.surely_too_long(chars):
        raise bad_request(f"this model's maximum context length is {codec.context_length} "
                          f"tokens; a prompt of {chars} characters cannot fit", param,
                          "context_length_exceeded")


async def prepare_off_loop(state: FrontendState, kind: str, raw: bytes,
                           priority: str) -> Prepared:
    """``prepare`` in the bounded tokenizer pool; 503 when too many already wait for it."""
    if state.pending_prepares >= state.max_pending_prepares:
        raise overloaded(f"{state.pending_prepares} requests are already being tokenised; "
                         "retry later", retry_after_s=1)
    state.pending_prepares += 1
    try:
        return await asyncio.get_running_loop().run_in_executor(
            state.prepare_pool, prepare, state, kind, raw, priority)
    finally:
        state.pending_prepares -= 1


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
    if chunk.get("error") or chunk.get("finish_reason") in ("error", "cancelled"):
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


async def token_events(state: FrontendState, p: Prepared, meta: StreamMeta, started: float
                       ) -> AsyncIterator[tuple[str, str | None, dict | None]]:
    """Yield (text delta, finish reason or None, usage or None) until the request ends.

    Enforces the first-token and inter-token deadlines so a stalled or dead worker
    becomes an error within a bounded time, and stops the worker early when a stop
    string matched.
    """
    codec = state.codec
    detok = codec.detokenizer(p.req.stop_list())
    s = p.req
    wreq = worker_request(model=state.model_name, token_ids=p.token_ids, max_tokens=p.max_tokens,
                          temperature=s.temperature if s.temperature is not None else 1.0,
                          top_p=s.top_p, seed=s.seed, eos_token_ids=codec.eos_token_ids,
                          request_id=p.request_id, priority=p.priority)
    context = state.context_factory(p.request_id) if state.context_factory else None
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
                finish = "stop"
            elif chunk.get("finish_reason"):
                finish = FINISH.get(chunk["finish_reason"], "stop")
                text += detok.flush()
            yield text, finish, None
    finally:
        if finish is None or detok.stopped:
            if context is not None:
                context.stop_generating()
        await chunks.aclose()


def usage_of(p: Prepared, meta: StreamMeta) -> dict[str, Any]:
    return {"prompt_tokens": len(p.token_ids), "completion_tokens": meta.output_tokens,
            "total_tokens": len(p.token_ids) + meta.output_tokens,
            "prompt_tokens_details": {"cached_tokens": meta.cached_tokens}}


def chunk_body(p: Prepared, created: int, model: str, text: str | None,
               finish: str | None, first: bool) -> dict[str, Any]:
    if p.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    return {"id": p.request_id, "object": obj, "created": created, "model": model,
            "choices": [choice]}


async def handle(request: Request, kind: str) -> Response:
    state: FrontendState = request.app.state.frontend
    endpoint = "chat" if kind == "chat" else "completions"
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
    meta = StreamMeta(request_id=p.request_id, priority=priority,
                      prompt_tokens=len(p.token_ids), user=p.req.user, metadata=p.req.metadata)
    state.metrics.prompt_tokens.inc(len(p.token_ids))
    if p.req.stream:
        # Peek the first event before committing to a 200: a rejection (503 with
        # Retry-After) or a worker failure before the first token is a real HTTP error.
        state.inflight += 1
        state.metrics.inflight.inc()
        events = token_events(state, p, meta, started)
        try:
            first = await events.__anext__()
        except APIError as err:
            err = state.outage(err)
            state.inflight -= 1
            state.metrics.inflight.dec()
            state.metrics.requests.labels(endpoint, "rejected" if err.status == 503 else
                                          "error", str(err.status)).inc()
            _account(state, meta, started)
            return error_response(err)
        return StreamingResponse(_sse(state, p, meta, started, endpoint, first, events),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    state.inflight += 1
    state.metrics.inflight.inc()
    try:
        parts, finish = [], None
        async for text, fin, _ in token_events(state, p, meta, started):
            parts.append(text)
            finish = fin or finish
    except APIError as err:
        err = state.outage(err)
        state.metrics.requests.labels(endpoint, "rejected" if err.status == 503 else "error",
                                      str(err.status)).inc()
        return error_response(err)
    finally:
        state.inflight -= 1
        state.metrics.inflight.dec()
        _account(state, meta, started)
    text = "".join(parts)
    state.metrics.requests.labels(endpoint, "ok", "200").inc()
    created = int(time.time())
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": finish, "logprobs": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    return JSONResponse({"id": p.request_id, "object": obj, "created": created,
                         "model": state.model_name, "choices": [choice],
                         "usage": usage_of(p, meta)})


def _account(state: FrontendState, meta: StreamMeta, started: float) -> None:
    state.metrics.duration.observe(time.monotonic() - started)
    state.metrics.output_tokens.inc(meta.output_tokens)
    state.metrics.cached_tokens.inc(meta.cached_tokens)


async def _chain(first, rest):
    yield first
    async for item in rest:
        yield item


async def _sse(state: FrontendState, p: Prepared, meta: StreamMeta, started: float,
               endpoint: str, first_event, events) -> AsyncIterator[bytes]:
    """SSE body; the caller already counted the request in flight and read its first event."""
    created = int(time.time())
    outcome, status = "ok", "200"
    try:
        first = True
        async for text, finish, _ in _chain(first_event, events):
            if text or finish or first:
                body = chunk_body(p, created, state.model_name, text, finish, first)
                first = False
                yield f"data: {json.dumps(body)}\n\n".encode()
        if p.req.include_usage_in_stream():
            body = {"id": p.request_id, "object": chunk_body(p, created, "", "", None,
                                                              False)["object"],
                    "created": created, "model": state.model_name, "choices": [],
                    "usage": usage_of(p, meta)}
            yield f"data: {json.dumps(body)}\n\n".encode()
    except APIError as err:
        outcome, status = "error", str(err.status)
        yield f"data: {json.dumps(err.body())}\n\n".encode()
    except asyncio.CancelledError:
        outcome, status = "cancelled", "499"
        raise
    finally:
        state.inflight -= 1
        state.metrics.inflight.dec()
        state.metrics.requests.labels(endpoint, outcome, status).inc()
        _account(state, meta, started)
    yield b"data: [DONE]\n\n"


async def chat(request: Request) -> Response:
    return await handle(request, "chat")


async def completions(request: Request) -> Response:
    return await handle(request, "completion")


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
