"""The one engine interface every worker drives: torch, mocker, vLLM, SGLang, TensorRT-LLM.

A worker process (aggregated, decode or prefill) is the same thin shell around any
engine; what differs per engine is how a prompt's KV gets from a prefill engine to a
decode engine.  That difference is one typed *handoff*, carried by the prefill job:

- torch: the decode worker's destination block ids (the prefill worker writes KV there
  over NIXL itself);
- vLLM: the ``kv_transfer_params`` the prefill engine returns (its NixlConnector pulls);
- SGLang: the bootstrap host/port/room triple both engines are given;
- TensorRT-LLM and Dynamo's mocker: the context phase's opaque ``disaggregated_params``.

What each engine can do beyond the common members is declared, not probed: its
``info.capabilities`` (``EngineCapabilities``) says which optional members work, and
``EngineRequestParams`` (declared in each engine's folder, listed by the registry) says
which OpenAI request parameters it honours.

Everything here is plain data plus the protocol (and the ``Without...`` classes an engine
lists for the abilities it lacks); no engine library is imported.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol, get_args, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from splitserve.contracts.block_events import LOWER_TIERS, KvEvent, Tier
from splitserve.contracts.priority import DEFAULT_LEVEL
from splitserve.contracts.wire import FinishReason, TokenLogprobs

HANDOFF_VERSION = 1


class _Handoff(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    version: Literal[1] = Field(default=1, description="Wire format version.")


class TorchBlocksHandoff(_Handoff):
    """torch: the decode worker reserved these blocks; the prefill worker writes into them."""

    kind: Literal["torch-blocks"] = "torch-blocks"
    nixl_agent: str = Field(min_length=1, description="Decode worker's NIXL agent name.")
    block_ids: list[int] = Field(min_length=1, description="Destination block ids, in order.")
    block_size: int = Field(ge=1, description="Tokens per block on the decode worker.")
    num_cached_tokens: int = Field(0, ge=0, description="Leading tokens already held there.")


class VllmHandoff(_Handoff):
    """vLLM: the prefill engine's ``kv_transfer_params`` (NixlConnector: engine id, remote
    block ids, host, port), given unchanged to the decode engine, which pulls the KV."""

    kind: Literal["vllm"] = "vllm"
    kv_transfer_params: dict[str, Any] = Field(description="As returned by the prefill "
                                               "engine's final output.")


class SglangBootstrapHandoff(_Handoff):
    """SGLang: both engines are given the same bootstrap triple; the decode engine pulls."""

    kind: Literal["sglang-bootstrap"] = "sglang-bootstrap"
    bootstrap_host: str = Field(min_length=1)
    bootstrap_port: int = Field(ge=1, le=65535)
    bootstrap_room: int = Field(ge=0)


class OpaqueHandoff(_Handoff):
    """TensorRT-LLM and Dynamo's mocker: the context phase's opaque state, passed back."""

    kind: Literal["opaque"] = "opaque"
    disaggregated_params: Any = Field(default=None, description="Engine-defined state.")


EngineHandoff = Annotated[
    TorchBlocksHandoff | VllmHandoff | SglangBootstrapHandoff | OpaqueHandoff,
    Field(discriminator="kind"),
]


@dataclass(frozen=True)
class GenerateParams:
    """One request as an engine sees it (mapped from the wire's WorkerRequest by
    ``components/worker/wire.py``)."""

    token_ids: tuple[int, ...]
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end generation (the model's EOS ids and any the client asked for)."""
    ignore_eos: bool = False
    min_tokens: int = 0
    """Tokens to produce before a stop token may end the request."""
    priority: int = DEFAULT_LEVEL
    """The request's priority level (``contracts/priority.py``): 0 is the most important
    class; each engine maps it to its scheduler's own convention."""
    top_k: int = 0
    """Sample among the k most likely tokens only (0: no limit)."""
    min_p: float = 0.0
    """Drop tokens less likely than ``min_p`` times the most likely one (0: off)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated (OpenAI's)."""
    frequency_penalty: float = 0.0
    """Subtracted once per earlier occurrence in the generated tokens (OpenAI's)."""
    repetition_penalty: float = 1.0
    """Divides positive / multiplies negative logits of tokens in the prompt or output
    (CTRL's; 1: off)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits."""
    logprobs: int | None = None
    """Return the sampled tokens' log-probabilities and this many alternatives each."""
    prompt_logprobs: int | None = None
    """Return the prompt tokens' log-probabilities and this many alternatives each."""
    json_schema: str | None = None
    """Structured output: the answer must be JSON valid against this schema (JSON text)."""
    lora: str | None = None
    """The LoRA adapter to apply, by the name it was loaded under (``load_lora``); None:
    the base model.  Only with ``capabilities.serves_lora``; ``validate`` refuses a name
    that is not loaded."""

    def neutral_sampling(self) -> bool:
        """True when no penalty, bias, top-k, min-p or schema changes the model's
        distribution."""
        return (self.top_k <= 0 and self.min_p <= 0 and self.presence_penalty == 0
                and self.frequency_penalty == 0 and self.repetition_penalty == 1.0
                and not self.logit_bias and self.json_schema is None)


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one request since the last delta; the last one has ``finished``."""

    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: FinishReason | None = None
    """Set on the last delta, in the one vocabulary (each engine maps its own reasons
    into it in its folder); None there means ``EOS``."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    logprobs: TokenLogprobs | None = None
    """One entry per token of ``token_ids`` when the request asked for log-probabilities."""
    prompt_logprobs: TokenLogprobs | None = None
    """On the first delta of a request that asked for prompt log-probabilities."""


