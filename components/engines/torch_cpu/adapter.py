"""The torch CPU engine behind the engine interface, for every worker shell (aggregated,
decode coordinator, prefill loop).

The engine core runs on its own thread (``EngineRunner``); this adapter only maps
requests and outputs and owns the disaggregated steps of the torch path, where the
prefill side *pushes* KV:

- decode side: ``reserve_remote`` reserves the prompt's blocks (reusing the cached
  prefix) before the job is enqueued; the job names them (a ``TorchBlocksHandoff``).
  ``decode`` waits for the NIXL write's notification, resumes the request after the
  prefill's first token and streams the rest.  ``release_remote`` gives a reservation
  up: at once when no write can come, or after ``late_write_hold_s`` when the job may
  still be running (a late write must not land in blocks already reused);
- prefill side: ``prefill(destination=...)`` computes the prompt as a prefill-only
  request, writes its blocks into the destination over NIXL, then frees them.

Live KV moves (aggregated replicas with an agent) reuse both halves: a draining replica
``park``s a running request (its KV stays, the request stops between steps) and, asked
by the replica that continues it, ``export_parked`` writes the blocks there; that
replica's ``resume_moved`` reserves blocks for the request's tokens so far, has them
written (its ``fetch``), and resumes after the last token the client already has,
recomputing instead when anything on the way fails.

LoRA adapters (``serves_lora``) are read from their files off the engine thread and
take a slot on it; a request names its adapter (``GenerateParams.lora``) and carries it
through every path above, so a prefill computes its KV with it and the decode side
hashes its blocks under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from splitserve.contracts.kit.waiting import poll_until
from splitserve.contracts.engine import (
    EngineCapabilities,
    EngineHandoff,
    EngineInfo,
    GenerateParams,
    KvEventSink,
    LoadSample,
    PrefillResult,
    TokenDelta,
    TorchBlocksHandoff,
    WithoutFailureReport,
    WithoutHandoffFirst,
)

from splitserve.contracts.wire import NO_LOGPROB, FinishReason, TokenLogprobs

from .runner import EngineRunner

log = logging.getLogger("splitserve.worker")

FINISH: dict[str, FinishReason] = {
    "stop": FinishReason.EOS, "length": FinishReason.LENGTH,
    "abort": FinishReason.CANCELLED, "error": FinishReason.ERROR}
"""The engine core's finish reasons (``request.FinishReason``; its ``stop`` is a stop
token) in the contracts' vocabulary."""
# Suffix of the id under which a moved request's blocks are reserved: a failed move
# holds them for a while (a late write), and the recompute then runs under the plain id.
MOVE_SUFFIX = "#kv"


def torch_request(request_id: str, params: GenerateParams, **extra):
    """The engine core's request for ``params`` (``extra``: core-only fields such as
    ``prefill_only``); raises ValueError if invalid.  The core serves higher priorities
    first (admitted first, preempted last): a request's level, 0 for the most important
    class, goes in negated."""
    from .request import Request

    return Request(
        request_id=request_id, prompt_token_ids=params.token_ids,
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
        seed=params.seed, stop_token_ids=params.stop_token_ids, priority=-params.priority,
        top_k=params.top_k, min_p=params.min_p, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, logit_bias=params.logit_bias,
        min_tokens=params.min_tokens, logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs, json_schema=params.json_schema,
        lora=params.lora, **extra)


def output_logprobs(out) -> tuple[TokenLogprobs | None, TokenLogprobs | None]:
    """A core ``RequestOutput``'s sampled-token and prompt log-probabilities, if any."""
    def wire(values, tops) -> TokenLogprobs:
        return TokenLogprobs(logprobs=[v if math.isfinite(v) else NO_LOGPROB for v in values],
                             top=[[(t, v if math.isfinite(v) else NO_LOGPROB) for t, v in top]
                                  for top in tops or ()])

    sampled = prompt = None
    if out.logprobs is not None:
        sampled = wire(out.logprobs, out.top_logprobs)
    if out.prompt_logprobs is not None:
        prompt = wire(out.prompt_logprobs, out.prompt_top_logprobs)
    return sampled, prompt


