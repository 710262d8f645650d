"""Runs a pure, synchronous engine core on its own thread and bridges it to asyncio.

The core (``add_request`` / ``abort`` / ``step`` / ``has_unfinished`` / ``stats`` /
``drain_kv_events``) never sees threads or sockets.  The runner owns one thread that
applies queued commands between steps (so requests join and leave the running batch
between decode steps: continuous batching) and hands each step's outputs back to the
event loop, one asyncio queue per request.

Failures: a request the core refuses gets its error on its own queue; a request that
fails inside a step comes back from the core as an output with ``finish_reason="error"``.
Anything that escapes ``step`` means the core's state is unknown: the runner fails
every waiting request, stops accepting work (``alive`` turns False) and calls
``on_fatal`` so the process can leave and be restarted instead of serving errors.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("splitserve.worker")

_STOP = object()


class EngineRunner:
    """Thread owner of an engine core; all methods except ``_loop`` run on the event loop."""

    def __init__(self, core, loop: asyncio.AbstractEventLoop,
                 on_kv_events: Callable[[list], None] | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        self.core = core
        self.loop = loop
        self.on_kv_events = on_kv_events
        self.on_fatal = on_fatal
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[str, asyncio.Queue] = {}
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self.error: BaseException | None = None
        self.last_stats: Any = None
        self._announce_queued = False

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self.commands.put(_STOP)
        self.thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        """True while the engine thread runs and has not failed (readiness follows this)."""
        return self.error is None and self.thread.is_alive()

    def submit(self, request) -> asyncio.Queue:
        """Queue a request for the engine; its outputs arrive on the returned queue."""
        if self.error is not None:
            raise RuntimeError(f"engine failed: {self.error!r}")
        q: asyncio.Queue = asyncio.Queue()
        self.streams[request.request_id] = q
        self.commands.put(("add", request))
        return q

    def open_stream(self, request_id: str) -> asyncio.Queue:
        """Receive a request's outputs without submitting it (it was resumed from remote KV)."""
        q: asyncio.Queue = asyncio.Queue()
        self.streams[request_id] = q
        return q

    def call(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """Run ``fn(*args)`` on the engine thread between steps; its result as a future.

        The engine core is single-threaded; everything that touches it (prefix lookups,
        remote-KV allocation, resuming, releasing) goes through here.
        """
        if self.error is not None:
            raise RuntimeError(f"engine failed: {self.error!r}")
        fut = self.loop.create_future()
        self.commands.put(("call", (fn, args, fut)))
        return fut

    def announce_cache(self) -> None:
        """Announce every cached block again (``EngineCore.announce_kv_events``), in
        order with the engine's other KV events: a router that started late asked."""
        if self.error is None and not self._announce_queued:
            self._announce_queued = True  # one queued announcement answers every request
            self.commands.put(("announce", None))

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone, stop string hit, shutdown)."""
        if self.streams.pop(request_id, None) is not None:
            self.commands.put(("abort", request_id))

    def inflight(self) -> int:
        return len(self.streams)

    # ---- engine thread ------------------------------------------------------------------
    def _apply(self, cmd) -> bool:
        if cmd is _STOP:
            return False
        op, arg = cmd
        if op == "call":
            fn, args, fut = arg
            try:
                result = fn(*args)
            except Exception as exc:  # noqa: BLE001 - handed back to the caller
                self.loop.call_soon_threadsafe(_settle, fut, None, exc)
            else:
                self.loop.call_soon_threadsafe(_settle, fut, result, None)
            return True
        if op == "announce":
            self._announce_queued = False
            events = self.core.announce_kv_events()
            if events:
                self.loop.call_soon_threadsafe(self._deliver, [], events)
            return True
        try:
            if op == "add":
                self.core.add_request(arg)
            else:
                self.core.abort(arg)
        except Exception as exc:  # noqa: BLE001 - a bad request must not kill the loop
            if op == "add":
                self.loop.call_soon_threadsafe(self._deliver_error, arg.request_id, exc)
        return True

    def _loop(self) -> None:
        running = True
        try:
            while running:
                if not self.core.has_unfinished():
                    running = self._apply(self.commands.get())  # idle: block for work
                while running:
                    try:
                        running = self._apply(self.commands.get_nowait())
                    except queue.Empty:
                        break
                if not running or not self.core.has_unfinished():
                    continue
                outputs = self.core.step()
                events = self.core.drain_kv_events()
                self.last_stats = self.core.stats()
                self.loop.call_soon_threadsafe(self._deliver, outputs, events)
        except BaseException as exc:  # noqa: BLE001 - surfaced to every waiting request
            log.exception("engine loop crashed; the engine cannot continue")
            self.error = exc
            try:
                self.loop.call_soon_threadsafe(self._fail_all, exc)
            except RuntimeError:  # the event loop is closed: nobody is waiting any more
                return
        self._drain_commands()

    def _drain_commands(self) -> None:
        """After the loop ended: settle what was queued meanwhile so no caller hangs."""
        exc = self.error or RuntimeError("engine stopped")
        while True:
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return
            if cmd is not _STOP and cmd[0] == "call":
                try:
                    self.loop.call_soon_threadsafe(_settle, cmd[1][2], None, exc)
                except RuntimeError:  # the event loop is closed
                    return

    # ---- back on the event loop ---------------------------------------------------------
    def _deliver(self, outputs: list, events: list) -> None:
        if events and self.on_kv_events:
            self.on_kv_events(events)
        for out in outputs:
            q = self.streams.get(out.request_id)
            if q is None:
                continue  # aborted meanwhile
            q.put_nowait(out)
            if out.finished:
                self.streams.pop(out.request_id, None)

    def _deliver_error(self, request_id: str, exc: Exception) -> None:
        q = self.streams.pop(request_id, None)
        if q is not None:
            q.put_nowait(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for q in self.streams.values():
            q.put_nowait(exc)
        self.streams.clear()
        if self.on_fatal is not None:
            self.on_fatal(exc)


def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.cancelled():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
