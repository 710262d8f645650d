"""Requests in, outputs and statistics out: the engine core's data types."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal

import torch

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

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: prompt_token_ids is empty")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id!r}: max_tokens={self.max_tokens} < 1")
        if self.temperature < 0:
            raise ValueError(f"request {self.request_id!r}: temperature={self.temperature} < 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"request {self.request_id!r}: top_p={self.top_p} not in (0, 1]")


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

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.request.prompt_token_ids, *self.output_ids]

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.output_ids)
