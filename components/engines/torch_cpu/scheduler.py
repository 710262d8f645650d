"""Who runs this step: continuous batching with chunked prefill and preemption.

Pure bookkeeping over ``Sequence`` objects and the ``KVCacheManager``; the
engine turns the decision into a forward batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import EngineConfig
from .kv_cache import KVCacheManager
from .request import SeqStatus, Sequence


@dataclass
class PrefillChunk:
    """Compute KV for token positions ``[start, end)`` of ``seq``."""

    seq: Sequence
    start: int
    end: int

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the last token, so its logits give the next token."""
        return self.end == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """One step's plan: prefill chunks, then one decode token for each decoding sequence."""

    prefills: list[PrefillChunk] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


def _rank(seq: Sequence) -> tuple[int, int]:
    """Sort key: more important first (higher priority, then earlier arrival)."""
    return (-seq.request.priority, seq.arrival)


class Scheduler:
    """Keeps the waiting and running sets and plans each step."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def chunk_tokens(self) -> int:
        """Most prompt tokens of one sequence per step (``max_chunk_tokens``)."""
        return self.config.max_chunk_tokens or self.config.max_prefill_tokens

    def add(self, seq: Sequence) -> None:
        """Queue a new (or preempted) sequence for admission."""
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Forget ``seq`` (finished or aborted) and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if self.kv.has_sequence(seq.request_id):
            self.kv.free(seq.request_id)

    def schedule(self) -> SchedulerOutput:
        """Plan the next step. Called once per engine step.

        Running sequences go first (decodes, then unfinished prefill chunks),
        most important first; when a decode cannot get a block, the least
        important running sequence is preempted (freed, requeued, recomputed
        later, its cached blocks likely reused). Then waiting sequences are
        admitted while slots, prefill budget and blocks last.
        """
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_prefill_tokens)
        self._admit_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Decodes and unfinished prefill chunks of running sequences, preempting the
        least important when a decode needs a block; returns the prefill budget left."""
        for seq in sorted(self.running, key=_rank):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            if seq.num_computed == seq.num_tokens - 1:
                while not self.kv.allocate(seq.request_id, seq.num_tokens):
                    victim = max(self.running, key=_rank)
                    self._preempt(victim, out)
                    if victim is seq:
                        break
                if seq.status is SeqStatus.RUNNING:
                    out.decodes.append(seq)
            elif budget > 0:
                end = seq.num_computed + min(seq.num_tokens - seq.num_computed, budget,
                                             self.chunk_tokens)
                if self.kv.allocate(seq.request_id, end):
                    out.prefills.append(PrefillChunk(seq, seq.num_computed, end))
                    budget -= end - seq.num_computed
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting sequences, most important first, while slots, the prefill
        budget and blocks last."""
        self.waiting.sort(key=_rank)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running:
            seq = self.waiting[0]
            if seq in out.preempted:
                break  # it just gave its blocks up; taking them back would thrash
            tokens = seq.all_token_ids
            cached = self.kv.open_sequence(seq.request_id, tokens,
                                           reuse=not seq.needs_prompt_logits,
                                           lora_name=seq.request.lora)
            end = cached + min(len(tokens) - cached, budget, self.chunk_tokens)
            if not self.kv.allocate(seq.request_id, end):
                self.kv.free(seq.request_id)
                break
            self.waiting.pop(0)
            if seq.num_cached_tokens < 0:  # first admission, not a re-admission
                seq.num_cached_tokens = cached
                self.prefix_query_tokens += len(tokens)
                self.prefix_hit_tokens += cached
            seq.num_computed = cached
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.prefills.append(PrefillChunk(seq, cached, end))
            budget -= end - cached

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv.free(seq.request_id)
        seq.num_computed = 0
        self.num_preemptions += 1
        out.preempted.append(seq)
        self.add(seq)
