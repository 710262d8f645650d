"""Load of an SGLang engine: the ``KvMetrics`` its scheduler pushes each step, else the
load snapshots every scheduler publishes.

With ``enable_metrics`` and KV events on, SGLang's scheduler pushes a ``KvMetrics``
(running and waiting requests, KV tokens used and total) to the engine's
``metrics_ipc_name`` socket; the tracker pulls them and keeps the latest.  Engines
without a KV-event publisher (every prefill engine, decode engines without a radix
cache) push none, so the tracker also polls ``tokenizer_manager.get_loads()``: one
``LoadSnapshot`` per data-parallel rank (``num_running_reqs``, ``num_waiting_reqs``,
``num_used_tokens``, ``max_total_num_tokens``), which rank 0 of every scheduler writes
whatever the role.  Token counts become blocks by the page size (rounded up), the unit
the routers use.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from splitserve.contracts.engine import LoadSample
from splitserve.contracts.kit.once import OncePerKind

log = logging.getLogger("splitserve.sglang")


def tokens_to_blocks(tokens: int, page_size: int) -> int:
    """KV tokens as pages (a partly used page is held whole)."""
    return -(-max(0, int(tokens)) // page_size)


class LoadTracker:
    """The latest scheduler metrics of one engine."""

    def __init__(self, page_size: int, poll_s: float = 0.5) -> None:
        self.page_size = page_size
        self.poll_s = poll_s
        self.latest: Any = None
        self.snapshot: LoadSample | None = None
        """The load snapshots' sum, when no ``KvMetrics`` came."""
        self._task: asyncio.Task | None = None
        self._poll: asyncio.Task | None = None

    def update(self, kv_metrics: Any) -> None:
        """Keep one ``KvMetrics`` (called by the pull loop, or directly in tests)."""
        self.latest = kv_metrics

    def sample(self, inflight: int) -> LoadSample:
        """The current load; before any metrics, the adapter's own in-flight count."""
        m = self.latest
        if m is None:
            if self.snapshot is not None:
                return self.snapshot
            return LoadSample(active=inflight, waiting=0, kv_used_blocks=0, kv_total_blocks=0)
        return LoadSample(active=int(m.request_active_slots),
                          waiting=int(m.num_requests_waiting),
                          kv_used_blocks=tokens_to_blocks(m.kv_active_blocks, self.page_size),
                          kv_total_blocks=tokens_to_blocks(m.kv_total_blocks, self.page_size))

    def start(self, engine: Any) -> None:
        """Pull the engine's metrics socket (real engines only) and poll its load
        snapshots in the background."""
        name = getattr(getattr(engine, "port_args", None), "metrics_ipc_name", None)
        if isinstance(name, str) and name.startswith("ipc://"):
            self._task = asyncio.ensure_future(self._pull(name))
        manager = getattr(engine, "tokenizer_manager", None)
        if callable(getattr(manager, "get_loads", None)):
            self._poll = asyncio.ensure_future(self._poll_loads(manager))

    def take_snapshots(self, loads: Any) -> None:
        """Sum one ``get_loads()`` answer (one snapshot per rank) into ``snapshot``."""
        loads = list(loads or ())
        if not loads:
            return
        total = sum(int(x.max_total_num_tokens) for x in loads)
        self.snapshot = LoadSample(
            active=sum(int(x.num_running_reqs) for x in loads),
            waiting=sum(int(x.num_waiting_reqs) for x in loads),
            kv_used_blocks=tokens_to_blocks(sum(int(x.num_used_tokens) for x in loads),
                                            self.page_size),
            kv_total_blocks=tokens_to_blocks(total, self.page_size))

    async def _poll_loads(self, manager: Any) -> None:
        failed = OncePerKind(log, "SGLang load snapshots unreadable (logged once per kind): "
                                  "%s")
        while True:
            try:
                self.take_snapshots(await manager.get_loads())
            except Exception as exc:  # noqa: BLE001 - load reports go on with the last
                failed(exc)
            await asyncio.sleep(self.poll_s)

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
        for task in (self._task, self._poll):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._task = self._poll = None
