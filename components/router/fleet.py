"""What the router process knows about the workers, turned into a Snapshot per request.

Pure bookkeeping with the clock passed in: the live worker set (from discovery), the
load each worker reports, and the requests this router placed and has not seen released.
Router-side in-flight counts make load visible immediately (reports lag) and work for
engines that report nothing (Dynamo's mocker); an unreleased request expires after a TTL
so a lost release (frontend crash) cannot pin load on a worker forever.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.components.protocol import WorkerLoad

from .types import Snapshot, WorkerState


@dataclass
class _Placed:
    worker_id: int
    at: float


class FleetState:
    """Live workers, their reported load and this router's in-flight placements."""

    def __init__(self, inflight_ttl_s: float = 600.0) -> None:
        self.inflight_ttl_s = inflight_ttl_s
        self.live: set[int] = set()
        self.reports: dict[int, tuple[WorkerLoad, float]] = {}
        self.placed: dict[str, _Placed] = {}
        self.inflight: dict[int, int] = {}

    def set_live(self, worker_ids: list[int]) -> None:
        """Called whenever discovery's instance list is read."""
        self.live = set(worker_ids)
        for gone in [w for w in self.reports if w not in self.live]:
            del self.reports[gone]

    def report(self, load: WorkerLoad, now: float) -> None:
        """Called for every WorkerLoad message."""
        self.reports[load.worker_id] = (load, now)

    def place(self, request_id: str, worker_id: int, now: float) -> None:
        """Called after a decision: the request now loads ``worker_id``."""
        self.placed[request_id] = _Placed(worker_id, now)
        self.inflight[worker_id] = self.inflight.get(worker_id, 0) + 1

    def release(self, request_id: str) -> int | None:
        """Called when the frontend reports the request over; returns its worker."""
        p = self.placed.pop(request_id, None)
        if p is None:
            return None
        self.inflight[p.worker_id] = max(0, self.inflight.get(p.worker_id, 0) - 1)
        return p.worker_id

    def expire(self, now: float) -> int:
        """Forget placements older than the TTL; returns how many were dropped."""
        old = [rid for rid, p in self.placed.items() if now - p.at > self.inflight_ttl_s]
        for rid in old:
            self.release(rid)
        return len(old)

    def workers(self, now: float) -> tuple[WorkerState, ...]:
        """WorkerState of every live worker: in-flight from here, KV and queue reported."""
        out = []
        for wid in sorted(self.live):
            load, at = self.reports.get(wid, (None, None))
            inflight = self.inflight.get(wid, 0)
            if load is None:
                out.append(WorkerState(worker_id=wid, active_requests=inflight))
                continue
            out.append(WorkerState(
                worker_id=wid,
                # The worker's own count lags placements by up to a report interval, the
                # router's misses other routers' requests: take the larger.
                active_requests=max(inflight, load.active),
                waiting_requests=load.waiting,
                kv_blocks_used=min(load.kv_used_blocks, load.kv_total_blocks),
                kv_blocks_total=load.kv_total_blocks,
                draining=load.draining,
                last_seen_s=max(0.0, now - at)))
        return tuple(out)

    def snapshot(self, now: float, overlap: dict[int, int], recent: dict[int, int]) -> Snapshot:
        """The Snapshot for one decision."""
        live = self.live
        return Snapshot(workers=self.workers(now),
                        overlap_blocks={w: n for w, n in overlap.items() if w in live},
                        recent_prefix_blocks={w: n for w, n in recent.items() if w in live})
