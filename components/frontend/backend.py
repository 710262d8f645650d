"""How the frontend reaches workers: straight to a worker pool, or through the router.

``Backend.stream(request, meta)`` yields the worker's output chunks as dicts.  With a
Router in the graph, the frontend asks the router for a worker (one small RPC), streams
from that worker directly (tokens never pass through the router), and tells the router
when the request is over so it can account load and latency.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from splitserve.components.protocol import ReleaseCall, RouteCall, RouteReply

from .errors import APIError, overloaded, upstream_error

log = logging.getLogger(__name__)


@dataclass
class StreamMeta:
    """Per-request facts the backend reports back (to the router, to metrics)."""

    request_id: str
    priority: str | None
    worker_id: int | None = None
    user: str | None = None
    metadata: dict | None = None
    class_name: str = "default"
    first_token_at: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    route_reason: str = ""


def chunk_data(item: Any) -> dict[str, Any]:
    """The payload of a response item from Dynamo's client (annotated or plain)."""
    data = getattr(item, "data", item)
    return data() if callable(data) else data


class Backend(Protocol):
    def ready(self) -> bool: ...

    def stream(self, request: dict, meta: StreamMeta, context) -> AsyncIterator[dict]: ...


class DirectBackend:
    """Frontend → Worker without a router: Dynamo's round-robin over worker instances."""

    def __init__(self, worker_client) -> None:
        self.client = worker_client

    def ready(self) -> bool:
        return bool(self.client.instance_ids())

    async def stream(self, request: dict, meta: StreamMeta, context) -> AsyncIterator[dict]:
        if not self.ready():
            raise overloaded("no worker is available yet", retry_after_s=2, code="no_workers")
        try:
            stream = await self.client.round_robin(request, context=context)
        except Exception as exc:  # noqa: BLE001 - transport errors become HTTP errors
            raise upstream_error(f"could not reach a worker: {exc}", 503) from None
        async for item in stream:
            yield chunk_data(item)


class RoutedBackend:
    """Frontend → Router (choose) → Worker (stream) → Router (release).

    Worker clients are opened per endpoint the router names (``connect(path)``), so the
    frontend needs no knowledge of which component the router routes to.
    """

    def __init__(self, router_client, connect, route_timeout_s: float = 5.0) -> None:
        self.router = router_client
        self.release_client = None
        self.connect = connect
        self.clients: dict[str, Any] = {}
        self.route_timeout_s = route_timeout_s
        self._release_tasks: set[asyncio.Task] = set()

    def ready(self) -> bool:
        return bool(self.router.instance_ids()) and (
            not self.clients or any(c.instance_ids() for c in self.clients.values()))

    async def worker_client(self, endpoint: str, instance_id: int, wait_s: float = 3.0):
        """The client for ``endpoint``, once its discovery knows ``instance_id``.

        The router may name a worker this process's discovery has not seen yet (a fresh
        client, or a replica that just registered); waiting briefly avoids failing
        such a request with "instance unavailable"."""
        client = self.clients.get(endpoint)
        if client is None:
            client = self.clients[endpoint] = await self.connect(endpoint)
        deadline = time.monotonic() + wait_s
        while instance_id not in client.instance_ids() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return client

    async def route(self, call: RouteCall) -> RouteReply:
        """One RPC to the router; the reply names a worker or says why none."""
        async def _call() -> RouteReply:
            stream = await self.router.round_robin(call.model_dump(mode="json"))
            async for item in stream:
                return RouteReply.model_validate(chunk_data(item))
            raise upstream_error("router returned no decision")
        try:
            return await asyncio.wait_for(_call(), self.route_timeout_s)
        except APIError:
            raise
        except asyncio.TimeoutError:
            raise upstream_error("router did not answer in time", 503, "router_timeout") from None
        except Exception as exc:  # noqa: BLE001
            raise upstream_error(f"router unavailable: {exc}", 503, "router_unavailable") from None

    async def stream(self, request: dict, meta: StreamMeta, context) -> AsyncIterator[dict]:
        if not self.router.instance_ids():
            raise overloaded("the router is not available yet", retry_after_s=2,
                             code="no_router")
        max_tokens = request["stop_conditions"]["max_tokens"]
        reply = await self.route(RouteCall(
            request_id=meta.request_id, token_ids=request["token_ids"], priority=meta.priority,
            user=meta.user, metadata=meta.metadata, max_tokens=max_tokens))
        meta.route_reason = reply.reason
        meta.class_name = reply.class_name
        if reply.retry_after_s is not None:
            est = (reply.qos or {}).get("est_ttft_ms")
            detail = f" (estimated time to first token {est:.0f} ms)" if est else ""
            raise overloaded(f"request rejected early for priority class "
                             f"'{reply.class_name}': {reply.reason}{detail}; retry later",
                             retry_after_s=reply.retry_after_s, code=reply.reason)
        if reply.worker_id is None:
            raise overloaded(f"no worker can take the request ({reply.reason})",
                             retry_after_s=2, code=reply.reason)
        own = request["extra_args"]["splitserve"]
        own["priority"] = reply.class_name
        if reply.max_tokens is not None and reply.max_tokens < max_tokens:
            request["stop_conditions"]["max_tokens"] = reply.max_tokens
        if reply.prefill_locally:
            own["prefill_locally"] = True
        meta.worker_id = reply.worker_id
        started = time.monotonic()
        outcome = "error"
        finished = False
        try:
            client = await self.worker_client(reply.endpoint, reply.worker_id)
            stream = await client.direct(request, reply.worker_id, context=context)
            async for item in stream:
                chunk = chunk_data(item)
                # The consumer may close us right after the last chunk: remember that the
                # request finished so the release reports it as ok, not cancelled.
                finished = bool(chunk.get("finish_reason")) and not chunk.get("error")
                yield chunk
            outcome = "ok"
        except GeneratorExit:
            outcome = "ok" if finished else "cancelled"
            raise
        except Exception as exc:  # noqa: BLE001
            raise upstream_error(f"worker {reply.worker_id:x} failed: {exc}") from None
        finally:
            self._release(meta, outcome, started)

    def _release(self, meta: StreamMeta, outcome: str, started: float) -> None:
        call = ReleaseCall(
            request_id=meta.request_id, worker_id=meta.worker_id or 0, outcome=outcome,
            prompt_tokens=meta.prompt_tokens, cached_tokens=meta.cached_tokens,
            output_tokens=meta.output_tokens,
            ttft_s=(meta.first_token_at - started) if meta.first_token_at else None,
            duration_s=time.monotonic() - started)
        task = asyncio.ensure_future(self._send_release(call))
        self._release_tasks.add(task)
        task.add_done_callback(self._release_tasks.discard)

    async def _send_release(self, call: ReleaseCall) -> None:
        if self.release_client is None:
            return
        try:
            stream = await self.release_client.round_robin(call.model_dump(mode="json"))
            async for _ in stream:
                pass
        except Exception as exc:  # noqa: BLE001 - the router expires unreleased requests
            log.debug("release of %s failed: %s", call.request_id, exc)
