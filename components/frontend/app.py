"""The OpenAI-compatible HTTP app (Starlette).

``build_app(state)`` is pure wiring: the same app runs in the frontend process and in
unit tests with a fake backend.  ``handle`` runs a generating request through its stages
(``pipeline.py``: parse → prepare → admit and route → stream; ``render.py``: render)
and keeps the HTTP edge's books: the in-flight limit, an early 503 when saturated, and
the request metrics.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from splitserve.contracts import tracing

from .backend import StreamMeta
from .errors import APIError, overloaded
from .intake import check_content_type, read_body
from .lora_api import list_adapters, load_adapter, unload_adapter
from .pipeline import choice_metas, events, parse_and_prepare
from .render import Renderer, renderer_for
from .request import Endpoint
from .responses import Event
from .state import FrontendState

__all__ = ["FrontendState", "build_app"]


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers())


async def handle(request: Request, endpoint: Endpoint) -> Response:
    state: FrontendState = request.app.state.frontend
    label = endpoint.label
    started = time.monotonic()
    priority = request.headers.get(state.priority_header)
    # The request's root span, a child of the client's traceparent when it sent one.
    span = tracing.start(f"{request.method} {request.url.path}", request.headers,
                         {"http.request.method": request.method, "url.path": request.url.path},
                         kind="server") if tracing.enabled() else tracing.NOOP
    try:
        check_content_type(request.headers.get("content-type"))
        raw = await read_body(request, state.max_body_bytes, state.body_timeout_s)
        if state.inflight >= state.max_inflight:
            raise overloaded(f"server is at its limit of {state.max_inflight} concurrent "
                             "requests; retry later", retry_after_s=1)
        if state.loop_lag is not None and 0 < state.max_loop_lag_s < state.loop_lag.lag_s:
            raise overloaded(f"the frontend is saturated (its event loop runs "
                             f"{state.loop_lag.lag_s * 1000:.0f} ms behind); retry later",
                             retry_after_s=1)
        p = await parse_and_prepare(state, endpoint, raw, priority or "default")
    except APIError as err:
        err = state.outage(err)
        state.metrics.requests.labels(label, "rejected" if err.status == 503 else
                                      "invalid", str(err.status), "", "").inc()
        span.end({"http.response.status_code": err.status}, error=err.message)
        return error_response(err)
    metas = choice_metas(p, priority, started)
    if span:
        span.set({"splitserve.request_id": p.request_id, "gen_ai.request.model": p.req.model,
                  "splitserve.prompt_tokens": len(p.token_ids), "splitserve.stream":
                  bool(p.req.stream)})
        for meta in metas:
            meta.trace = span
    # One the graph serves (parse refused any other), and the model whose workers serve
    # it (an adapter's base).
    model = (p.req.model, p.base_model or p.req.model)
    state.metrics.prompt_tokens.labels(*model).inc(len(p.token_ids))
    state.inflight += 1
    state.metrics.inflight.inc()
    if state.loop_lag is not None:
        state.loop_lag.wake()
    flow = events(state, p, metas, started)
    answer = renderer_for(state, p, metas)
    if not p.req.stream:
        return await _collect(state, answer, started, label, model, flow, span)
    # Peek the first event before committing to a 200: a rejection (503 with
    # Retry-After) or a worker failure before the first token is a real HTTP error.
    try:
        first = await flow.__anext__()
    except APIError as err:
        err = state.outage(err)
        state.inflight -= 1
        state.metrics.inflight.dec()
        state.metrics.requests.labels(label, "rejected" if err.status == 503 else
                                      "error", str(err.status), *model).inc()
        _account(state, metas, started, model)
        span.end({"http.response.status_code": err.status}, error=err.message)
        return error_response(err)
    return StreamingResponse(_sse(state, answer, started, label, model, first, flow, span),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", **_predicted(metas)})


async def _collect(state: FrontendState, answer: Renderer, started: float, label: str,
                   model: tuple[str, str], flow: AsyncIterator[Event],
                   span=tracing.NOOP) -> Response:
    """The non-streamed answer: every choice's events gathered into one body."""
    status, error = 499, "cancelled"  # unless it ends below
    try:
        async for ev in flow:
            answer.collect(ev)
        status, error = 200, None
    except APIError as err:
        err = state.outage(err)
        status, error = err.status, err.message
        state.metrics.requests.labels(label, "rejected" if err.status == 503 else "error",
                                      str(err.status), *model).inc()
        return error_response(err)
    finally:
        # A client that left cancels this handler: close the choices so a fan-out's
        # other workers stop too.
        await flow.aclose()
        state.inflight -= 1
        state.metrics.inflight.dec()
        _account(state, answer.metas, started, model)
        span.end({"http.response.status_code": status}, error=error)
    state.metrics.requests.labels(label, "ok", "200", *model).inc()
    return JSONResponse(answer.body(), headers=_predicted(answer.metas))


