"""TensorRT-LLM (``tensorrt_llm.LLM``, in process) behind the project's engine interface.

A prefill engine runs ``context_only`` requests and returns the result's
``disaggregated_params`` (opaque state included) as the handoff; a decode engine runs
``generation_only`` requests with those params (its cache transceiver fetches the KV)
and ``context_and_generation`` for local prefills, so TensorRT-LLM decode workers keep
local prefill.  An aggregated engine runs plain requests.

What follows Dynamo 1.6.1's TensorRT-LLM worker: a context request carries a
``disagg_request_id`` (the id both engines' cache transceivers match on) and is
submitted non-streaming; a generation request aborted before its first token is only
aborted once that token arrives (its KV is still being received; aborting mid-transfer
leaves the transceivers with a half-finished transfer); the LLM is built on the event
loop's thread; a dead executor is reported by ``failure()`` so the worker exits and is
restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import os
import socket
import time
import zlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from splitserve.contracts.kit.once import OncePerKind
from splitserve.contracts.engine import (
    EngineCapabilities,
    EngineHandoff,
    EngineInfo,
    GenerateParams,
    KvEventSink,
    LoadSample,
    OpaqueHandoff,
    PrefillResult,
    TokenDelta,
    TorchBlocksHandoff,
    WithoutHandoffFirst,
    WithoutKvMoves,
    WithoutKvPush,
    WithoutLora,
    WithoutPrefixLookup,
)
from splitserve.contracts.wire import FinishReason
from splitserve.contracts.kit.model_dir import weights_dir

from .config import Role, TrtllmEngineArgs, check_version, llm_kwargs
from .events import PoolLevels, convert_event, load_from_stats
from .requests import (
    DeltaCursor,
    RequestType,
    guided_kwargs,
    handoff_from_params,
    params_fields,
    sampling_kwargs,
)

log = logging.getLogger("splitserve.trtllm")


class LlmApi:
    """The TensorRT-LLM classes the adapter builds (tests pass doubles)."""

    def __init__(self) -> None:
        import tensorrt_llm
        from tensorrt_llm import LLM, SamplingParams
        from tensorrt_llm.llmapi import DisaggregatedParams
        from tensorrt_llm.llmapi.disagg_utils import get_global_disagg_request_id
        from tensorrt_llm.sampling_params import GuidedDecodingParams

        self.LLM, self.SamplingParams, self.DisaggregatedParams = (
            LLM, SamplingParams, DisaggregatedParams)
        self.GuidedDecodingParams = GuidedDecodingParams
        self.version = str(tensorrt_llm.__version__)
        self._global_id = get_global_disagg_request_id

    def make_llm(self, **kwargs: Any):
        kwargs.pop("backend", None)  # LLM is the PyTorch backend's class
        return self.LLM(**kwargs)

    def disagg_request_id(self, machine_id: int) -> int:
        """A cluster-unique id for one context/generation pair.  Releases from 1.3.0rc22
        take an 8-bit node id and a 6-bit process id, earlier ones a 10-bit machine id;
        ``machine_id`` (< 1021) maps losslessly onto either."""
        if "process_id" in inspect.signature(self._global_id).parameters:
            node, process = divmod(machine_id, 64)
            return self._global_id(node, process)
        return self._global_id(machine_id)


def default_machine_id() -> int:
    """This process's slot in TensorRT-LLM's disagg-id space (< 1021): host and pid, so
    replicas on one host and across hosts rarely share one (ids also carry a time and a
    sequence part)."""
    return zlib.crc32(f"{socket.gethostname()}:{os.getpid()}".encode()) % 1021


@dataclasses.dataclass
class _Live:
    """One request in the engine."""

    result: Any
    defer_abort: bool = False
    """A generation_only request: abort only after its first output (KV received)."""
    first_seen: bool = False


class NotServedHere(ValueError):
    """A request asked for something this TensorRT-LLM engine cannot give it."""


def _unreadable(what: str) -> OncePerKind:
    """A poller's failure log (the pollers run several times a second)."""
    return OncePerKind(log, f"TensorRT-LLM {what} unreadable (logged once per kind): %s")