@dataclass(frozen=True)
class PrefillResult:
    """What a prefill engine hands back for one job."""

    first_token: int
    handoff: EngineHandoff | None
    """None only with ``finished``: nothing is left to hand over."""
    cached_tokens: int = 0
    compute_s: float = 0.0
    transfer_s: float = 0.0
    """Time the prefill side spent moving KV itself (torch's NIXL write, the mocker's
    simulated transfer); 0 where the decode engine pulls."""
    transfer_bytes: int = 0
    finished: FinishReason | None = None
    """Set when the request ended at its first token (it is EOS or a stop token, which
    an engine like TensorRT-LLM then hands no KV for): the decode worker answers that
    token with this reason instead of decoding."""


@dataclass(frozen=True)
class LoadSample:
    """An engine's own view of its load, published to routers as WorkerLoad."""

    active: int
    waiting: int
    kv_used_blocks: int
    kv_total_blocks: int


class AbilityAbsent(NotImplementedError):
    """An optional ability was called on an engine whose capabilities say it lacks it
    (a shell that reads the flags never does this)."""


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do beyond what every engine does, declared by the engine (its
    ``info.capabilities``) and read by the shells, which never probe the object.

    Each flag gates members of ``Engine``: an engine whose flag is false still has them
    (each raises ``AbilityAbsent``, through the ``Without...`` classes below), so every
    engine has every member and a missing one is a test failure, not a silent default.
    """

    local_prefill: bool
    """It can prefill where it decodes.  False for an SGLang decode-mode engine (and a
    TensorRT-LLM prefill engine): the decode coordinator then turns "local" verdicts
    into remote ones."""
    pushes_kv: bool
    """Its prefill side writes KV into blocks the decode side reserved first (torch):
    ``reserve_remote`` / ``release_remote`` work on the decode side, and the prefill
    loop gives ``prefill`` the job's ``destination``."""
    handoff_before_prefill: bool
    """Its handoff exists before the prefill runs (SGLang's bootstrap room): the prefill
    loop calls ``begin_prefill``, sends the handoff at once and awaits the result after,
    instead of awaiting ``prefill``."""
    prefix_lookup: bool
    """``cached_prefix_tokens`` tells the prompt tokens its prefix cache holds (torch);
    without it the offload decider sees no prefix hit."""
    moves_kv: bool
    """Live KV moves (torch with a NIXL agent and ``kv_moves``): a drained request is
    ``park``ed with its KV, ``export_parked`` writes it to the replica that continues
    it, whose ``resume_moved`` decodes on from it; ``parked`` counts what waits."""
    reports_failure: bool
    """``failure()`` tells when the engine died on its own (vLLM's engine process,
    TensorRT-LLM's executor); the in-process host polls it and ends the replica."""
    serves_lora: bool = False
    """LoRA adapters loaded and unloaded at run time (``load_lora`` / ``unload_lora`` /
    ``loras``), applied per request (``GenerateParams.lora``), with prefix-cache hashes
    keyed by adapter (``block_events.hash_block``'s ``lora_name``)."""
    local_prefill_own_batch: bool = False
    """A local prefill runs in a batch of its own, apart from the answers prefilled
    remotely (the mocker's decode replica fronts a separate engine for local prefills):
    it stalls only the answers prefilled here.  False: one batch, every answer."""
    kv_move_timeout_s: float = 10.0
    """With ``moves_kv``: how long a continuing replica waits for the parked replica to
    write a request's KV before it recomputes instead."""


