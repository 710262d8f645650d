"""SGLang (``sglang.Engine``, in process) behind the project's engine interface.

One object per SGLang engine and role: ``agg`` serves whole requests, ``prefill`` runs
prefill-for-job with ``max_new_tokens: 1`` under a bootstrap room, ``decode`` continues
requests from a bootstrap handoff.  SGLang moves the KV itself (NIXL or Mooncake).

The handoff of SGLang exists *before* the prefill runs (the prefill engine's bootstrap
host/port and a fresh room), and the prefill engine waits for the decode engine to join
the room before it computes.  So the prefill worker must hand the decode worker
``begin_prefill(...).handoff`` first and await ``.result`` after: awaiting
``prefill()`` first would wait for a decode engine that was never told the room.
``info.extras["handoff_before_prefill"]`` says so to the prefill loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from splitserve.components.engines.interface import (
    EngineHandoff,
    EngineInfo,
    GenerateParams,
    KvEventSink,
    LoadSample,
    PrefillResult,
    SglangBootstrapHandoff,
    TokenDelta,
)

from . import kv_relay
from .config import Role, SglangEngineArgs, server_args_kwargs
from .metrics import LoadTracker
from .requests import finish_message, generate_kwargs, new_bootstrap_room, to_delta

log = logging.getLogger("splitserve.sglang")


class NoLocalPrefill(RuntimeError):
    """A decode-mode SGLang engine was asked to prefill (it refuses without a room)."""


@dataclass
class PrefillTicket:
    """A prefill submitted to SGLang: the handoff to give the decode worker now, and
    the task that ends with the PrefillResult once the KV has left this engine."""

    handoff: SglangBootstrapHandoff
    result: asyncio.Task


def default_factory(**kwargs: Any):
    """Start a real ``sglang.Engine`` (GPU machines; blocks until loaded)."""
    import sglang

    return sglang.Engine(**kwargs)


class SglangEngine:
    """One SGLang engine; implements ``splitserve.components.engines.interface.Engine``.

    ``local_prefill`` (an ``agg`` SglangEngine beside a ``decode`` one) gives a decode
    worker somewhere to prefill locally; without it ``supports_local_prefill`` is False.
    ``factory`` builds the engine from ServerArgs keywords (tests pass a double).
    """

    def __init__(self, args: SglangEngineArgs, served_name: str, role: Role = "agg", *,
                 host: str = "127.0.0.1", local_prefill: SglangEngine | None = None,
                 factory: Callable[..., Any] = default_factory) -> None:
        if local_prefill is not None and (role != "decode" or local_prefill.role != "agg"):
            raise ValueError("local_prefill pairs an agg engine with a decode engine")
        self.args, self.served_name, self.role, self.host = args, served_name, role, host
        self.local_prefill = local_prefill
        self._factory = factory
        self.info = EngineInfo(
            name="sglang", kv_block_size=args.page_size,
            supports_local_prefill=role != "decode" or local_prefill is not None,
            extras={"role": role, "handoff_before_prefill": role == "prefill"})
        self.kv_endpoint = (f"tcp://127.0.0.1:{kv_relay.free_loopback_port()}"
                            if args.kv_events_enabled() else None)
        self._engine = None
        self._active: set[str] = set()
        self._accepting = True
        self._prefills: set[asyncio.Task] = set()
        self.tracker = LoadTracker(args.page_size)

    # ---- lifecycle ----------------------------------------------------------------------
    def server_kwargs(self) -> dict[str, Any]:
        """The ServerArgs keywords this engine starts with."""
        return server_args_kwargs(self.args, self.role, self.served_name, self.kv_endpoint,
                                  self.host)

    async def start(self) -> None:
        """Start SGLang (and the paired local-prefill engine); returns when both serve."""
        kw = self.server_kwargs()
        log.info("starting SGLang (%s): %s", self.role, kw)
        self._engine = self._factory(**kw)
        self.tracker.start(self._engine)
        if self.local_prefill is not None:
            await self.local_prefill.start()

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Refuse new work, wait up to ``drain_timeout_s`` for in-flight requests, abort
        what is left, then stop SGLang."""
        self._accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while self.inflight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self._active):
            await self.abort(rid)
        for t in list(self._prefills):
            t.cancel()
        await self.tracker.stop()
        if self._engine is not None:
            engine, self._engine = self._engine, None
            await asyncio.to_thread(engine.shutdown)
        if self.local_prefill is not None:
            await self.local_prefill.shutdown(0.0)

    # ---- requests -----------------------------------------------------------------------
    def _admit(self, request_id: str) -> None:
        if not self._accepting or self._engine is None:
            raise RuntimeError("engine is not accepting requests")
        if request_id in self._active:
            raise ValueError(f"request id {request_id!r} is already running")
        self._active.add(request_id)

    async def _stream(self, request_id: str, kw: dict[str, Any]) -> AsyncIterator[TokenDelta]:
        self._admit(request_id)
        finished = False
        try:
            gen = await self._engine.async_generate(**kw)
            async for out in gen:
                delta = to_delta(out)
                finished = delta.finished
                yield delta
                if finished:
                    return
        finally:
            self._active.discard(request_id)
            if not finished:
                await self.abort(request_id)

    def generate(self, request_id: str, params: GenerateParams) -> AsyncIterator[TokenDelta]:
        """Aggregated: the whole request here.  A decode engine hands it to its paired
        local-prefill engine, and without one refuses (NoLocalPrefill)."""
        if self.role == "decode":
            if self.local_prefill is None:
                raise NoLocalPrefill("this SGLang decode engine cannot prefill locally and "
                                     "has no local prefill engine; prefill remotely")
            return self.local_prefill.generate(request_id, params)
        if self.role != "agg":
            raise RuntimeError(f"a {self.role} SGLang engine does not serve whole requests")
        return self._stream(request_id, generate_kwargs(request_id, params))

    async def begin_prefill(self, request_id: str, params: GenerateParams) -> PrefillTicket:
        """Submit a prefill under a fresh bootstrap room; returns at once with the
        handoff (publish it to the decode worker) and the task that finishes the job."""
        if self.role != "prefill":
            raise RuntimeError(f"prefill() needs a prefill SGLang engine, this is {self.role}")
        handoff = SglangBootstrapHandoff(bootstrap_host=self.host,
                                         bootstrap_port=self.args.bootstrap_port,
                                         bootstrap_room=new_bootstrap_room())
        self._admit(request_id)
        t0 = time.monotonic()
        try:
            gen = await self._engine.async_generate(**generate_kwargs(
                request_id, params, max_new_tokens=1, handoff=handoff))
        except BaseException:
            self._active.discard(request_id)
            raise
        task = asyncio.ensure_future(self._finish_prefill(request_id, gen, handoff, t0))
        self._prefills.add(task)
        task.add_done_callback(self._prefills.discard)
        return PrefillTicket(handoff, task)

    async def _finish_prefill(self, request_id: str, gen, handoff, t0: float) -> PrefillResult:
        tokens: list[int] = []
        last = None
        finished = False
        try:
            async for out in gen:
                last = to_delta(out)
                tokens += last.token_ids
                if last.finished:
                    finished = True
                    if last.finish_reason in ("abort", "error"):
                        raise RuntimeError(f"SGLang prefill of {request_id!r} ended with "
                                           f"{last.finish_reason}: {finish_message(out)}")
                    break
        finally:
            self._active.discard(request_id)
            if not finished:
                await self.abort(request_id)
        if not tokens:
            raise RuntimeError(f"SGLang prefill of {request_id!r} returned no token")
        return PrefillResult(first_token=tokens[0], handoff=handoff,
                             cached_tokens=last.cached_tokens if last else 0,
                             compute_s=time.monotonic() - t0)

    async def prefill(self, request_id: str, params: GenerateParams) -> PrefillResult:
        """Prefill-for-job, awaited to the end.  Only safe when the decode side already
        has the handoff some other way; the prefill loop uses ``begin_prefill``."""
        ticket = await self.begin_prefill(request_id, params)
        return await ticket.result

    def decode(self, request_id: str, params: GenerateParams, handoff: EngineHandoff,
               first_token: int | None = None) -> AsyncIterator[TokenDelta]:
        """Decode-with-handoff: join the prefill's bootstrap room; SGLang pulls the KV
        and streams every token, the prefill's first token included."""
        if self.role != "decode":
            raise RuntimeError(f"decode() needs a decode SGLang engine, this is {self.role}")
        if not isinstance(handoff, SglangBootstrapHandoff):
            raise TypeError(f"an SGLang decode engine needs a sglang-bootstrap handoff, "
                            f"got {handoff.kind}")
        return self._stream(request_id, generate_kwargs(request_id, params, handoff=handoff))

    async def abort(self, request_id: str) -> None:
        """Abort one request in SGLang (unknown or finished ids are ignored by SGLang)."""
        if self._engine is not None:
            with contextlib.suppress(Exception):
                self._engine.tokenizer_manager.abort_request(rid=request_id, abort_all=False)
        if self.local_prefill is not None:
            await self.local_prefill.abort(request_id)

    # ---- sources ------------------------------------------------------------------------
    async def run_kv_events(self, sink: KvEventSink,
                            ready: asyncio.Event | None = None) -> None:
        """Relay SGLang's ZMQ KV events to ``sink`` until cancelled (none when disabled).
        Start it before ``start()`` and wait for ``ready``: SGLang's publisher connects."""
        if self.kv_endpoint is None:
            if ready is not None:
                ready.set()
            return
        await kv_relay.relay(self.kv_endpoint, self.args.page_size, sink, ready)

    def load(self) -> LoadSample:
        """Load from SGLang's scheduler metrics, or from the requests in flight here
        until the first metrics arrive."""
        sample = self.tracker.sample(self.inflight())
        if self.local_prefill is not None:
            other = self.local_prefill.load()
            sample = LoadSample(sample.active + other.active, sample.waiting + other.waiting,
                                sample.kv_used_blocks + other.kv_used_blocks,
                                sample.kv_total_blocks + other.kv_total_blocks)
        return sample

    def inflight(self) -> int:
        local = self.local_prefill.inflight() if self.local_prefill is not None else 0
        return len(self._active) + local