PREDICTED_TTFT_HEADER = "x-splitserve-predicted-ttft-ms"


def _predicted(metas: list[StreamMeta]) -> dict[str, str]:
    """Admission's TTFT prediction for the request (its first choice), when one was made:
    clients and benchmarks set it beside the TTFT they measured."""
    est = metas[0].predicted_ttft_ms if metas else None
    return {PREDICTED_TTFT_HEADER: f"{est:.0f}"} if est is not None else {}


def _account(state: FrontendState, metas: list[StreamMeta], started: float,
             model: tuple[str, str]) -> None:
    """``model``: the served name the client sent and its base model (metric labels)."""
    state.metrics.duration.observe(time.monotonic() - started)
    for meta in metas:
        state.metrics.output_tokens.labels(*model).inc(meta.output_tokens)
        state.metrics.cached_tokens.labels(*model).inc(meta.cached_tokens)


async def _chain(first, rest):
    yield first
    async for item in rest:
        yield item


async def _sse(state: FrontendState, answer: Renderer, started: float, label: str,
               model: tuple[str, str], first_event: Event, flow: AsyncIterator[Event],
               span=tracing.NOOP) -> AsyncIterator[bytes]:
    """SSE body; the caller already counted the request in flight and read its first event."""
    outcome, status = "ok", "200"
    body = answer.stream(_chain(first_event, flow))
    try:
        async for data in body:
            yield data
    except APIError as err:
        outcome, status = "error", str(err.status)
        yield answer.error(err)
    except asyncio.CancelledError:
        outcome, status = "cancelled", "499"
        raise
    finally:
        await body.aclose()
        await flow.aclose()
        state.inflight -= 1
        state.metrics.inflight.dec()
        state.metrics.requests.labels(label, outcome, status, *model).inc()
        _account(state, answer.metas, started, model)
        span.end({"http.response.status_code": int(status), "splitserve.outcome": outcome},
                 error=None if outcome == "ok" else outcome)
    trailer = answer.trailer()
    if trailer is not None:
        yield trailer


async def chat(request: Request) -> Response:
    return await handle(request, Endpoint.CHAT)


async def completions(request: Request) -> Response:
    return await handle(request, Endpoint.COMPLETION)


async def responses(request: Request) -> Response:
    return await handle(request, Endpoint.RESPONSES)


async def models(request: Request) -> Response:
    """The served models, each listed only while a request for it would be served now
    (its tokenizer loaded, a worker of its pool registered): a pool that goes away
    disappears from the list.  Then the LoRA adapters a worker has loaded, each under
    its own name with its base model as ``parent``."""
    state: FrontendState = request.app.state.frontend
    up = state.codec is not None and not state.dependencies_down()
    lanes = [lane for lane in state.lanes() + state.adapter_lanes()
             if up and lane.is_ready()]
    # vLLM's fields: a LoRA adapter's parent is its base model (its root too, here: the
    # adapter's directory is the operator's business, not every client's).
    data = [{"id": lane.name, "object": "model", "created": 0, "owned_by": "splitserve",
             "root": lane.base_model, "parent": lane.base or None} for lane in lanes]
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
        Route("/v1/load_lora_adapter", load_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_adapter, methods=["POST"]),
        Route("/v1/lora_adapters", list_adapters, methods=["GET"]),
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
