"""The one engine interface every worker drives: torch, mocker, vLLM, SGLang, TensorRT-LLM.

A worker process (aggregated, decode or prefill) is the same thin shell around any
engine; what differs per engine is how a prompt's KV gets from a prefill engine to a
decode engine.  That difference is one typed *handoff*, carried by the prefill job:

- torch: the decode worker's destination block ids (the prefill worker writes KV there
  over NIXL itself);
- vLLM: the ``kv_transfer_params`` the prefill engine returns (its NixlConnector pulls);
- SGLang: the bootstrap host/port/room triple both engines are given;
- TensorRT-LLM and Dynamo's mocker: the context phase's opaque ``disaggregated_params``.

Everything here is plain data plus one Protocol; no engine library is imported.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from splitserve.contracts.block_events import KvEvent
from splitserve.contracts.wire import TokenLogprobs

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
    priority: int = 1
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
    finish_reason: Literal["stop", "length", "abort", "error"] | None = None
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
    handoff: EngineHandoff
    cached_tokens: int = 0
    compute_s: float = 0.0
    transfer_s: float = 0.0
    """Time the prefill side spent moving KV itself (torch's NIXL write, the mocker's
    simulated transfer); 0 where the decode engine pulls."""
    transfer_bytes: int = 0


@dataclass(frozen=True)
class LoadSample:
    """An engine's own view of its load, published to routers as WorkerLoad."""

    active: int
    waiting: int
    kv_used_blocks: int
    kv_total_blocks: int


@dataclass
class EngineInfo:
    """Static facts a worker needs before serving (block size for the router, etc.)."""

    name: str
    kv_block_size: int
    supports_local_prefill: bool
    """False for engines that cannot prefill where they decode (an SGLang decode-mode
    engine): the decode coordinator then turns "local" verdicts into remote ones."""
    pushes_kv: bool = False
    """True for engines whose prefill side writes KV into blocks the decode side reserved
    first (torch): the decode engine is then also a ``RemoteKvTarget`` and the prefill
    engine's ``prefill`` takes the job's ``destination``."""
    extras: dict[str, Any] = field(default_factory=dict)


KvEventSink = Callable[[list[KvEvent]], None]


@runtime_checkable
class Engine(Protocol):
    """What the aggregated worker, the decode coordinator and the prefill loop call.

    Cancellation: closing an iterator returned by ``generate`` or ``decode`` before its
    last delta (client gone) aborts the request in the engine; ``abort`` does the same
    by id.  Every method runs on the worker's event loop.
    """

    info: EngineInfo

    async def start(self) -> None:
        """Load the model and start the engine; returns when it can serve."""

    def generate(self, request_id: str, params: GenerateParams) -> AsyncIterator[TokenDelta]:
        """Aggregated: prefill here and stream every generated token."""

    async def prefill(self, request_id: str, params: GenerateParams) -> PrefillResult:
        """Prefill-for-job: compute the prompt's KV, sample the first token, and return the
        handoff the decode engine needs to take the KV over."""

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


@runtime_checkable
class RemoteKvTarget(Protocol):
    """The decode side of an engine with ``info.pushes_kv``: it reserves the blocks a
    prefill engine will write into before the job is enqueued, and releases them when
    the request does not go on to ``decode``."""

    async def reserve_remote(self, request_id: str, params: GenerateParams
                             ) -> TorchBlocksHandoff | None:
        """Reserve the prompt's blocks (reusing this engine's cached prefix); the
        destination the job carries, or None when there is no room now."""

    async def release_remote(self, request_id: str, late_write_possible: bool) -> None:
        """Give a reservation up.  ``late_write_possible``: the job may still be running
        somewhere, so the blocks stay held until a late write can no longer land."""

    async def cached_prefix_tokens(self, token_ids: tuple[int, ...]) -> int:
        """Prompt tokens this engine's prefix cache holds now (for the decider)."""
