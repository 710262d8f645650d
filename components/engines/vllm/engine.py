"""vLLM (``AsyncLLM``, in process) behind the project's engine interface.

The engine core runs in vLLM's own child process; this object lives on the worker's
event loop and only maps requests, outputs, stats and KV events.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from splitserve.contracts.kit.model_dir import weights_dir
from splitserve.contracts.kit.waiting import poll_until
from splitserve.contracts.model_files import PACKAGED_MODEL
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
    VllmHandoff,
    WithoutHandoffFirst,
    WithoutKvMoves,
    WithoutKvPush,
    WithoutPrefixLookup,
)

from . import kv_relay
from .config import VllmEngineArgs, VllmKvTransfer, engine_env, to_engine_args
from .lora import LoraTable, adapter_path, check_adapter_dir
from .requests import NIXL_PREFILL_PARAMS, generate_kwargs, prompt, sampling_params, to_delta

log = logging.getLogger("splitserve.vllm")


class _Stats:
    """The latest scheduler stats vLLM reported (filled by the stat logger below)."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0


def _stat_logger_factory(stats: _Stats):
    """A vLLM stat-logger factory that keeps the latest scheduler stats in ``stats``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _Recorder(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
                   engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                stats.running = scheduler_stats.num_running_reqs
                stats.waiting = scheduler_stats.num_waiting_reqs
                stats.kv_usage = scheduler_stats.kv_cache_usage

        def log_engine_initialized(self) -> None:
            pass

    return _Recorder


Role = Literal["agg", "prefill", "decode"]

# How long vLLM's engine-core process may take to stop after SIGTERM before vLLM
# force-kills it.  vLLM's default of 5 s was too short for an engine with a NIXL
# connector on 2 busy cores (it stops its worker process and NIXL agent first).
STOP_TIMEOUT_S = 15.0
# What the replica keeps of the graph's shutdown deadline (Common.shutdown_timeout_s)
# after vLLM's engine stop, for the rest of its exit: the runtime's deregistration and
# the interpreter's teardown, which took over 4 s on 2 busy cores.
EXIT_MARGIN_S = 10.0


def stop_budget_s(shutdown_timeout_s: float) -> float:
    """vLLM's engine-stop budget inside a graph whose shutdown deadline is
    ``shutdown_timeout_s``: ``STOP_TIMEOUT_S`` at most, and ``EXIT_MARGIN_S`` left over
    for the replica's own exit, so a slow engine stop is cut by vLLM (which kills its
    engine process) rather than by the supervisor (which kills the replica, an unclean
    exit)."""
    return max(1.0, min(STOP_TIMEOUT_S, shutdown_timeout_s - EXIT_MARGIN_S))


class VllmEngine(WithoutPrefixLookup, WithoutHandoffFirst, WithoutKvPush, WithoutKvMoves):
    """One vLLM engine; implements ``splitserve.contracts.engine.Engine``, and tells when
    its engine process died (``reports_failure``); with ``engine_args.enable_lora`` it
    serves LoRA adapters loaded at run time (``serves_lora``).

    ``role`` "prefill" or "decode" (with ``kv_transfer``) makes it one half of a
    disaggregated pair over vLLM's NixlConnector; a decode engine also prefills locally
    whatever comes without a handoff.  "agg" serves whole requests.
    """

    info: EngineInfo

    def __init__(self, args: VllmEngineArgs, served_name: str, role: Role = "agg",
                 kv_transfer: VllmKvTransfer | None = None, *,
                 model: str = PACKAGED_MODEL,
                 stop_timeout_s: float = STOP_TIMEOUT_S) -> None:
        if (role == "agg") != (kv_transfer is None):
            raise ValueError(f"a {role} vLLM engine needs "
                             f"{'no' if role == 'agg' else 'a'} kv_transfer config")
        self.args = args
        self.served_name = served_name
        self.model = args.model or model  # Common.model unless the section names its own
        self.role = role
        self.kv_transfer = kv_transfer
        self.stop_timeout_s = stop_timeout_s
        self.info = EngineInfo(name="vllm", kv_block_size=args.block_size,
                               capabilities=EngineCapabilities(
                                   local_prefill=True, pushes_kv=False,
                                   handoff_before_prefill=False, prefix_lookup=False,
                                   moves_kv=False, reports_failure=True,
                                   serves_lora=args.enable_lora),
                               lower_tiers=args.lower_tiers())
        self.kv_endpoint = (f"tcp://127.0.0.1:{kv_relay.free_loopback_port()}"
                            if args.kv_events_enabled() else None)
        self._stats = _Stats()
        self._engine = None
        self._active: set[str] = set()
        self._accepting = True
        self.kv_total_blocks = 0
        self._lora = LoraTable()
        self._lora_lock = asyncio.Lock()

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Resolve the model directory and the CPU backend's environment, start vLLM."""
        from vllm.v1.engine.async_llm import AsyncLLM

        model_dir = str(await asyncio.to_thread(weights_dir, self.model))
        connector = None
        port = None
        if self.kv_transfer is not None:
            # Each engine gets its own handshake port and engine id: two engines on one
            # host must not share either.
            port = self.kv_transfer.side_channel_port or kv_relay.free_loopback_port()
            connector = self.kv_transfer.connector_config(
                self.role, f"{self.role}-{uuid.uuid4().hex[:12]}")
            # UCX's TCP transport listens on every interface unless limited; `dynamo
            # serve` sets it from Common.bind_host, any other start stays on loopback.
            os.environ.setdefault("UCX_NET_DEVICES", "lo")
        env = engine_env(self.args, self.kv_transfer, port)
        os.environ.update(env)
        log.info("starting vLLM (%s): model %s, %s, block size %d, env %s, connector %s",
                 self.role, model_dir, self.args.dtype, self.args.block_size, env, connector)
        eargs = to_engine_args(self.args, model_dir, self.served_name, self.kv_endpoint,
                               connector)
        factory = _stat_logger_factory(self._stats)
        self._engine = await asyncio.to_thread(AsyncLLM.from_engine_args, eargs,
                                               stat_loggers=[factory])
        cache = self._engine.vllm_config.cache_config
        self.kv_total_blocks = int(cache.num_gpu_blocks or 0)
        if cache.block_size != self.args.block_size:
            raise RuntimeError(f"vLLM chose block size {cache.block_size}, configured "
                               f"{self.args.block_size}")

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Refuse new work, wait up to ``drain_timeout_s`` for in-flight requests, abort
        what is left, then stop vLLM's engine process."""
        self._accepting = False
        await poll_until(lambda: not self._active, drain_timeout_s)
        if self._engine is None:
            return
        if self._active:
            try:
                await self._engine.abort(list(self._active))
            except Exception as exc:  # noqa: BLE001 - the engine is shut down next anyway
                log.warning("aborting %d requests at shutdown failed: %s", len(self._active),
                            exc)
        ctx = _zmq_context(self._engine)
        # vLLM's output handler reads the engine process's outputs; stopped while it
        # waits, it logs an EngineDeadError traceback at every orderly stop.  vLLM's own
        # server stops the engine on its event loop, where the handler cannot run before
        # vLLM cancels it; here the stop runs in a thread, so cancel the handler first.
        handler = getattr(self._engine, "output_handler", None)
        if isinstance(handler, asyncio.Task) and not handler.done():
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)
        await asyncio.to_thread(self._engine.shutdown, self.stop_timeout_s)
        self._engine = None
        if ctx is not None and not ctx.closed:
            # vLLM's client closes its sockets (on this loop: let that run first) but
            # leaves their context to the garbage collector, whose ResourceWarning then
            # surfaces wherever the collection happens to run.
            await asyncio.sleep(0)
            ctx.destroy(linger=0)

    # ---- requests -----------------------------------------------------------------------
    def validate(self, params: GenerateParams) -> None:
        """Refuse a request naming a LoRA adapter this engine has not loaded; the rest
        vLLM refuses itself."""
        if params.lora is not None and not self.args.enable_lora:
            raise ValueError(f"lora: this vLLM engine serves no LoRA adapter "
                             f"(engine_args.enable_lora is off), asked for {params.lora!r}")
        self._lora.check(params.lora)

    async def _stream(self, request_id: str, params: GenerateParams,
                      sp) -> AsyncIterator[TokenDelta]:
        if not self._accepting or self._engine is None:
            raise RuntimeError("engine is not accepting requests")
        if request_id in self._active:
            raise ValueError(f"request id {request_id!r} is already running")
        self._active.add(request_id)
        final: TokenDelta | None = None
        try:
            # The adapter counts as in use until vLLM's stream ends, which is right after
            # its finished output: a consumer that stops at the last delta without closing
            # this stream does not hold the adapter.
            with self._lora.using(params.lora) as lora:
                async for out in self._engine.generate(
                        self._input(params), sp, **generate_kwargs(request_id, params, lora)):
                    delta = to_delta(out, params.logprobs or 0, params.prompt_logprobs or 0)
                    if delta.finished:
                        final = delta
                    else:
                        yield delta
            if final is not None:
                yield final
        finally:
            self._active.discard(request_id)
            if final is None and self._engine is not None:
                # vLLM aborts on its own when its generator is closed; this covers a
                # consumer that stopped early without closing us promptly.
                try:
                    await self._engine.abort(request_id)
                except Exception as exc:  # noqa: BLE001 - finished or unknown: nothing to free
                    log.debug("abort of %s in vLLM failed: %s", request_id, exc)

    def _input(self, params: GenerateParams) -> Any:
        """vLLM's engine input for the request's token ids, made by the engine's own
        renderer (what vLLM's server hands ``generate``).  A raw prompt still works in
        this vLLM but is deprecated there and logged as such; an engine without a
        renderer (an older vLLM) takes the raw prompt."""
        renderer = getattr(self._engine, "renderer", None)
        if renderer is None or not hasattr(renderer, "render_cmpl"):
            return prompt(params)
        (engine_input,) = renderer.render_cmpl([prompt(params)],
                                               renderer.default_cmpl_tok_params)
        return engine_input

    def generate(self, request_id: str, params: GenerateParams) -> AsyncIterator[TokenDelta]:
        """Aggregated: the whole request on this engine, streamed as deltas."""
        return self._stream(request_id, params, sampling_params(params))

    async def prefill(self, request_id: str, params: GenerateParams,
                      destination: TorchBlocksHandoff | None = None) -> PrefillResult:
        """Prefill-for-job: one token with NixlConnector asked to keep the KV for a
        remote decode; the handoff is vLLM's returned ``kv_transfer_params``."""
        if self.role != "prefill":
            raise RuntimeError(f"prefill() needs a prefill vLLM engine, this is {self.role}")
        sp = sampling_params(params, max_tokens=1, kv_transfer_params=NIXL_PREFILL_PARAMS)
        t0 = time.monotonic()
        tokens: list[int] = []
        cached = 0
        last = None
        with self._lora.using(params.lora) as lora:
            async for out in self._engine.generate(self._input(params), sp,
                                                   **generate_kwargs(request_id, params, lora)):
                last = out
                tokens += list(out.outputs[0].token_ids) if out.outputs else []
                cached = to_delta(out).cached_tokens
        params_out = getattr(last, "kv_transfer_params", None) if last is not None else None
        if not tokens or params_out is None:
            raise RuntimeError(f"vLLM prefill of {request_id!r} returned no "
                               f"{'token' if not tokens else 'kv_transfer_params'}")
        return PrefillResult(first_token=tokens[0],
                             handoff=VllmHandoff(kv_transfer_params=dict(params_out)),
                             cached_tokens=cached, compute_s=time.monotonic() - t0)

    def decode(self, request_id: str, params: GenerateParams, handoff: EngineHandoff,
               first_token: int | None = None) -> AsyncIterator[TokenDelta]:
        """Decode-with-handoff: vLLM's decode engine pulls the prompt's KV named in the
        handoff and streams every token, the prefill's first token included (vLLM
        samples it again from the pulled KV, so ``first_token`` is not needed)."""
        if self.role != "decode":
            raise RuntimeError(f"decode() needs a decode vLLM engine, this is {self.role}")
        if not isinstance(handoff, VllmHandoff):
            raise TypeError(f"a vLLM decode engine needs a vllm handoff, got {handoff.kind}")
        return self._stream(request_id, params, sampling_params(
            params, kv_transfer_params=handoff.kv_transfer_params))

    async def abort(self, request_id: str) -> None:
        """Abort one request (unknown ids are ignored by vLLM)."""
        if self._engine is not None:
            await self._engine.abort(request_id)

    # ---- LoRA adapters (capabilities.serves_lora) ---------------------------------------
    async def load_lora(self, name: str, path: str) -> None:
        """Load the PEFT adapter directory ``path`` under ``name`` (vLLM's ``add_lora``):
        checked here with vLLM's own ``PEFTHelper`` first (files, rank), then in the
        engine process (the modules it targets).  Never full: beyond ``max_cpu_loras``
        vLLM evicts the least recently used adapter and reloads it from its path when a
        request names it again.  The same name and path again is a no-op."""
        if not self.args.enable_lora:
            raise ValueError(f"engine_args.enable_lora is off: this vLLM engine cannot load "
                             f"LoRA adapter {name!r}")
        if not name:
            raise ValueError("a LoRA adapter needs a non-empty name")
        path = adapter_path(path)
        async with self._lora_lock:
            loaded = self._lora.path_of(name)
            if loaded == path:
                return
            if loaded is not None:
                raise ValueError(f"LoRA adapter {name!r} is loaded from {loaded}; unload it "
                                 f"before loading {path} under that name")
            if self._engine is None:
                raise RuntimeError("the vLLM engine is not running")
            await asyncio.to_thread(check_adapter_dir, path,
                                    self._engine.vllm_config.lora_config)
            await self._add_lora(name, path)
            self._lora.add(name, path)

    async def _add_lora(self, name: str, path: str) -> None:
        """vLLM's ``add_lora``; what its engine process refuses comes back as a plain
        ``Exception`` with vLLM's message, raised here as ValueError naming the adapter
        (a dead engine's error is raised as is)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            added = await self._engine.add_lora(self._lora.build(name, path))
        except EngineDeadError:
            raise
        except Exception as exc:  # noqa: BLE001 - vLLM's utility failures are plain Exceptions
            raise ValueError(f"LoRA adapter {name!r} at {path}: {exc}") from None
        if not added:
            raise RuntimeError(f"vLLM did not add LoRA adapter {name!r} "
                               f"(id {self._lora.id_of(name)} already registered)")

    async def unload_lora(self, name: str) -> None:
        """Forget adapter ``name`` and free it in vLLM (``remove_lora``); KeyError when it
        is not loaded, ValueError while requests that use it are in flight."""
        async with self._lora_lock:
            path = self._lora.remove(name)  # from here no new request can name it
            if self._engine is None:
                return
            try:
                await self._engine.remove_lora(self._lora.id_of(name))
            except BaseException:
                self._lora.add(name, path)
                raise

    def loras(self) -> dict[str, str]:
        """The adapters loaded now: name -> the directory each was loaded from."""
        return self._lora.paths()

    # ---- sources ------------------------------------------------------------------------
    async def run_kv_events(self, sink: KvEventSink,
                            ready: asyncio.Event | None = None) -> None:
        """Relay vLLM's ZMQ KV events to ``sink`` until cancelled (none when disabled).

        Start it before ``start()`` and wait for ``ready``: the relay's socket is the
        listening side and vLLM's publisher connects to it."""
        if self.kv_endpoint is None:
            if ready is not None:
                ready.set()
            return
        await kv_relay.relay(self.kv_endpoint, self.args.block_size, sink, ready)

    def unfinished(self) -> int:
        """Requests vLLM itself still tracks (an aborted request leaves at once)."""
        if self._engine is None:
            return 0
        return self._engine.output_processor.get_num_unfinished_requests()

    def load(self) -> LoadSample:
        """Load from vLLM's latest scheduler stats; active counts what vLLM still holds."""
        total = self.kv_total_blocks
        held = self.unfinished()
        waiting = min(self._stats.waiting, held)
        return LoadSample(active=held - waiting, waiting=waiting,
                          kv_used_blocks=round(self._stats.kv_usage * total),
                          kv_total_blocks=total)

    def inflight(self) -> int:
        return len(self._active)

    def failure(self) -> BaseException | None:
        """The error that killed vLLM's engine process, or None while it is healthy."""
        if self._engine is None or not self._engine.errored:
            return None
        return self._engine.dead_error


def make_engine(ctx, cfg, role: Role) -> VllmEngine:
    """The registry's factory: the section's engine for ``role``, not started.  Only an
    aggregated or decode engine relays KV events; a prefill engine's would go nowhere."""
    common = ctx.run.common
    stop_s = stop_budget_s(common.shutdown_timeout_s)
    if role == "agg":
        return VllmEngine(cfg.engine_args, common.served_model_name, model=common.model,
                          stop_timeout_s=stop_s)
    args = (cfg.engine_args if role == "decode"
            else cfg.engine_args.model_copy(update={"kv_events": False}))
    return VllmEngine(args, common.served_model_name, role, kv_transfer=cfg.kv_transfer,
                      model=common.model, stop_timeout_s=stop_s)


def _zmq_context(engine: Any) -> Any:
    """The ZMQ context of vLLM's engine client (``MPClient.resources.ctx``), or None."""
    resources = getattr(getattr(engine, "engine_core", None), "resources", None)
    return getattr(resources, "ctx", None)