@dataclass
class EngineInfo:
    """Static facts a worker needs before serving (block size for the router, etc.)."""

    name: str
    kv_block_size: int
    capabilities: EngineCapabilities
    lower_tiers: dict[Tier, int | None] = field(default_factory=dict)
    """The KV tiers the engine keeps below its pool (``host``, ``disk``) and each one's
    capacity in blocks (None: the engine does not tell).  Their events reach the routers
    on the tier subject (``kit/tier_events.py``); empty: the pool only."""

    def __post_init__(self) -> None:
        if not isinstance(self.capabilities, EngineCapabilities):
            raise TypeError(f"{self.name} engine: capabilities must be EngineCapabilities, "
                            f"got {type(self.capabilities).__name__}")
        wrong = sorted(set(self.lower_tiers) - set(LOWER_TIERS))
        if wrong:
            raise ValueError(f"{self.name} engine: lower_tiers {wrong} are not tiers below "
                             f"the pool ({', '.join(LOWER_TIERS)})")


EngineParam = Literal[
    "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "top_k",
    "min_p", "min_tokens", "logit_bias", "logprobs", "top_logprobs", "response_format",
    "tool_choice",
]
"""The OpenAI request parameters the engine applies (the frontend serves the others
itself, e.g. ``n`` and ``stop``, or refuses them for every engine)."""
ENGINE_PARAMS: tuple[str, ...] = get_args(EngineParam)