class TrtllmEngine(WithoutPrefixLookup, WithoutHandoffFirst, WithoutKvPush, WithoutKvMoves,
                   WithoutLora):
    """One TensorRT-LLM engine; implements ``splitserve.contracts.engine.Engine``, and
    tells when its executor died (``reports_failure``).

    No LoRA (``WithoutLora``): TensorRT-LLM's LLM API has no call that loads or unloads
    an adapter.  A request names one (``generate_async(lora_request=LoRARequest(name,
    id, path))``) and its PEFT cache loads it on that first use and evicts it when full,
    so ``load_lora`` could neither refuse a bad adapter (the first request naming it
    would fail instead) nor ``unload_lora`` free one; and Dynamo's TensorRT-LLM worker,
    which these calls follow, sends no ``lora_request`` to check the shapes against.
    """

    info: EngineInfo

    def __init__(self, args: TrtllmEngineArgs, served_name: str, role: Role = "agg", *,
                 api_factory: Callable[[], Any] = LlmApi,
                 stats_interval_s: float = 0.2, machine_id: int | None = None) -> None:
        self.args, self.served_name, self.role = args, served_name, role
        self._api_factory = api_factory
        self.api: Any = None
        self.llm: Any = None
        self.info = EngineInfo(name="trtllm", kv_block_size=args.tokens_per_block,
                               capabilities=EngineCapabilities(
                                   local_prefill=role != "prefill", pushes_kv=False,
                                   handoff_before_prefill=False, prefix_lookup=False,
                                   moves_kv=False, reports_failure=True),
                               lower_tiers=args.lower_tiers())
        self._active: dict[str, _Live] = {}
        self._machine_id = default_machine_id() if machine_id is None else machine_id
        self._deferred: set[asyncio.Task] = set()
        self._accepting = True
        self._latest: LoadSample | None = None
        self._stats_interval_s = stats_interval_s
        self._stats_task: asyncio.Task | None = None
        self._first_output = asyncio.Event()
        """Set at the first output of any request: TensorRT-LLM creates its KV event and
        stats queues with the first request, so both are polled only after it (as
        Dynamo's worker starts its publisher at the first output)."""

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Build the LLM (loads weights, sizes the KV cache); returns when it serves.

        The LLM is built here, on the event loop's thread, as Dynamo's worker builds it:
        its asynchronous results and stats are consumed from this loop, and a build in
        a helper thread is a set-up neither Dynamo nor TensorRT-LLM's own server uses.
        The loop is blocked while the weights load; nothing is served before anyway
        (the worker registers after ``start`` returns)."""
        self.api = self._api_factory()
        check_version(self.api.version, self.args)
        kw = llm_kwargs(self.args, self.role)
        log.info("starting TensorRT-LLM %s (%s): %s", self.api.version, self.role, kw)
        self.llm = self.api.make_llm(**kw)
        self._stats_task = asyncio.ensure_future(self._poll_stats())

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Refuse new work, drain up to ``drain_timeout_s``, abort the rest, stop."""
        self._accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while self._active and time.monotonic() < deadline:  # noqa: ASYNC110 - a count
            await asyncio.sleep(0.05)
        for rid in list(self._active):
            await self.abort(rid)
        if self._deferred:  # generation requests still receiving KV: let them settle
            await asyncio.wait(set(self._deferred), timeout=self.args.kv_transfer_timeout_ms / 1000)
        if self._stats_task is not None:
            self._stats_task.cancel()
            await asyncio.gather(self._stats_task, return_exceptions=True)
        if self.llm is not None:
            llm, self.llm = self.llm, None
            await asyncio.to_thread(llm.shutdown)

    # ---- requests -----------------------------------------------------------------------
    def validate(self, params: GenerateParams) -> None:
        """Refuse a request this engine would not honour (called before queueing): an
        adapter (no LoRA here: the base model must not answer in its place), prompt
        log-probabilities are not asked of TensorRT-LLM, and a JSON schema needs the LLM
        built with a guided-decoding backend."""
        if params.lora is not None:
            raise NotServedHere(f"lora: the TensorRT-LLM engine serves no LoRA adapter here, "
                                f"asked for {params.lora!r}")
        if params.prompt_logprobs is not None:
            raise NotServedHere("echo with logprobs: the TensorRT-LLM engine does not "
                                "return prompt log-probabilities here")
        if params.json_schema is not None and self.args.guided_decoding_backend is None:
            raise NotServedHere("response_format: this TensorRT-LLM engine was started "
                                "without a guided-decoding backend "
                                "(engine_args.guided_decoding_backend: xgrammar enables it)")

    def _submit(self, request_id: str, params: GenerateParams, request_type: RequestType | None,
                handoff: OpaqueHandoff | None = None, max_tokens: int | None = None):
        if not self._accepting or self.llm is None:
            raise RuntimeError("engine is not accepting requests")
        if request_id in self._active:
            raise ValueError(f"request id {request_id!r} is already running")
        self.validate(params)
        kw = sampling_kwargs(params, max_tokens=max_tokens)
        guided = guided_kwargs(params)
        if guided is not None:
            kw["guided_decoding"] = self.api.GuidedDecodingParams(**guided)
        sp = self.api.SamplingParams(**kw)
        dp = None
        if request_type == "generation_only":
            dp = self.api.DisaggregatedParams(**params_fields(handoff, request_type))
        elif request_type == "context_only":
            dp = self.api.DisaggregatedParams(
                request_type=request_type,
                disagg_request_id=self.api.disagg_request_id(self._machine_id))
        elif request_type is not None:
            dp = self.api.DisaggregatedParams(request_type=request_type)
        # A context phase is one result: non-streaming, as in Dynamo's prefill handler.
        result = self.llm.generate_async(inputs=list(params.token_ids), sampling_params=sp,
                                         disaggregated_params=dp,
                                         streaming=request_type != "context_only")
        self._active[request_id] = _Live(result, defer_abort=request_type == "generation_only")
        return result

    async def _stream(self, request_id: str, result,
                      top_n: int | None = None) -> AsyncIterator[TokenDelta]:
        cursor, finished = DeltaCursor(top_n), False
        try:
            async for out in result:
                self._first_output.set()
                live = self._active.get(request_id)
                if live is not None:
                    live.first_seen = True
                delta = cursor.delta(out)
                finished = delta.finished
                yield delta
                if finished:
                    return
        finally:
            live = self._active.pop(request_id, None)
            if not finished and live is not None:
                self._abort(live)

    def _abort(self, live: _Live) -> None:
        """Abort now, or for a generation request still receiving its KV, once its first
        output shows the transfer has ended."""
        if live.defer_abort and not live.first_seen:
            try:
                task = asyncio.ensure_future(self._abort_after_first(live.result))
            except RuntimeError:  # no running loop (a stream finalised at exit)
                pass
            else:
                self._deferred.add(task)
                task.add_done_callback(self._deferred.discard)
                return
        try:
            live.result.abort()
        except Exception as exc:  # noqa: BLE001 - finished or unknown: nothing to free
            log.debug("abort of a TensorRT-LLM request failed: %s", exc)

    @staticmethod
    async def _abort_after_first(result) -> None:
        with contextlib.suppress(Exception):
            async for _ in result:
                break
        with contextlib.suppress(Exception):
            result.abort()

    def _role_stream(self, request_id, params, request_type, handoff=None):
        result = self._submit(request_id, params, request_type, handoff)
        return self._stream(request_id, result, params.logprobs)

    def generate(self, request_id: str, params: GenerateParams) -> AsyncIterator[TokenDelta]:
        """Aggregated, or a decode engine's local prefill (``context_and_generation``)."""
        if self.role == "prefill":
            raise RuntimeError("a prefill TensorRT-LLM engine does not serve whole requests")
        kind = "context_and_generation" if self.role == "decode" else None
        return self._role_stream(request_id, params, kind)

    async def prefill(self, request_id: str, params: GenerateParams,
                      destination: TorchBlocksHandoff | None = None) -> PrefillResult:
        """Prefill-for-job: a ``context_only`` request; the handoff is the result's
        ``disaggregated_params``.  The KV stays in this engine until the decode engine's
        cache transceiver has fetched it."""
        if self.role != "prefill":
            raise RuntimeError(f"prefill() needs a prefill TensorRT-LLM engine, this is {self.role}")
        t0 = time.monotonic()
        result = self._submit(request_id, params, "context_only", max_tokens=1)
        cursor, tokens, last, out = DeltaCursor(), [], None, None
        try:
            async for out in result:
                self._first_output.set()
                last = cursor.delta(out)
                tokens += last.token_ids
                if last.finished:
                    break
        finally:
            live = self._active.pop(request_id, None)
            if (last is None or not last.finished) and live is not None:
                self._abort(live)
        comp = out.outputs[0] if out is not None and out.outputs else None
        dparams = getattr(comp, "disaggregated_params", None)
        if tokens and dparams is None and last.finish_reason in (FinishReason.EOS,
                                                                 FinishReason.STOP):
            # Its one token ended the request: TensorRT-LLM keeps no KV to hand off, and
            # the answer is complete (Dynamo returns that response as it is).
            return PrefillResult(first_token=tokens[0], handoff=None,
                                 cached_tokens=last.cached_tokens,
                                 compute_s=time.monotonic() - t0,
                                 finished=last.finish_reason)
        if not tokens or dparams is None or (last and last.finish_reason == FinishReason.CANCELLED):
            raise RuntimeError(f"TensorRT-LLM context phase of {request_id!r} returned no "
                               f"{'token' if not tokens else 'disaggregated_params'}")
        return PrefillResult(first_token=tokens[0], handoff=handoff_from_params(dparams),
                             cached_tokens=last.cached_tokens, compute_s=time.monotonic() - t0)

    def decode(self, request_id: str, params: GenerateParams, handoff: EngineHandoff,
               first_token: int | None = None) -> AsyncIterator[TokenDelta]:
        """Decode-with-handoff: a ``generation_only`` request with the context's params."""
        if self.role != "decode":
            raise RuntimeError(f"decode() needs a decode TensorRT-LLM engine, this is {self.role}")
        if not isinstance(handoff, OpaqueHandoff):
            raise TypeError(f"a TensorRT-LLM decode engine needs an opaque handoff, "
                            f"got {handoff.kind}")
        return self._role_stream(request_id, params, "generation_only", handoff)

    async def abort(self, request_id: str) -> None:
        """Abort one request (``GenerationResult.abort``); unknown ids are ignored."""
        live = self._active.pop(request_id, None)
        if live is not None:
            self._abort(live)

    # ---- sources ------------------------------------------------------------------------
    async def run_kv_events(self, sink: KvEventSink,
                            ready: asyncio.Event | None = None) -> None:
        """Poll ``get_kv_cache_events_async`` and feed ``sink`` until cancelled, from
        the first output on (before it TensorRT-LLM has no event queue and asserts).  The
        engine buffers events itself, so nothing is missed before the first poll; a
        failed poll is logged (once per kind) and the next one tried."""
        if ready is not None:
            ready.set()
        if not self.args.kv_events_enabled():
            return
        await self._first_output.wait()
        failed = _unreadable("KV events")
        partial: set[int] = set()  # partial blocks never announced: their removals dropped
        pools = PoolLevels() if self.info.lower_tiers else None  # moves to the host pool
        while True:
            batch = []
            try:
                async for event in self.llm.get_kv_cache_events_async(timeout=0.5):
                    batch += convert_event(event, self.args.tokens_per_block, partial, pools)
            except Exception as exc:  # noqa: BLE001 - the relay outlives one bad poll
                failed(exc)
                await asyncio.sleep(0.5)
            if batch:
                sink(batch)
            await asyncio.sleep(0.01)

    async def _poll_stats(self) -> None:
        await self._first_output.wait()  # no stats queue before the first request
        failed = _unreadable("stats")
        while self.llm is not None:
            try:
                async for stat in self.llm.get_stats_async(timeout=0.5):
                    self._latest = load_from_stats(stat)
            except Exception as exc:  # noqa: BLE001 - load reports go on with the last stats
                failed(exc)
            await asyncio.sleep(self._stats_interval_s)

    def load(self) -> LoadSample:
        """The latest iteration stats, or the requests in flight here before any."""
        if self._latest is None:
            return LoadSample(active=len(self._active), waiting=0, kv_used_blocks=0,
                              kv_total_blocks=0)
        return self._latest

    def inflight(self) -> int:
        return len(self._active)

    def failure(self) -> BaseException | None:
        """The executor's fatal error, or a failed health check; None while healthy.
        Polled by the worker, which exits so the supervisor restarts the replica."""
        llm = self.llm
        if llm is None:
            return None
        executor = getattr(llm, "_executor", None)
        fatal = getattr(executor, "_fatal_error", None)
        if fatal is not None:
            return fatal if isinstance(fatal, BaseException) else RuntimeError(str(fatal))
        check = getattr(llm, "_check_health", None) or getattr(executor, "check_health", None)
        if callable(check):
            try:
                healthy = bool(check())
            except Exception as exc:  # noqa: BLE001 - a failing check is a dead engine
                return exc
            if not healthy:
                return RuntimeError("TensorRT-LLM executor reports unhealthy")
        return None


def make_engine(ctx, cfg, role: Role) -> TrtllmEngine:
    """The registry's factory: the section's engine for ``role``, not started.
    TensorRT-LLM gets the model's directory: the section's own model, else Common.model
    (a hub id becomes its cached snapshot: nothing is downloaded)."""
    common = ctx.run.common
    path = weights_dir(cfg.engine_args.model or common.model)
    return TrtllmEngine(cfg.engine_args.model_copy(update={"model": str(path)}),
                        common.served_model_name, role)
