"""SGLang (``sglang.Engine``, in process) behind the project's engine interface.

One object per SGLang engine and role: ``agg`` serves whole requests, ``prefill`` runs
prefill-for-job with ``max_new_tokens: 1`` under a bootstrap room, ``decode`` continues
requests from a bootstrap handoff.  SGLang moves the KV itself (NIXL or Mooncake).

The handoff of SGLang exists *before* the prefill runs (the prefill engine's bootstrap
host/port and a fresh room), and the prefill engine waits for the decode engine to join
the room before it computes.  So the prefill worker must hand the decode worker
``begin_prefill(...).handoff`` first and await ``.result`` after: awaiting
``prefill()`` first would wait for a decode engine that was never told the room.
``info.capabilities.handoff_before_prefill`` says so to the prefill loop.

One engine per process (``process.claim_process``); the worker's SIGTERM handler is kept
when SGLang tries to install its own (``process.keep_worker_signal_handlers``).  A
prefill engine's bootstrap server binds ``host`` on ``bootstrap_port + replica`` and the
handoff names ``advertise_host``, the address decode engines reach it at.  The KV
managers of both roles bind and advertise ``advertise_host`` (``engine_env``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from splitserve.contracts.engine import (
    EngineCapabilities,
    EngineHandoff,
    EngineInfo,
    GenerateParams,
    KvEventSink,
    LoadSample,
    PrefillResult,
    PrefillTicket,
    SglangBootstrapHandoff,
    TokenDelta,
    TorchBlocksHandoff,
    WithoutFailureReport,
    WithoutKvMoves,
    WithoutKvPush,
    WithoutPrefixLookup,
)
from splitserve.contracts.wire import FinishReason
from splitserve.contracts.kit.model_dir import weights_dir

from . import kv_relay, process
from .config import Role, SglangEngineArgs, decode_radix_cache, server_args_kwargs
from .lora import LoraTable, adapter_path, check_adapter_dir
from .metrics import LoadTracker
from .requests import (
    LogprobReader,
    SglangPriority,
    finish_message,
    generate_kwargs,
    new_bootstrap_room,
    sglang_rid,
    to_delta,
    warmup_kwargs,
)

log = logging.getLogger("splitserve.sglang")


class NoLocalPrefill(RuntimeError):
    """A decode-mode SGLang engine was asked to prefill (it refuses without a room)."""


def default_factory(**kwargs: Any):
    """Start a real ``sglang.Engine`` (GPU machines; blocks until loaded); refuses a
    second live engine in this process."""
    import sglang

    process.claim_process(f"SGLang {kwargs.get('disaggregation_mode', 'null')} engine")
    try:
        with process.sglang_logging_config():
            return sglang.Engine(**kwargs)
    except BaseException:
        process.release_process()
        raise


class SeedNeedsDeterminism(ValueError):
    """A request asked for a seed this engine would silently ignore."""


class SchemaNeedsGrammar(ValueError):
    """A request carried a JSON schema and this engine runs without a grammar backend."""


class SglangEngine(WithoutFailureReport, WithoutPrefixLookup, WithoutKvPush, WithoutKvMoves):
    """One SGLang engine; implements ``splitserve.contracts.engine.Engine``.  A prefill
    engine's handoff exists before its prefill runs (``handoff_before_prefill``: the
    prefill loop calls ``begin_prefill``); a decode engine cannot prefill locally.  With
    ``engine_args.enable_lora`` it serves LoRA adapters (``serves_lora``): those of
    ``lora_paths`` from the start, others loaded at run time.

    ``factory`` builds the engine from ServerArgs keywords (tests pass a double).
    """

    info: EngineInfo

    def __init__(self, args: SglangEngineArgs, served_name: str, role: Role = "agg", *,
                 host: str = "127.0.0.1", advertise_host: str | None = None, replica: int = 0,
                 factory: Callable[..., Any] = default_factory,
                 decode_margin_s: float = 30.0) -> None:
        self.args, self.served_name, self.role, self.host = args, served_name, role, host
        self.advertise_host = advertise_host or host
        self.bootstrap_port = args.bootstrap_port + replica
        self._factory = factory
        self._decode_margin_s = decode_margin_s
        self.info = EngineInfo(
            name="sglang", kv_block_size=args.page_size,
            capabilities=EngineCapabilities(
                local_prefill=role != "decode", pushes_kv=False,
                handoff_before_prefill=role == "prefill", prefix_lookup=False,
                moves_kv=False, reports_failure=False, serves_lora=args.enable_lora),
            lower_tiers=args.lower_tiers())
        # Only engines whose radix cache runs publish KV events: a prefill engine's would
        # reach no router, and SGLang turns a decode engine's radix cache off in PD mode
        # unless asked (config.decode_radix_cache).
        publishes = args.kv_events_enabled() and (
            role == "agg" or (role == "decode" and decode_radix_cache(args)))
        self.kv_endpoint = (f"tcp://127.0.0.1:{kv_relay.free_loopback_port()}"
                            if publishes else None)
        self._engine = None
        self._active: set[str] = set()
        self._accepting = True
        self._prefills: set[asyncio.Task] = set()
        self.tracker = LoadTracker(args.page_size)
        self.priority = SglangPriority.of(args.extra_server_args)
        self._lora = LoraTable({name: adapter_path(path) for name, path
                                in (args.lora_paths or {}).items()} if args.enable_lora else None)
        self._lora_lock = asyncio.Lock()

    # ---- lifecycle ----------------------------------------------------------------------
    def server_kwargs(self) -> dict[str, Any]:
        """The ServerArgs keywords this engine starts with."""
        return server_args_kwargs(self.args, self.role, self.served_name, self.kv_endpoint,
                                  self.host, bootstrap_port=self.bootstrap_port)

    def engine_env(self) -> dict[str, str]:
        """Environment SGLang reads in its scheduler processes (disaggregated roles): its
        bootstrap and waiting timeouts, and ``SGLANG_HOST_IP`` = ``advertise_host``.

        SGLang's KV manager takes one address from that variable
        (``get_local_ip_auto``) and uses it twice: it binds its ZMQ socket there, and it
        names it to its peers (a prefill engine registers it as ``rank_ip`` with its
        bootstrap server; a decode engine sends it in its bootstrap message, and the
        prefill engine connects back to it).  Dynamo's SGLang worker advertises the
        same variable as the bootstrap host.  So it must be the address peers reach,
        not the bind host (a wildcard would be handed out as is); and since it is also
        bound, it must be an address of this machine: an advertise address only a NAT
        or proxy owns makes SGLang's KV manager fail to start, and the socket listens on
        that one address only.  Unset, SGLang picks the machine's routable address even
        on a loopback-only graph."""
        if self.role == "agg":
            return {}
        return {**process.disagg_timeout_env(self.args.bootstrap_timeout_s,
                                             self.args.waiting_timeout_s),
                process.KV_HOST_VARIABLE: self.advertise_host}

    async def start(self) -> None:
        """Start SGLang; returns when it serves.  Called on the worker's event loop,
        after the worker registered its signal handlers."""
        kw = self.server_kwargs()
        process.keep_worker_signal_handlers(asyncio.get_running_loop())
        if self._factory is default_factory:
            if self.role != "agg":
                process.check_kv_host(self.advertise_host)
            os.environ.update(self.engine_env())  # read by SGLang's scheduler processes
        log.info("starting SGLang (%s): %s", self.role, kw)
        with process.keep_worker_logging():
            self._engine = self._factory(**kw)
        self.tracker.start(self._engine)
        if self.role == "prefill":
            await self._warm_up(int(kw.get("dp_size") or 1))

    async def _warm_up(self, dp_size: int) -> None:
        """Run one request through every data-parallel rank's disaggregated path before
        the worker registers, so the first real prefill does not pay JIT and CUDA-graph
        capture inside SGLang's bootstrap timeouts (as Dynamo's worker does).  A failure
        fails the start: an engine that cannot prefill must not register."""

        async def one(rank: int) -> None:
            gen = await self._engine.async_generate(**warmup_kwargs(rank, self.bootstrap_port))
            async for _ in gen:
                pass

        t0 = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*(one(r) for r in range(dp_size))),
                               self.args.warmup_timeout_s)
        log.info("SGLang prefill engine warmed up (%d rank(s), %.1fs)", dp_size,
                 time.monotonic() - t0)

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Refuse new work, wait up to ``drain_timeout_s`` for in-flight requests, abort
        what is left, then stop SGLang."""
        self._accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while self.inflight() and time.monotonic() < deadline:  # noqa: ASYNC110 - a count
            await asyncio.sleep(0.05)
        for rid in list(self._active):
            await self.abort(rid)
        for t in list(self._prefills):
            t.cancel()
        await self.tracker.stop()
        if self._engine is not None:
            engine, self._engine = self._engine, None
            await asyncio.to_thread(engine.shutdown)
            if self._factory is default_factory:
                process.release_process()

    # ---- requests -----------------------------------------------------------------------
    def _admit(self, request_id: str) -> None:
        if not self._accepting or self._engine is None:
            raise RuntimeError("engine is not accepting requests")
        if request_id in self._active:
            raise ValueError(f"request id {request_id!r} is already running")
        self._active.add(request_id)

    def _check(self, params: GenerateParams) -> None:
        if params.seed is not None and not self.args.deterministic_inference:
            raise SeedNeedsDeterminism(
                "seed: SGLang ignores a request's sampling_seed unless the engine runs "
                "with deterministic inference (engine_args.deterministic_inference: true)")
        if params.json_schema is not None and not self.args.structured_output:
            raise SchemaNeedsGrammar(
                "response_format: this SGLang engine runs without its tokenizer, so without "
                "a grammar backend (engine_args.structured_output: true enables it)")
        if params.lora is not None and not self.args.enable_lora:
            raise ValueError(f"lora: this SGLang engine serves no LoRA adapter "
                             f"(engine_args.enable_lora is off), asked for {params.lora!r}")
        self._lora.check(params.lora)

    def validate(self, params: GenerateParams) -> None:
        """Refuse a request this engine would not honour (called before queueing)."""
        self._check(params)

    async def _stream(self, request_id: str, kw: dict[str, Any],
                      logprobs: LogprobReader | None = None,
                      first_token_timeout_s: float | None = None) -> AsyncIterator[TokenDelta]:
        self._admit(request_id)
        final: TokenDelta | None = None
        try:
            # the adapter is in use until the last output, not until this stream closes
            with self._lora.using(kw.get("lora_path")):
                it = await self._outputs(request_id, kw, first_token_timeout_s)
                async for out in it:
                    delta = to_delta(out, logprobs)
                    if delta.finished:
                        final = delta
                        break
                    yield delta
            if final is not None:
                yield final
        finally:
            self._active.discard(request_id)
            if final is None:
                await self.abort(request_id)

    async def _outputs(self, request_id: str, kw: dict[str, Any],
                       first_token_timeout_s: float | None) -> AsyncIterator[Any]:
        """SGLang's output stream for one request; with ``first_token_timeout_s``, its
        first output must come within that time."""
        it = (await self._engine.async_generate(**kw)).__aiter__()
        if first_token_timeout_s is None:
            return it
        try:
            first = await asyncio.wait_for(it.__anext__(), first_token_timeout_s)
        except TimeoutError:
            raise RuntimeError(
                f"SGLang decode of {request_id!r}: no token {first_token_timeout_s:.0f} "
                "s after the handoff (its KV never arrived)") from None
        return _prepend(first, it)

    def generate(self, request_id: str, params: GenerateParams) -> AsyncIterator[TokenDelta]:
        """Aggregated: the whole request here.  A decode engine refuses (NoLocalPrefill):
        SGLang's decode mode cannot prefill."""
        if self.role == "decode":
            raise NoLocalPrefill("an SGLang decode engine cannot prefill locally; "
                                 "prefill remotely")
        if self.role != "agg":
            raise RuntimeError(f"a {self.role} SGLang engine does not serve whole requests")
        self._check(params)
        return self._stream(request_id, generate_kwargs(request_id, params,
                                                        priority=self.priority),
                            LogprobReader.for_params(params))

    async def begin_prefill(self, request_id: str, params: GenerateParams) -> PrefillTicket:
        """Submit a prefill under a fresh bootstrap room; returns at once with the
        handoff (publish it to the decode worker) and the task that finishes the job."""
        if self.role != "prefill":
            raise RuntimeError(f"prefill() needs a prefill SGLang engine, this is {self.role}")
        self._check(params)
        handoff = SglangBootstrapHandoff(bootstrap_host=self.advertise_host,
                                         bootstrap_port=self.bootstrap_port,
                                         bootstrap_room=new_bootstrap_room())
        self._admit(request_id)
        self._lora.acquire(params.lora)  # checked above: nothing awaited since
        t0 = time.monotonic()
        try:
            gen = await self._engine.async_generate(**generate_kwargs(
                request_id, params, max_new_tokens=1, handoff=handoff,
                priority=self.priority))
        except BaseException:
            self._active.discard(request_id)
            self._lora.release(params.lora)
            raise
        task = asyncio.ensure_future(self._finish_prefill(request_id, gen, handoff, t0,
                                                          params.lora))
        self._prefills.add(task)
        task.add_done_callback(self._prefills.discard)
        return PrefillTicket(handoff, task)

    async def _finish_prefill(self, request_id: str, gen, handoff, t0: float,
                              lora: str | None = None) -> PrefillResult:
        tokens: list[int] = []
        last = None
        finished = False
        try:
            async for out in gen:
                last = to_delta(out)
                tokens += last.token_ids
                if last.finished:
                    finished = True
                    if last.finish_reason in (FinishReason.CANCELLED, FinishReason.ERROR):
                        raise RuntimeError(f"SGLang prefill of {request_id!r} ended with "
                                           f"{last.finish_reason}: {finish_message(out)}")
                    break
        finally:
            self._active.discard(request_id)
            self._lora.release(lora)
            if not finished:
                await self.abort(request_id)
        if not tokens:
            raise RuntimeError(f"SGLang prefill of {request_id!r} returned no token")
        return PrefillResult(first_token=tokens[0], handoff=handoff,
                             cached_tokens=last.cached_tokens if last else 0,
                             compute_s=time.monotonic() - t0)

    async def prefill(self, request_id: str, params: GenerateParams,
                      destination: TorchBlocksHandoff | None = None) -> PrefillResult:
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
        self._check(params)
        # The first token is sampled by the prefill engine, from a job that carries no
        # schema and asks for no log-probability: refuse rather than stream an
        # unconstrained first token or a made-up value for it.
        if params.logprobs is not None or params.prompt_logprobs is not None:
            raise ValueError("logprobs: an SGLang decode engine cannot return them for "
                             "a remotely prefilled request")
        if params.json_schema is not None:
            raise ValueError("response_format: an SGLang decode engine cannot enforce it "
                             "on a remotely prefilled request's first token")
        # SGLang's own decode receiver gives up after its waiting timeout; this bound
        # catches a request SGLang never ends (the prefill engine gone mid-transfer).
        return self._stream(request_id, generate_kwargs(request_id, params, handoff=handoff,
                                                        priority=self.priority),
                            LogprobReader.for_params(params), first_token_timeout_s=self.args.waiting_timeout_s
                            + self._decode_margin_s)

    async def abort(self, request_id: str) -> None:
        """Abort one request in SGLang (unknown or finished ids are ignored by SGLang)."""
        if self._engine is not None:
            try:
                self._engine.tokenizer_manager.abort_request(rid=sglang_rid(request_id),
                                                             abort_all=False)
            except Exception as exc:  # noqa: BLE001 - finished or unknown: nothing to free
                log.debug("abort of %s in SGLang failed: %s", request_id, exc)

    # ---- LoRA adapters (capabilities.serves_lora) ---------------------------------------
    async def load_lora(self, name: str, path: str) -> None:
        """Load the PEFT adapter directory ``path`` under ``name`` (SGLang's
        ``async_load_lora_adapter``); SGLang checks it against its adapter memory pool
        (rank, target modules) and its refusal is raised as ValueError.  The same name
        and path again is a no-op."""
        if not self.args.enable_lora:
            raise ValueError(f"engine_args.enable_lora is off: this SGLang engine cannot "
                             f"load LoRA adapter {name!r}")
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
                raise RuntimeError("the SGLang engine is not running")
            check_adapter_dir(path)
            result = await self._engine.async_load_lora_adapter(lora_name=name, lora_path=path)
            if not result.success:
                raise ValueError(f"LoRA adapter {name!r} at {path}: SGLang refused it: "
                                 f"{result.error_message}")
            self._lora.add(name, path)

    async def unload_lora(self, name: str) -> None:
        """Forget adapter ``name`` and free it in SGLang (``async_unload_lora_adapter``);
        KeyError when it is not loaded, ValueError while requests that use it are in
        flight (SGLang itself would wait for them)."""
        async with self._lora_lock:
            path = self._lora.remove(name)  # from here no new request can name it
            if self._engine is None:
                return
            try:
                result = await self._engine.async_unload_lora_adapter(lora_name=name)
            except BaseException:
                self._lora.add(name, path)
                raise
            if not result.success:
                self._lora.add(name, path)
                raise RuntimeError(f"SGLang could not unload LoRA adapter {name!r}: "
                                   f"{result.error_message}")

    def loras(self) -> dict[str, str]:
        """The adapters loaded now (those of ``lora_paths`` included): name -> path."""
        return self._lora.paths()

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
        return self.tracker.sample(self.inflight())

    def inflight(self) -> int:
        return len(self._active)


async def _prepend(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item


def make_engine(ctx, cfg, role: Role) -> SglangEngine:
    """The registry's factory: the section's engine for ``role``, not started (bootstrap
    ports are unique per replica; the routable host is advertised apart from the bind
    address).  SGLang gets the model's directory: the section's own model, else
    Common.model (a hub id becomes its cached snapshot: nothing is downloaded)."""
    common = ctx.run.common
    args = cfg.engine_args
    path = weights_dir(args.model_path or common.model)
    return SglangEngine(args.model_copy(update={"model_path": str(path)}),
                        common.served_model_name, role, host=common.bind_host,
                        advertise_host=common.advertised_host(), replica=ctx.run.replica)
