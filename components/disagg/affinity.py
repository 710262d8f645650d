"""Prefix affinity for remote prefill: which prefill worker a job is queued for.

A decode worker remembers, per prefill worker, the prompt blocks that worker computed
for it (each handoff names the worker that ran the job), least recently computed
forgotten first beyond ``capacity_tokens``: an approximate view of each prefill engine's
prefix cache, kept without the engines' KV events (their engines may publish none, or
under ids of their own).  Requests sharing a prefix reach the same decode worker (the
KV-aware router places them where that prefix's KV is), so one decode worker's view
covers most of its own prompts; but the followers of a prompt that no worker has computed
yet (several requests opening one document at once) find no KV to be placed by and reach
any decode worker, so the decode workers tell each other where they queued each job and
which worker computed it (``share_message``, on one NATS subject): each one's view then
covers every decode worker's placements.

``choose`` prices a prompt on each live prefill worker in tokens, as Dynamo's KV router
prices a worker: what it must compute there (the prompt less the prefix that worker
holds) plus what is queued for it ahead (its own queue's jobs times the mean job).  The
cheapest worker gets the job when it holds any of the prefix; otherwise the job goes to
the shared queue, which whichever worker frees up first serves.  A job queued for a
worker that stays busy is taken by an idle one after ``steal_after_s`` (the queue's).

Pure: no I/O; the decode coordinator calls it per remote prefill.
"""

from __future__ import annotations

import random
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated

import msgspec

from splitserve.contracts.prefill_queue import PrefillAffinityConfig


@dataclass(frozen=True)
class AffinityChoice:
    """Where a job is queued: ``worker`` (its id in hex) or None (the shared queue),
    why (``held``, ``no-prefix-held``, ``cheaper-elsewhere``, ``no-live-worker``,
    ``off``), and the prefix tokens the chosen worker is credited with."""

    worker: str | None
    reason: str
    held_tokens: int = 0
    stamp: float | None = None
    """When the job was queued for ``worker`` (``PrefillAffinity.sent``)."""


def block_hashes(token_ids: Sequence[int], block_size: int,
                 lora: str | None = None) -> list[int]:
    """Chained hashes of the prompt's whole blocks: block i's hash depends on every token
    before it, and on the LoRA adapter (an adapter's KV is not the base model's)."""
    out: list[int] = []
    # Tuples of ints hash alike in every process (a str's hash does not): the decode
    # workers share these hashes.
    parent = (1 << 32) | zlib.crc32(lora.encode("utf-8")) if lora else 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        out.append(parent)
    return out


