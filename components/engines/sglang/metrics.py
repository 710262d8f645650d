"""Load of an SGLang engine, from the ``KvMetrics`` its scheduler pushes each step.

With ``enable_metrics`` and KV events on, SGLang's scheduler pushes a ``KvMetrics``
(running and waiting requests, KV tokens used and total) to the engine's
``metrics_ipc_name`` socket; the tracker pulls them and keeps the latest.  Token counts
become blocks by the page size (rounded up), the unit the routers use.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from splitserve.contracts.engine import LoadSample

log = logging.getLogger("splitserve.sglang")


def tokens_to_blocks(tokens: int, page_size: int) -> int:
    """KV tokens as pages (a partly used page is held whole)."""
    return -(-max(0, int(tokens)) // page_size)


class LoadTracker:
    """The latest scheduler metrics of one engine."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.latest: Any = None
        self._task: asyncio.Task | None = None

    def update(self, kv_metrics: Any) -> None:
        """Keep one ``KvMetrics`` (called by the pull loop, or directly in tests)."""
        self.latest = kv_metrics

    def sample(self, inflight: int) -> LoadSample:
        """The current load; before any metrics, the adapter's own in-flight count."""
        m = self.latest
        if m is None:
            return LoadSample(active=inflight, waiting=0, kv_used_blocks=0, kv_total_blocks=0)
        return LoadSample(active=int(m.request_active_slots),
                          waiting=int(m.num_requests_waiting),
                          kv_used_blocks=tokens_to_blocks(m.kv_active_blocks, self.page_size),
                          kv_total_blocks=tokens_to_blocks(m.kv_total_blocks, self.page_size))

    def start(self, engine: Any) -> None:
        """Pull the engine's metrics socket in the background (real engines only)."""
        name = getattr(getattr(engine, "port_args", None), "metrics_ipc_name", None)
        if isinstance(name, str) and name.startswith("ipc://"):
            self._task = asyncio.ensure_future(self._pull(name))

    async def _pull(self, name: str) -> None:
        import zmq
        import zmq.asyncio

        sock = zmq.asyncio.Context.instance().socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(name)  # an ipc:// path: local to this machine
        try:
            while True:
                self.update(await sock.recv_pyobj())
        finally:
            with contextlib.suppress(Exception):
                sock.close(0)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
