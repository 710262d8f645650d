"""Requests in, outputs and statistics out: the engine core's data types."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from .lora import LoraWeights

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True)
class Request:
    """A generation request as the engine core sees it (already tokenised)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None  # seeds the request's own generator; None = nondeterministic
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's EOS tokens
    priority: int = 0  # higher = more important: admitted first, preempted last
    prefill_only: bool = False  # disaggregation: stop after the first token, keep the KV
    # Sampling beyond temperature / top-p (neutral defaults change nothing):
    top_k: int = 0  # 0 = no limit
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    min_tokens: int = 0  # stop tokens cannot end the request before this many tokens
    logprobs: int | None = None  # sampled tokens' logprobs + this many alternatives each
    prompt_logprobs: int | None = None  # prompt tokens' logprobs (disables prefix reuse)
    json_schema: str | None = None  # structured output: JSON valid against this schema
    lora: str | None = None  # the loaded LoRA adapter to apply, by name (None: base model)

    @property
    def neutral_logits(self) -> bool:
        """True when nothing but temperature / top-p shapes the model's distribution."""
        return (not self.logit_bias and self.presence_penalty == 0
                and self.frequency_penalty == 0 and self.repetition_penalty == 1.0
                and self.min_tokens == 0 and self.json_schema is None)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: prompt_token_ids is empty")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id!r}: max_tokens={self.max_tokens} < 1")
        if self.temperature < 0:
            raise ValueError(f"request {self.request_id!r}: temperature={self.temperature} < 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"request {self.request_id!r}: top_p={self.top_p} not in (0, 1]")
        self._check_sampling()

    def _check_sampling(self) -> None:
        bad = []
        if self.top_k < 0:
            bad.append(f"top_k={self.top_k} < 0")
        if not 0 <= self.min_p <= 1:
            bad.append(f"min_p={self.min_p} not in [0, 1]")
        if self.repetition_penalty <= 0:
            bad.append(f"repetition_penalty={self.repetition_penalty} <= 0")
        if self.min_tokens < 0:
            bad.append(f"min_tokens={self.min_tokens} < 0")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and v < 0:
                bad.append(f"{name}={v} < 0")
        if bad:
            raise ValueError(f"request {self.request_id!r}: {', '.join(bad)}")


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache (at first admission)
    kv_block_ids: tuple[int, ...] = ()  # set when a prefill-only request finishes
    error: str | None = None  # why the engine failed the request (finish_reason "error")
    # Per new token (when the request asked for logprobs): its log-probability and the
    # position's most likely (token id, log-probability) pairs, best first.
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    # On the first output of a request with prompt_logprobs: the same for every prompt
    # token after the first.
    prompt_logprobs: tuple[float, ...] | None = None
    prompt_top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics and routing; cumulative counters since start."""

    num_running: int
    num_waiting: int
    num_waiting_for_kv: int  # decode side of disaggregation: blocks allocated, KV not arrived
    kv_blocks_used: int
    kv_blocks_total: int
    kv_blocks_cached: int
    prefix_query_tokens: int  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int  # of those, tokens whose KV was reused
    num_preemptions: int
    num_generated_tokens: int
    num_steps: int

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks referenced by live requests."""
        return self.kv_blocks_used / self.kv_blocks_total


@dataclass(frozen=True)
class RemoteKvAllocation:
    """Blocks a decode engine reserved for KV that another engine will write.

    Blocks ``block_ids[num_cached_tokens // block_size:]`` must be filled; the
    leading ones already hold this engine's cached prefix.
    """

    request_id: str
    block_ids: tuple[int, ...]
    num_cached_tokens: int


@dataclass(frozen=True)
class ParkedKv:
    """A running request stopped between steps with its KV kept, to move to another
    engine: ``token_ids`` are its prompt and output tokens, and blocks ``block_ids``
    hold the KV of all but the last (which no step has read yet)."""

    request_id: str
    block_ids: tuple[int, ...]
    token_ids: tuple[int, ...]


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    WAITING_FOR_KV = "waiting_for_kv"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Mutable engine-side state of one request."""

    request: Request
    arrival: int  # admission order tie-breaker
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    status: SeqStatus = SeqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens whose KV is in the cache
    num_cached_tokens: int = -1  # prefix hit at first admission (-1: not admitted yet)
    num_emitted: int = 0  # output tokens already returned to the caller
    finish_reason: FinishReason | None = None
    error: str | None = None
    # Log-probabilities of output_ids (when asked for), parallel to output_ids.
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    # Prompt log-probabilities gathered chunk by chunk; emitted with the first output.
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    matcher: Any = None  # the JSON grammar's state (requests with json_schema)
    lora: LoraWeights | None = None  # the adapter named by request.lora, taken at admission

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def needs_prompt_logits(self) -> bool:
        """True until the prompt's log-probabilities (if asked for) have been sent."""
        return self.request.prompt_logprobs is not None and not self.prompt_logprobs_sent

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.request.prompt_token_ids, *self.output_ids]

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.output_ids)