class PrefillAffinity:
    """One decode worker's view of the prefill workers' prefix caches."""

    def __init__(self, config: PrefillAffinityConfig | None = None) -> None:
        self.config = config or PrefillAffinityConfig()
        self._blocks: dict[str, OrderedDict[int, None]] = {}
        self._capacity = max(1, self.config.capacity_tokens // self.config.block_size)
        # Per prefill worker: when this decode worker queued each job it has not heard back
        # about, and when the last ones it heard back about were queued and answered.
        self._outstanding: dict[str, list[float]] = {}
        self._settled: dict[str, deque[float]] = {}
        self._rng = random.Random(0)
        self.mean_job_tokens = 0.0
        """Running mean of the tokens a job computes (its prompt less the prefix held
        where it ran), which prices a queued job."""

    def hashes(self, token_ids: Sequence[int], lora: str | None = None) -> list[int]:
        """The prompt's block hashes at this view's block size."""
        return block_hashes(token_ids, self.config.block_size, lora)

    def held(self, hashes: Sequence[int], worker: str) -> int:
        """Blocks of the prompt's prefix ``worker`` holds (its longest run from the
        first block)."""
        blocks = self._blocks.get(worker)
        if not blocks:
            return 0
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def ahead(self, worker: str, queued: Mapping[str, int], measured_at: float | None,
              now: float) -> int:
        """Jobs queued for ``worker`` ahead of a new one: the depth reading taken at
        ``measured_at`` less this decode worker's jobs answered since (the reading still
        counted them), plus its jobs queued since (it could not count them yet).  No
        reading: this decode worker's own unanswered jobs."""
        mine = self._outstanding.get(worker, [])
        if measured_at is None:
            return len(mine)
        answered = sum(1 for t in self._settled.get(worker, ()) if t > measured_at)
        since = sum(1 for t in mine if t > measured_at)
        return max(0, queued.get(worker, 0) - answered) + since

    def choose(self, hashes: Sequence[int], prompt_tokens: int, live: Collection[str],
               queued: Mapping[str, int], measured_at: float | None = None,
               now: float | None = None) -> AffinityChoice:
        """Where to queue a job of ``prompt_tokens`` with these block ``hashes``:
        ``live`` the prefill workers alive now, ``queued`` the jobs in each one's own
        queue by the depth reading taken at ``measured_at`` (``time.monotonic``)."""
        if not self.config.enable:
            return AffinityChoice(None, "off")
        if not live:
            return AffinityChoice(None, "no-live-worker")
        now = time.monotonic() if now is None else now
        workers = sorted(live)
        bs = self.config.block_size
        held = {w: self.held(hashes, w) * bs for w in workers}
        ahead = {w: self.ahead(w, queued, measured_at, now) for w in workers}
        # Before any job came back, a queued job is priced like this one.
        per_job = self.mean_job_tokens or float(prompt_tokens)
        best = min(workers, key=lambda w: (max(0, prompt_tokens - held[w])
                                           + ahead[w] * per_job, -held[w]))
        if held[best] > 0:
            return AffinityChoice(best, "held", held[best])
        if self.config.unheld == "least-queued":
            fewest = min(ahead.values())
            pick = self._rng.choice([w for w in workers if ahead[w] == fewest])
            return AffinityChoice(pick, "least-queued")
        holders = any(held.values())
        return AffinityChoice(None, "cheaper-elsewhere" if holders else "no-prefix-held")

    def sent(self, worker: str, now: float | None = None) -> float:
        """A job was queued for ``worker``; returns its stamp, which ``settled`` takes."""
        stamp = time.monotonic() if now is None else now
        self._outstanding.setdefault(worker, []).append(stamp)
        return stamp

    def settled(self, worker: str | None, stamp: float | None = None,
                now: float | None = None) -> None:
        """The job queued for ``worker`` at ``stamp`` was answered or given up."""
        mine = self._outstanding.get(worker) if worker is not None else None
        if not mine:
            return
        if stamp in mine:
            mine.remove(stamp)
        else:
            mine.pop(0)
        done = self._settled.setdefault(worker, deque(maxlen=256))
        done.append(time.monotonic() if now is None else now)

    def remember(self, worker: str, hashes: Sequence[int]) -> None:
        """``worker`` holds (or is about to compute) every block of this prompt, most
        recently used: called when a job is queued for it, so the next prompts sharing
        the prefix follow it there before it has run."""
        blocks = self._blocks.setdefault(worker, OrderedDict())
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self._capacity:
            blocks.popitem(last=False)

    def computed(self, worker: str, hashes: Sequence[int], computed_tokens: int) -> None:
        """``worker`` ran a job of this prompt: it now holds every block of it, and the
        job computed ``computed_tokens``."""
        self.remember(worker, hashes)
        computed_tokens = max(0, computed_tokens)
        self.mean_job_tokens = (float(computed_tokens) if not self.mean_job_tokens else
                                self.mean_job_tokens
                                + (computed_tokens - self.mean_job_tokens) * 0.1)

    def forget_except(self, live: Collection[str]) -> None:
        """Drop what is remembered of prefill workers no longer alive (a worker that
        restarts comes back with a new id and an empty cache)."""
        for worker in [w for w in self._blocks if w not in live]:
            del self._blocks[worker]
        for worker in [w for w in self._outstanding if w not in live]:
            self._outstanding.pop(worker, None)
            self._settled.pop(worker, None)

    def workers(self) -> dict[str, int]:
        """Blocks remembered per prefill worker (for metrics and tests)."""
        return {w: len(b) for w, b in self._blocks.items()}


class _Share(msgspec.Struct):
    """A ``share_message`` as it travels (JSON): ``from`` the decode worker telling it,
    ``worker`` the prefill worker, ``hashes`` the prompt's block hashes."""

    origin: str = msgspec.field(name="from")
    worker: Annotated[str, msgspec.Meta(min_length=1)]
    hashes: list[int]


def share_message(origin: str, worker: str, hashes: Sequence[int]) -> bytes:
    """What a decode worker tells the others: prefill worker ``worker`` holds (or is
    about to compute) these prompt blocks; ``origin``: the decode worker telling it."""
    return msgspec.json.encode(_Share(origin, worker, list(hashes)))


def read_share(data: bytes) -> tuple[str, str, list[int]]:
    """(origin, worker, hashes) of a ``share_message``; ValueError when it is not one."""
    try:
        msg = msgspec.json.decode(data, type=_Share)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a prefix affinity message: {exc}") from None
    return msg.origin, msg.worker, msg.hashes