class TorchEngine(WithoutFailureReport, WithoutHandoffFirst):
    """An engine core on its runner thread; implements ``Engine``: its prefill side
    pushes KV (``pushes_kv``: the decode side reserves blocks, the prefill side writes
    into them with its KV transfer agent), its prefix cache answers the decider, with
    an agent it moves KV live (``moves_kv``), and it serves LoRA adapters
    (``serves_lora``).  It cannot tell it died on its own
    (the runner thread's death ends the replica through its host) and its handoff is
    the prefill's result."""

    info: EngineInfo

    def __init__(self, core, runner: EngineRunner, block_size: int, agent=None, *,
                 arrival_timeout_s: float = 10.0, late_write_hold_s: float = 35.0,
                 kv_moves: bool = True, park_hold_s: float = 15.0) -> None:
        self.core, self.runner, self.agent = core, runner, agent
        self.block_size = block_size
        self.arrival_timeout_s = arrival_timeout_s
        self.late_write_hold_s = late_write_hold_s
        self.info = EngineInfo(name="torch", kv_block_size=block_size,
                               capabilities=EngineCapabilities(
                                   local_prefill=True, pushes_kv=True,
                                   handoff_before_prefill=False, prefix_lookup=True,
                                   moves_kv=kv_moves and agent is not None,
                                   reports_failure=False, serves_lora=True,
                                   kv_move_timeout_s=arrival_timeout_s))
        self.park_hold_s = park_hold_s
        self._reserved: dict[str, asyncio.Queue] = {}
        self._held: set[asyncio.Task] = set()
        self._parked: dict[str, tuple[object, asyncio.TimerHandle]] = {}
        self._aliases: dict[str, str] = {}  # request id -> engine id of a moved request
        # The core's loaded adapters (name -> path) as of its last load or unload: what
        # ``validate`` and ``loras`` read on the event loop without touching the core.
        self._loras: dict[str, str] = {}

    # ---- lifecycle (the torch host loads the model and starts the runner) -------------
    async def start(self) -> None:
        """Nothing to do: the model is loaded and the runner started by the host."""

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        await poll_until(lambda: not self.runner.inflight(), drain_timeout_s)
        for task in self._held:
            task.cancel()
        for _, timer in self._parked.values():
            timer.cancel()
        self._parked.clear()

    # ---- requests -----------------------------------------------------------------------
    def validate(self, params: GenerateParams) -> None:
        """Refuse token ids outside the model's vocabulary, and an adapter that is not
        loaded, before anything is queued."""
        self.core.check_token_ids(params.token_ids)
        if params.lora is not None and params.lora not in self._loras:
            raise ValueError(f"adapter {params.lora!r} is not loaded")

    def _request(self, request_id: str, params: GenerateParams, **extra):
        return torch_request(request_id, params, **extra)

    async def _deltas(self, request_id: str, q: asyncio.Queue) -> AsyncIterator[TokenDelta]:
        """The runner's outputs of one request as deltas; aborts it if abandoned."""
        finished = False
        try:
            while not finished:
                out = await q.get()
                if isinstance(out, BaseException):
                    finished = True  # the runner already dropped the request
                    raise out
                finished = out.finished
                if out.finish_reason == "error":
                    raise RuntimeError(out.error or "engine error")
                sampled, prompt = output_logprobs(out)
                yield TokenDelta(
                    token_ids=tuple(out.new_token_ids), finished=finished,
                    finish_reason=FINISH.get(out.finish_reason or "", FinishReason.EOS)
                    if finished else None,
                    prompt_tokens=out.num_prompt_tokens, cached_tokens=out.num_cached_tokens,
                    logprobs=sampled, prompt_logprobs=prompt)
        finally:
            if not finished:
                self.runner.abort(request_id)

    async def generate(self, request_id: str, params: GenerateParams
                       ) -> AsyncIterator[TokenDelta]:
        """Aggregated: prefill and decode here."""
        q = self.runner.submit(self._request(request_id, params))
        async with contextlib.aclosing(self._deltas(request_id, q)) as deltas:
            async for d in deltas:
                yield d

    async def abort(self, request_id: str) -> None:
        self.runner.abort(request_id)

    # ---- decode side of a remote prefill ----------------------------------------------
    async def cached_prefix_tokens(self, token_ids: tuple[int, ...],
                                   lora: str | None = None) -> int:
        """Prompt tokens cached for the base model, or for adapter ``lora``."""
        return await self.runner.call(self.core.cached_prefix_tokens, list(token_ids), lora)

    async def reserve_remote(self, request_id: str, params: GenerateParams
                             ) -> TorchBlocksHandoff | None:
        self._reserved[request_id] = self.runner.open_stream(request_id)
        self.agent.expect()  # its KV (and maybe a staging request) comes next
        try:
            alloc = await self.runner.call(self.core.allocate_remote,
                                           self._request(request_id, params))
        except BaseException:
            self.runner.streams.pop(request_id, None)
            self._reserved.pop(request_id, None)
            raise
        if alloc is None:
            self.runner.streams.pop(request_id, None)
            self._reserved.pop(request_id, None)
            return None
        skip = alloc.num_cached_tokens // self.block_size
        return TorchBlocksHandoff(nixl_agent=self.agent.name,
                                  block_ids=list(alloc.block_ids[skip:]),
                                  block_size=self.block_size,
                                  num_cached_tokens=skip * self.block_size)

    async def release_remote(self, request_id: str, late_write_possible: bool) -> None:
        if self._reserved.pop(request_id, None) is None:
            return
        self.runner.streams.pop(request_id, None)
        if not late_write_possible:
            self.runner.commands.put(("abort", request_id))
            return
        self.agent.cancel(request_id)  # a late staged payload is not unpacked

        async def release_later() -> None:
            await asyncio.sleep(self.late_write_hold_s)
            self.runner.commands.put(("abort", request_id))

        task = asyncio.ensure_future(release_later())
        self._held.add(task)
        task.add_done_callback(self._held.discard)

    async def decode(self, request_id: str, params: GenerateParams, handoff: EngineHandoff,
                     first_token: int | None = None) -> AsyncIterator[TokenDelta]:
        """Resume a reserved request once its KV is in its blocks."""
        q = self._reserved.get(request_id)
        if q is None:
            raise RuntimeError(f"request {request_id!r} has no reserved blocks")
        if first_token is None:
            raise ValueError("a torch decode needs the prefill's first token")
        try:
            # The prefill side writes, then hands over; the write's own notification
            # normally is here already.
            arrival = await self.agent.wait_for(request_id, self.arrival_timeout_s)
            sent = json.loads(arrival.payload).get("first_token")
            if sent is not None and sent != first_token:
                raise RuntimeError(f"request {request_id!r}: handoff token {first_token} "
                                   f"differs from the write's {sent}")
            await self.runner.call(self.core.resume_remote, request_id, first_token)
        except BaseException:
            await self.release_remote(request_id, late_write_possible=True)
            raise
        self._reserved.pop(request_id, None)
        async with contextlib.aclosing(self._deltas(request_id, q)) as deltas:
            async for d in deltas:
                yield d

    # ---- prefill side ------------------------------------------------------------------
    async def prefill(self, request_id: str, params: GenerateParams,
                      destination: TorchBlocksHandoff | None = None) -> PrefillResult:
        """Compute the prompt (prefix cache used), write its KV into ``destination``'s
        blocks over NIXL with the first token as the notification, then free them."""
        if not isinstance(destination, TorchBlocksHandoff) or self.agent is None:
            raise ValueError("a torch prefill needs a torch-blocks destination and an agent")
        t0 = time.monotonic()
        q = self.runner.submit(self._request(request_id, params, prefill_only=True))
        held = False
        try:
            while True:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise out
                if out.finished:
                    break
            if out.finish_reason == "error":
                raise RuntimeError(out.error)
            held = out.finish_reason != "abort"
            if not held or not out.new_token_ids:
                raise RuntimeError(f"prefill of {request_id!r} ended without a token")
            compute_s = time.monotonic() - t0
            skip = destination.num_cached_tokens // destination.block_size
            src = list(out.kv_block_ids[skip:skip + len(destination.block_ids)])
            first = out.new_token_ids[0]
            # The notification names the decode side's request id (the job's), not this
            # engine's (which carries the delivery count).
            rid = request_id.rsplit("@", 1)[0]
            notify = json.dumps({"request_id": rid, "first_token": first}).encode()
            res = await self.agent.write_blocks(destination.nixl_agent, src,
                                                destination.block_ids, notify, request_id=rid)
            return PrefillResult(first_token=first, handoff=destination,
                                 cached_tokens=out.num_cached_tokens, compute_s=compute_s,
                                 transfer_s=res.seconds, transfer_bytes=res.nbytes)
        finally:
            if held:
                await self.runner.call(self.core.release_kv, request_id)
            else:
                self.runner.abort(request_id)

    # ---- live KV moves (capabilities.moves_kv: configured, and it has an agent) --------
    async def park(self, request_id: str) -> tuple[str, tuple[int, ...]] | None:
        """Stop a running request between steps, keeping its KV for ``park_hold_s``;
        returns the id it is parked under (``export_parked``'s) and its tokens (prompt
        and output, some of which may not have reached the caller yet; the KV holds all
        but the last), or None when it cannot move (the caller ends it as usual).  Its
        stream ends here without a finish."""
        if not self.info.capabilities.moves_kv:
            return None
        eid = self._aliases.get(request_id, request_id)
        parked = await self.runner.call(self.core.park, eid)
        if parked is None:
            return None
        self.runner.streams.pop(eid, None)  # closing the stream aborts nothing now
        timer = asyncio.get_running_loop().call_later(
            self.park_hold_s, lambda: asyncio.ensure_future(self._unpark(eid)))
        self._parked[eid] = (parked, timer)
        return eid, parked.token_ids

    async def _unpark(self, request_id: str) -> None:
        entry = self._parked.pop(request_id, None)
        if entry is not None:
            entry[1].cancel()
            with contextlib.suppress(RuntimeError):  # the engine is stopping
                await self.runner.call(self.core.release_parked, request_id)

    def parked(self) -> int:
        """Requests whose KV waits here for the replica that continues them."""
        return len(self._parked)

    async def export_parked(self, request_id: str, destination: TorchBlocksHandoff,
                            notify_id: str):
        """Write a parked request's KV into ``destination``'s blocks (their reader
        waits for ``notify_id``), then free it here; returns the agent's WriteResult."""
        entry = self._parked.get(request_id)
        if entry is None:
            raise LookupError(f"request {request_id!r} is not parked here (moved, expired "
                              f"or never parked)")
        parked = entry[0]
        try:
            skip = destination.num_cached_tokens // destination.block_size
            if destination.block_size != self.block_size:
                raise ValueError(f"block size {destination.block_size} differs from "
                                 f"{self.block_size}")
            src = list(parked.block_ids[skip:skip + len(destination.block_ids)])
            if len(src) != len(destination.block_ids):
                raise ValueError(f"{len(destination.block_ids)} blocks asked for, "
                                 f"{len(src)} held after the {skip} cached there")
            notify = json.dumps({"request_id": notify_id,
                                 "first_token": parked.token_ids[-1]}).encode()
            return await self.agent.write_blocks(destination.nixl_agent, src,
                                                 destination.block_ids, notify,
                                                 request_id=notify_id)
        finally:
            await self._unpark(request_id)

    async def resume_moved(self, request_id: str, params: GenerateParams,
                           fetch: Callable[[TorchBlocksHandoff, str], Awaitable[object]],
                           outcome: Callable[[str], None] = lambda _: None
                           ) -> AsyncIterator[TokenDelta]:
        """Continue a request whose KV another replica parked: ``params.token_ids`` are
        its prompt and the tokens streamed so far, the KV covers all but the last.
        Reserves blocks, has ``fetch(handoff, notify_id)`` write them, resumes after the
        last token (not sent again); recomputes when any of that fails.  ``outcome`` is
        told which: "moved" or "recomputed"."""
        *head, last = params.token_ids
        moved = dataclasses.replace(params, token_ids=tuple(head),
                                    max_tokens=params.max_tokens + 1,
                                    min_tokens=(params.min_tokens + 1
                                                if params.min_tokens else params.min_tokens))
        move_id = request_id + MOVE_SUFFIX
        stream = None
        first = None
        try:
            handoff = await self.reserve_remote(move_id, moved)
            if handoff is None:
                raise RuntimeError("no free blocks for the moved KV")
            try:
                await fetch(handoff, move_id)
            except BaseException:
                await self.release_remote(move_id, late_write_possible=True)
                raise
            stream = self.decode(move_id, moved, handoff, first_token=last)
            first = await anext(stream)
        except Exception as exc:  # noqa: BLE001 - recompute instead
            if stream is not None:
                await stream.aclose()
            log.warning("live KV move of %s failed (%s); recomputing its %d tokens",
                        request_id, exc, len(params.token_ids))
            outcome("recomputed")
            async with contextlib.aclosing(self.generate(request_id, params)) as deltas:
                async for d in deltas:
                    yield d
            return
        outcome("moved")
        self._aliases[request_id] = move_id  # a later drain parks it by the caller's id
        try:
            async with contextlib.aclosing(stream):
                # the resumed stream starts with the last token, which the client has
                d = dataclasses.replace(first, token_ids=first.token_ids[1:])
                if d.token_ids or d.finished:
                    yield d
                if d.finished:
                    return
                async for d in stream:
                    yield d
        finally:
            self._aliases.pop(request_id, None)

    # ---- LoRA adapters (capabilities.serves_lora) ---------------------------------------
    async def load_lora(self, name: str, path: str) -> None:
        """Read adapter ``path`` in a worker thread (its files take a while; it reads the
        core's fixed model shape only), then take a slot for it on the engine thread."""
        from .lora import same_directory

        if name in self._loras and same_directory(self._loras[name], path):
            return
        adapter = await asyncio.to_thread(self.core.read_lora, path)
        self._loras = await self.runner.call(self.core.add_lora, name, adapter)

    async def unload_lora(self, name: str) -> None:
        """Free adapter ``name``'s slot (KeyError: not loaded; ValueError: in use)."""
        if name not in self._loras:
            raise KeyError(f"adapter {name!r} is not loaded")
        self._loras = await self.runner.call(self.core.remove_lora, name)

    def loras(self) -> dict[str, str]:
        """The adapters loaded now: name -> the path each was loaded from."""
        return dict(self._loras)

    # ---- sources ------------------------------------------------------------------------
    async def run_kv_events(self, sink: KvEventSink,
                            ready: asyncio.Event | None = None) -> None:
        """The runner publishes KV events itself (set up by the host)."""
        if ready is not None:
            ready.set()

    def load(self) -> LoadSample:
        st = self.runner.last_stats or self.core.stats()
        return LoadSample(active=st.num_running, waiting=st.num_waiting,
                          kv_used_blocks=st.kv_blocks_used, kv_total_blocks=st.kv_blocks_total)

    def inflight(self) -> int:
        return self.runner.inflight()
