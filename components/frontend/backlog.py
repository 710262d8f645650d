"""How long a new request would wait for a tokenizer thread, and whether to take it.

The frontend parses and tokenises in a small thread pool.  Bounding that pool's queue by
a *count* refuses a burst of short prompts that would clear in milliseconds as readily as
a pile of 100k-token prompts that would take seconds, so the bound here is the expected
wait: the bytes already waiting or in work, divided by the pool's measured throughput
(bytes of request body per second per thread, an EMA over finished requests).  A count
cap stays as a memory backstop.

Pure: the caller passes body sizes and measured durations.
"""

from __future__ import annotations

from dataclasses import dataclass

# Before anything was measured: optimistic (a body of ~25 KB, ~4k tokens, takes ~4 ms on
# one core), so a first burst is not refused on a guess.
INITIAL_BYTES_PER_S = 20e6
SMOOTHING = 0.2


@dataclass
class TokenizeBacklog:
    threads: int
    max_wait_s: float
    max_pending: int
    bytes_per_s: float = INITIAL_BYTES_PER_S
    pending: int = 0
    pending_bytes: int = 0

    def expected_wait_s(self, extra_bytes: int = 0) -> float:
        """Seconds until a request of ``extra_bytes`` would be parsed and tokenised."""
        return (self.pending_bytes + extra_bytes) / (self.bytes_per_s * max(1, self.threads))

    def refusal(self, nbytes: int) -> str | None:
        """Why a body of ``nbytes`` cannot be taken now (None: take it, then ``enter``).

        One request is always taken when nothing waits, however large."""
        if self.pending >= self.max_pending:
            return f"{self.pending} requests are already being tokenised"
        if self.pending and self.expected_wait_s(nbytes) > self.max_wait_s:
            return (f"tokenising what is already queued would take "
                    f"{self.expected_wait_s():.1f}s (limit {self.max_wait_s:g}s)")
        return None

    def enter(self, nbytes: int) -> None:
        self.pending += 1
        self.pending_bytes += nbytes

    def leave(self, nbytes: int, busy_s: float | None) -> None:
        """A request left the pool; ``busy_s``: the time a thread spent on it (None when
        it failed before that could be measured)."""
        self.pending = max(0, self.pending - 1)
        self.pending_bytes = max(0, self.pending_bytes - nbytes)
        if busy_s is not None and busy_s > 0 and nbytes >= 1024:
            rate = nbytes / busy_s
            self.bytes_per_s = SMOOTHING * rate + (1 - SMOOTHING) * self.bytes_per_s