class EngineRequestParams(BaseModel):
    """The OpenAI request parameters one engine honours.

    Each engine's folder declares its own (``REQUEST_PARAMS`` in
    ``components/engines/<name>/capabilities.py``) and the engine registry names it; the
    supervisor hands the graph's engines' declarations to the frontend in its run
    config, and the frontend refuses a parameter that one of them does not honour,
    naming both.  ``notes``: what the API docs' table says of this engine for a
    parameter (keyed by any parameter of that table)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    honoured: frozenset[EngineParam] = Field(
        default=frozenset(), description="Parameters this engine applies when sent.")
    notes: dict[str, str] = Field(default_factory=dict,
                                  description="Parameter -> what the docs' table says.")

    def honours(self, param: str) -> bool:
        return param in self.honoured


KvEventSink = Callable[[list[KvEvent]], None]


@dataclass
class PrefillTicket:
    """A prefill begun by ``begin_prefill``: the handoff to give the decode worker now,
    and the task that ends with the ``PrefillResult`` once the KV has left the engine."""

    handoff: EngineHandoff
    result: asyncio.Future[PrefillResult]


class KvWriteReport(Protocol):
    """What ``export_parked`` reports of the write it made."""

    path: str
    nbytes: int
    seconds: float


@runtime_checkable
class Engine(Protocol):
    """What the aggregated worker, the decode coordinator, the prefill loop and the
    hosting kit call: every engine has every member.  Those behind a flag of
    ``info.capabilities`` are called only when the flag is set (an engine without the
    ability raises ``AbilityAbsent`` there).

    Cancellation: closing an iterator returned by ``generate``, ``decode`` or
    ``resume_moved`` before its last delta (client gone) aborts the request in the
    engine; ``abort`` does the same by id.  Every method runs on the worker's event loop.
    """

    info: EngineInfo

    # ---- every engine -------------------------------------------------------------------
    async def start(self) -> None:
        """Load the model and start the engine; returns when it can serve."""

    def validate(self, params: GenerateParams) -> None:
        """Refuse a request this engine would not honour (raise ``ValueError`` naming the
        reason) before anything is queued; an engine with nothing to check returns."""

    def generate(self, request_id: str, params: GenerateParams) -> AsyncIterator[TokenDelta]:
        """Aggregated: prefill here and stream every generated token."""

    async def prefill(self, request_id: str, params: GenerateParams,
                      destination: TorchBlocksHandoff | None = None) -> PrefillResult:
        """Prefill-for-job: compute the prompt's KV, sample the first token, and return the
        handoff the decode engine needs to take the KV over.  ``destination``: the job's
        reserved blocks, given (and required) only with ``capabilities.pushes_kv``."""

    def decode(self, request_id: str, params: GenerateParams, handoff: EngineHandoff,
               first_token: int | None = None) -> AsyncIterator[TokenDelta]:
        """Decode-with-handoff: continue a request whose prompt was prefilled elsewhere.

        ``first_token`` is the token the prefill engine sampled: engines that resume
        after it (torch, the mocker) stream it first; engines that sample the first
        token again from the transferred KV (vLLM, SGLang) ignore it."""

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its KV; unknown or finished ids are ignored."""

    async def run_kv_events(self, sink: KvEventSink,
                            ready: asyncio.Event | None = None) -> None:
        """KV event source: deliver BlockStored/BlockRemoved batches to ``sink`` until
        cancelled; ``ready`` is set once nothing can be missed any more (start it before
        ``start()``).  Engines without prefix-cache events set it and return at once."""

    def load(self) -> LoadSample:
        """Load source: the current load, cheap enough to call a few times a second."""

    def inflight(self) -> int:
        """Requests started and not finished (drain waits for zero)."""

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop accepting, let in-flight requests finish for up to ``drain_timeout_s``,
        abort the rest and release the engine."""

    # ---- capabilities.reports_failure ---------------------------------------------------
    def failure(self) -> BaseException | None:
        """The error that killed the engine on its own, or None while it is healthy."""

    # ---- capabilities.prefix_lookup -----------------------------------------------------
    async def cached_prefix_tokens(self, token_ids: tuple[int, ...],
                                   lora: str | None = None) -> int:
        """Prompt tokens this engine's prefix cache holds now (for the decider): the base
        model's blocks, or adapter ``lora``'s (an adapter's KV is its own)."""

    # ---- capabilities.handoff_before_prefill --------------------------------------------
    async def begin_prefill(self, request_id: str, params: GenerateParams) -> PrefillTicket:
        """Submit a prefill and return at once with its handoff (send it to the decode
        worker now) and the task that finishes it."""

    # ---- capabilities.pushes_kv (decode side) -------------------------------------------
    async def reserve_remote(self, request_id: str, params: GenerateParams
                             ) -> TorchBlocksHandoff | None:
        """Reserve the prompt's blocks (reusing this engine's cached prefix) before the
        job is enqueued; the destination the job carries, or None when there is no room
        now."""

    async def release_remote(self, request_id: str, late_write_possible: bool) -> None:
        """Give a reservation up when the request does not go on to ``decode``.
        ``late_write_possible``: the job may still be running somewhere, so the blocks
        stay held until a late write can no longer land."""

    # ---- capabilities.moves_kv ----------------------------------------------------------
    async def park(self, request_id: str) -> tuple[str, tuple[int, ...]] | None:
        """Stop a running request between steps, keeping its KV: the id it is parked
        under and its tokens (the KV holds all but the last), or None when it cannot
        move (the caller then ends it as usual)."""

    def parked(self) -> int:
        """Requests whose KV waits here for the replica that continues them."""

    async def export_parked(self, request_id: str, destination: TorchBlocksHandoff,
                            notify_id: str) -> KvWriteReport:
        """Write a parked request's KV into ``destination``'s blocks (their reader waits
        for ``notify_id``), then free it here."""

    def resume_moved(self, request_id: str, params: GenerateParams,
                     fetch: Callable[[TorchBlocksHandoff, str], Awaitable[object]],
                     outcome: Callable[[str], None] = lambda _: None
                     ) -> AsyncIterator[TokenDelta]:
        """Continue a request whose KV another replica parked: ``params.token_ids`` are
        its prompt and the tokens streamed so far; ``fetch(handoff, notify_id)`` has the
        KV written here; recomputes when that fails.  ``outcome`` is told "moved" or
        "recomputed"."""

    # ---- capabilities.serves_lora -------------------------------------------------------
    async def load_lora(self, name: str, path: str) -> None:
        """Load the PEFT adapter directory ``path`` (``adapter_config.json`` and its
        weights) under ``name``; raise ``ValueError`` naming what is wrong (missing
        files, a rank over the engine's limit, modules the base model lacks, no slot
        left).  Loading a name again with the same path is a no-op."""

    async def unload_lora(self, name: str) -> None:
        """Forget adapter ``name``; raise ``KeyError`` for a name not loaded and
        ``ValueError`` while requests that use it are in flight."""

    def loras(self) -> dict[str, str]:
        """The adapters loaded now: name -> the path each was loaded from."""


class WithoutAbility:
    """Base of the classes an engine lists for the abilities it does not have."""

    info: EngineInfo

    def _absent(self, member: str, flag: str) -> AbilityAbsent:
        return AbilityAbsent(f"the {self.info.name} engine has no {member}() "
                             f"(capabilities.{flag} is false)")


class WithoutFailureReport(WithoutAbility):
    """For an engine that cannot tell it died (``reports_failure`` false)."""

    def failure(self) -> BaseException | None:
        raise self._absent("failure", "reports_failure")


class WithoutPrefixLookup(WithoutAbility):
    """For an engine whose prefix hit the decider cannot ask (``prefix_lookup`` false)."""

    async def cached_prefix_tokens(self, token_ids: tuple[int, ...],
                                   lora: str | None = None) -> int:
        raise self._absent("cached_prefix_tokens", "prefix_lookup")


class WithoutHandoffFirst(WithoutAbility):
    """For an engine whose handoff is the prefill's result (``handoff_before_prefill``
    false)."""

    async def begin_prefill(self, request_id: str, params: GenerateParams) -> PrefillTicket:
        raise self._absent("begin_prefill", "handoff_before_prefill")


class WithoutKvPush(WithoutAbility):
    """For an engine whose decode side reserves nothing for a prefill to write into
    (``pushes_kv`` false)."""

    async def reserve_remote(self, request_id: str, params: GenerateParams
                             ) -> TorchBlocksHandoff | None:
        raise self._absent("reserve_remote", "pushes_kv")

    async def release_remote(self, request_id: str, late_write_possible: bool) -> None:
        raise self._absent("release_remote", "pushes_kv")


class WithoutKvMoves(WithoutAbility):
    """For an engine without live KV moves (``moves_kv`` false)."""

    async def park(self, request_id: str) -> tuple[str, tuple[int, ...]] | None:
        raise self._absent("park", "moves_kv")

    def parked(self) -> int:
        raise self._absent("parked", "moves_kv")

    async def export_parked(self, request_id: str, destination: TorchBlocksHandoff,
                            notify_id: str) -> KvWriteReport:
        raise self._absent("export_parked", "moves_kv")

    def resume_moved(self, request_id: str, params: GenerateParams,
                     fetch: Callable[[TorchBlocksHandoff, str], Awaitable[object]],
                     outcome: Callable[[str], None] = lambda _: None
                     ) -> AsyncIterator[TokenDelta]:
        raise self._absent("resume_moved", "moves_kv")


def protocol_members() -> tuple[str, ...]:
    """Every member ``Engine`` declares: its attributes (``info``), then its methods."""
    methods = [name for name, value in Engine.__dict__.items()
               if not name.startswith("_") and callable(value)]
    return (*Engine.__annotations__, *methods)


class WithoutLora(WithoutAbility):
    """For an engine that serves no LoRA adapter (``serves_lora`` false)."""

    async def load_lora(self, name: str, path: str) -> None:
        raise self._absent("load_lora", "serves_lora")

    async def unload_lora(self, name: str) -> None:
        raise self._absent("unload_lora", "serves_lora")

    def loras(self) -> dict[str, str]:
        raise self._absent("loras", "serves_lora")
