"""Routing inside the frontend process (``Frontend.routing: in_process``).

The same ``RouterService`` the router process serves is built here (by
``router.feeds.start_routing``) and called directly: a request is placed with
``service.place`` and released with ``service.complete``, with no RPC and no Router
process.  Everything else is ``RoutedBackend``'s: streaming from the chosen worker,
retrying a worker that failed before producing output (the failed worker is marked
down in the service), and the release with its outcome.

With several frontend processes (``Frontend.replicas``) each places and admits its own
requests, and follows every other's through ``router.share``: their placements, first
tokens, progress and releases, so admission predicts each worker's whole queue and
batch (load reports and KV events come from the workers and are seen by all).
"""

from __future__ import annotations

import asyncio
import logging

from splitserve.contracts import tracing
from splitserve.contracts.wire import ReleaseCall, RouteCall, RouteReply

from .backend import BackendMetrics, RoutedBackend, StreamMeta
from .errors import APIError, upstream_error

log = logging.getLogger(__name__)


class InProcessBackend(RoutedBackend):
    """Frontend → RouterService (same process) → Worker (stream) → RouterService."""

    def __init__(self, service, worker_client, route_timeout_s: float = 5.0,
                 migration_limit: int = 1, metrics: BackendMetrics | None = None,
                 stall_s: float = 0.0) -> None:
        endpoint = service.worker_endpoint

        async def connect(path: str):
            raise upstream_error(f"in-process routing names {endpoint}, not {path}")

        super().__init__(router_client=None, connect=connect, route_timeout_s=route_timeout_s,
                         migration_limit=migration_limit, metrics=metrics, stall_s=stall_s)
        self.service = service
        # One client for discovery and streaming: a worker the service routes to is
        # known to it already, so requests never wait for discovery to catch up.
        self.clients[endpoint] = worker_client

    def ready(self) -> bool:
        """True while a request would be served now: the service would route to a
        worker (one in discovery, not marked down)."""
        return bool(self.service.status().workers)

    def worker_ids(self) -> list[int]:
        """The workers the service would route to now."""
        return list(self.service.status().workers)

    async def place(self, call: RouteCall, meta: StreamMeta) -> RouteReply:
        """Admit and route ``call`` in this process; the admission queue's wait is
        bounded by ``route_timeout_s`` as the router RPC is."""
        try:
            with tracing.active(meta.trace):  # admission's and routing's spans go under it
                return await asyncio.wait_for(self.service.place(call), self.route_timeout_s)
        except APIError:
            raise
        except TimeoutError:
            raise upstream_error("routing did not finish in time", 503,
                                 "router_timeout") from None
        except Exception as exc:
            log.exception("routing %s failed", call.request_id)
            raise upstream_error(f"routing failed: {exc}", 503, "routing_failed") from None

    def _report(self, meta: StreamMeta, tokens: int, first: bool, progress: bool,
                wake: bool) -> None:
        """Tell the service at once when the first token arrives (its prompt then leaves
        the work ahead of later requests on that worker, and its TTFT teaches admission
        at once) and each time ``progress.PROGRESS_TOKENS`` more have streamed (its TPOT
        so far teaches admission before a long answer ends, and its pace says how fast
        the batch decodes now)."""
        try:
            if first:
                self.service.first_token(meta.request_id)
            if progress:
                # Held requests are judged again on the first report (it teaches the
                # TPOT fit); the later ones wait for the next tick.
                self.service.decode_progress(meta.request_id, tokens, wake=wake)
        except Exception:
            log.exception("progress report of %s failed", meta.request_id)

    def deliver_release(self, call: ReleaseCall, meta: StreamMeta) -> None:
        """Account the finished request at once (called as its stream closes)."""
        try:
            self.service.complete(call)
        except Exception:
            log.exception("release of %s failed", call.request_id)

    async def watch(self, stopping: asyncio.Event) -> None:
        """Nothing to poll: readiness reads the service directly."""
        await stopping.wait()
