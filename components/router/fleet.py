"""What the router process knows about the workers, turned into a Snapshot per request.

Pure bookkeeping with the clock passed in: the live worker set (from discovery), the
load each worker reports, and the requests this router placed and has not seen released.
Router-side in-flight counts make load visible immediately (reports lag) and work for
engines that report nothing (Dynamo's mocker); an unreleased request expires after a TTL
so a lost release (frontend crash) cannot pin load on a worker forever.

A worker a frontend could not reach is marked down at once: discovery keeps a dead
worker's instance until its lease expires (seconds), and every request routed there
meanwhile would fail.  The mark lifts when the worker is seen alive again (a load report
received at least ``down_grace_s`` after the mark, so a report already in flight when it
died does not count), when it leaves discovery, or after ``down_ttl_s`` for engines that
send no reports.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.contracts.wire import WorkerLoad

from .types import Snapshot, WorkerState


@dataclass
class _Placed:
    worker_id: int
    at: float


class FleetState:
    """Live workers, their reported load and this router's in-flight placements."""

    def __init__(self, inflight_ttl_s: float = 600.0, down_ttl_s: float = 30.0,
                 down_grace_s: float = 1.0) -> None:
        self.inflight_ttl_s = inflight_ttl_s
        self.down_ttl_s = down_ttl_s
        self.down_grace_s = down_grace_s
        self.down: dict[int, float] = {}
        self.live: set[int] = set()
        self.reports: dict[int, tuple[WorkerLoad, float]] = {}
        self.placed: dict[str, _Placed] = {}
        """Unreleased placements, oldest first while ``_in_order`` (``expire`` stops at
        the first one not expired)."""
        self.inflight: dict[int, int] = {}
        self._in_order = True

    def set_live(self, worker_ids: list[int]) -> None:
        """Called whenever discovery's instance list is read."""
        self.live = set(worker_ids)
        for gone in [w for w in self.reports if w not in self.live]:
            del self.reports[gone]
        for gone in [w for w in self.down if w not in self.live]:
            del self.down[gone]

    def report(self, load: WorkerLoad, now: float) -> None:
        """Called for every WorkerLoad message; a report lifts a down mark (see above)."""
        self.reports[load.worker_id] = (load, now)
        marked = self.down.get(load.worker_id)
        if marked is not None and now - marked >= self.down_grace_s:
            del self.down[load.worker_id]

    def mark_down(self, worker_id: int, now: float) -> bool:
        """Called when a frontend could not reach ``worker_id``: stop offering it.
        Returns True if it was not marked already."""
        fresh = worker_id not in self.down
        self.down[worker_id] = now
        return fresh

    def candidates(self, now: float) -> list[int]:
        """Live workers a request may be routed to now (not down, not draining)."""
        self._lift_old_marks(now)
        out = []
        for wid in sorted(self.live):
            load = self.reports.get(wid, (None, None))[0]
            if wid not in self.down and not (load is not None and load.draining):
                out.append(wid)
        return out

    def place(self, request_id: str, worker_id: int, now: float) -> None:
        """Called after a decision: the request now loads ``worker_id`` (and no longer
        the worker it was placed on before, if it was)."""
        if request_id in self.placed:
            self.release(request_id)
        if self.placed and now < next(reversed(self.placed.values())).at:
            self._in_order = False  # a clock that went back: ``expire`` scans them all
        self.placed[request_id] = _Placed(worker_id, now)
        self.inflight[worker_id] = self.inflight.get(worker_id, 0) + 1

    def placed_elsewhere(self, request_id: str, worker_id: int | None) -> bool:
        """True when the request is placed on a worker other than ``worker_id`` (the one a
        release is from; 0 or None: not said): it was placed again (migrated) before
        that release arrived."""
        p = self.placed.get(request_id)
        return p is not None and bool(worker_id) and p.worker_id != worker_id

    def release(self, request_id: str, worker_id: int | None = None) -> int | None:
        """Called when the frontend reports the request over; returns its worker.  With
        ``worker_id`` (the worker the release is from), a placement on another worker is
        kept (``placed_elsewhere``)."""
        if self.placed_elsewhere(request_id, worker_id):
            return None
        p = self.placed.pop(request_id, None)
        if p is None:
            return None
        self.inflight[p.worker_id] = max(0, self.inflight.get(p.worker_id, 0) - 1)
        return p.worker_id

    def expire(self, now: float) -> int:
        """Forget placements older than the TTL; returns how many were dropped.  Called
        for every decision: placements are kept oldest first, so it reads only the
        expired ones and the first that is not (not every request in flight)."""
        old = []
        for rid, p in self.placed.items():
            if now - p.at > self.inflight_ttl_s:
                old.append(rid)
            elif self._in_order:
                break
        for rid in old:
            self.release(rid)
        if not self.placed:
            self._in_order = True
        self._lift_old_marks(now)
        return len(old)

    def _lift_old_marks(self, now: float) -> None:
        for wid in [w for w, at in self.down.items() if now - at > self.down_ttl_s]:
            del self.down[wid]

    def workers(self, now: float) -> tuple[WorkerState, ...]:
        """WorkerState of every live worker not marked down: in-flight from here, KV and
        queue reported."""
        out = []
        for wid in sorted(self.live):
            if wid in self.down:
                continue
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
                last_seen_s=max(0.0, now - at),
                loras=frozenset(load.loras)))
        return tuple(out)

    def snapshot(self, now: float, overlap: dict[int, int], recent: dict[int, int]) -> Snapshot:
        """The Snapshot for one decision."""
        live = self.live
        return Snapshot(workers=self.workers(now),
                        overlap_blocks={w: n for w, n in overlap.items() if w in live},
                        recent_prefix_blocks={w: n for w, n in recent.items() if w in live})
