"""A simple queueing model of the prefill and decode pools, for the simulator.

What it models (see docs/planner.md, "What the simulator models"):

- Prefill: one FIFO queue served as a fluid by all ready prefill replicas together, at
  ``prefill_tokens_per_s`` prompt tokens per second each.  TTFT = prefill completion -
  arrival.  Utilisation = busy time / interval.
- Decode: finished prefills wait for a decode slot (``decode_max_seqs`` per replica and
  ``kv_tokens_per_replica`` of KV).  Each replica produces at most
  ``decode_tokens_per_s`` tokens per second, shared by its sequences, and one sequence at
  most ``decode_seq_tokens_per_s`` (so ITL = 1 / per-sequence speed).
- Replicas: a new replica serves ``startup_s`` after the planner asked for it; a removed
  replica's capacity goes at once (its sequences continue on the others: the model is a
  fluid, not per-replica placement).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pydantic import Field

from splitserve.components.policy.base import PolicyModel

from .model import Action, Move, Observation, PoolObservation, Scale
from .traces import TraceRequest


class FleetModel(PolicyModel):
    """Per-replica speeds of the simulated pools (a ``--fleet`` YAML file)."""

    prefill_tokens_per_s: float = Field(default=10000.0, gt=0, description="Prompt tokens "
                                        "per second one prefill replica computes.")
    decode_tokens_per_s: float = Field(default=1500.0, gt=0, description="Tokens per second "
                                       "one decode replica generates across its batch.")
    decode_seq_tokens_per_s: float = Field(default=40.0, gt=0, description="Tokens per second "
                                           "of one sequence when the replica is not saturated.")
    decode_max_seqs: int = Field(default=64, ge=1, description="Sequences one decode replica "
                                 "decodes at once.")
    kv_tokens_per_replica: int = Field(default=1_000_000, ge=1, description="KV-cache "
                                       "capacity of one decode replica, in tokens.")
    startup_s: float = Field(default=30.0, ge=0, description="Seconds from a scale-up to the "
                             "new replica serving.")
    prefill_replicas: int | None = Field(default=None, ge=0, description="Replicas at the "
                                         "start; default the policy's min_replicas.")
    decode_replicas: int | None = Field(default=None, ge=0, description="Same, decode pool.")


@dataclass
class _Seq:
    remaining: int   # output tokens still to generate
    context: int     # tokens held in KV (prompt + generated)


@dataclass
class FleetSim:
    """Mutable state of the simulated fleet; ``step`` advances it by one interval."""

    model: FleetModel
    prefill_ready_at: list[float]            # one entry per live replica
    decode_ready_at: list[float]
    prefill_queue: deque = field(default_factory=deque)   # [arrival, remaining, req]
    decode_wait: deque = field(default_factory=deque)     # TraceRequest
    active: list[_Seq] = field(default_factory=list)

    @staticmethod
    def _ready(ready_at: list[float], t: float) -> int:
        return sum(1 for r in ready_at if r <= t)

    def _prefill(self, t0: float, t1: float, arrivals: list[TraceRequest]) -> tuple[float, list]:
        """Serve the FIFO as one fluid server; returns (busy seconds, TTFTs)."""
        for r in arrivals:
            self.prefill_queue.append([r.arrival_s, float(r.input_tokens), r])
        rate = self._ready(self.prefill_ready_at, t0) * self.model.prefill_tokens_per_s
        clock, busy, ttfts = t0, 0.0, []
        while rate > 0 and self.prefill_queue and clock < t1:
            item = self.prefill_queue[0]
            start = max(clock, item[0])
            if start >= t1:
                break
            done = start + item[1] / rate
            if done > t1:
                item[1] -= (t1 - start) * rate
                busy += t1 - start
                break
            busy += done - start
            clock = done
            self.prefill_queue.popleft()
            ttfts.append(done - item[0])
            self.decode_wait.append(item[2])
        return busy, ttfts

    def _decode(self, t0: float, dt: float) -> tuple[int, float | None]:
        """Admit waiting sequences, generate for ``dt``; returns (tokens, mean ITL)."""
        m, ready = self.model, self._ready(self.decode_ready_at, t0)
        slots, kv_cap = ready * m.decode_max_seqs, ready * m.kv_tokens_per_replica
        used = sum(s.context for s in self.active)
        while self.decode_wait and len(self.active) < slots:
            r = self.decode_wait[0]
            if used + r.input_tokens > kv_cap:
                break
            self.decode_wait.popleft()
            self.active.append(_Seq(max(r.output_tokens, 1), r.input_tokens))
            used += r.input_tokens
        if not self.active or ready == 0:
            return 0, None
        per_seq = min(m.decode_seq_tokens_per_s, m.decode_tokens_per_s * ready / len(self.active))
        produced = 0
        for s in self.active:
            n = min(s.remaining, int(per_seq * dt) or 1)
            s.remaining -= n
            s.context += n
            produced += n
        self.active = [s for s in self.active if s.remaining > 0]
        return produced, 1.0 / per_seq

    def step(self, t0: float, dt: float, arrivals: list[TraceRequest]) -> Observation:
        """Advance over ``[t0, t0 + dt)`` with these arrivals; returns the observation at
        the interval's end, in the units the live source reports."""
        m, t1 = self.model, t0 + dt
        busy, ttfts = self._prefill(t0, t1, arrivals)
        d_ready = self._ready(self.decode_ready_at, t0)
        produced, itl = self._decode(t0, dt)
        p_ready = self._ready(self.prefill_ready_at, t0)
        kv_cap = d_ready * m.kv_tokens_per_replica
        prefill = PoolObservation(
            replicas=len(self.prefill_ready_at), ready=self._ready(self.prefill_ready_at, t1),
            queue_length=len(self.prefill_queue) / max(p_ready, 1),
            gpu_utilization=100.0 * busy / dt if p_ready else 0.0)
        decode = PoolObservation(
            replicas=len(self.decode_ready_at), ready=self._ready(self.decode_ready_at, t1),
            queue_length=len(self.decode_wait) / max(d_ready, 1),
            kv_cache_usage=100.0 * sum(s.context for s in self.active) / kv_cap if kv_cap else 0.0,
            gpu_utilization=100.0 * produced / (dt * d_ready * m.decode_tokens_per_s)
            if d_ready else 0.0)
        return Observation(
            time_s=t1, prefill=prefill, decode=decode,
            requests_per_s=len(arrivals) / dt,
            prompt_tokens_per_s=sum(r.input_tokens for r in arrivals) / dt,
            output_tokens_per_s=produced / dt,
            ttft_s=sum(ttfts) / len(ttfts) if ttfts else None, itl_s=itl)

    def apply(self, actions: list[Action], now: float) -> None:
        """Carry out the planner's changes: new replicas serve after ``startup_s``,
        removed ones (newest first, as the supervisor does) stop at once."""
        pools = {"prefill": self.prefill_ready_at, "decode": self.decode_ready_at}
        for a in actions:
            steps = ([(a.source, a.source_target), (a.dest, a.dest_target)]
                     if isinstance(a, Move) else
                     [(a.pool, a.target)] if isinstance(a, Scale) else [])
            for pool, target in steps:
                live = pools[pool]
                while len(live) > target:
                    live.pop()
                while len(live) < target:
                    live.append(now + self.model.startup_s)
