"""Moving a request whose worker failed: resend it whole, or resume it after the tokens
the client already has.

Called by the backends (direct, routed, in process) for every chunk they pass on and
for every failure of a worker's stream.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter

from splitserve.contracts.metrics import PREFIX
from splitserve.contracts.wire import FinishReason, output_chunk

from .request import WorkerCall

log = logging.getLogger(__name__)

# Moves a request may make beyond ``migration_limit`` when its worker hands it back at a
# drain deadline (scale-downs, role moves, restarts one after another).
DRAINED_MOVES = 4


class BackendMetrics:
    """Worker failures seen by the frontend and the migrations they caused."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.progress = None
        """The progress feeds' counters (``progress.ProgressMetrics``), made once in the
        registry by the first feed (with a Router process only)."""
        self.retries = Counter(f"{PREFIX}_frontend_request_retries_total",
                               "Requests sent to another worker because theirs failed "
                               "before producing output", registry=r)
        self.migrations = Counter(f"{PREFIX}_frontend_migrations_total",
                                  "Requests moved to another worker, by reason: "
                                  "worker-failed-before-output (resent whole), "
                                  "worker-failed-mid-stream (resumed after the tokens "
                                  "already streamed) or worker-drained (handed back at "
                                  "its drain deadline; resumed)", ["reason"], registry=r)
        self.worker_failures = Counter(f"{PREFIX}_frontend_worker_failures_total",
                                       "Worker connections or streams that failed, by "
                                       "whether output had been streamed already",
                                       ["stage"], registry=r)

    def migrated(self, mid_stream: bool, drained: bool = False,
                 stalled: bool = False) -> None:
        """Count one move of a request to another worker."""
        if drained:
            self.migrations.labels("worker-drained").inc()
        elif stalled:
            self.migrations.labels("worker-stalled").inc()
        elif mid_stream:
            self.migrations.labels("worker-failed-mid-stream").inc()
        else:
            self.retries.inc()
            self.migrations.labels("worker-failed-before-output").inc()

    def failed(self, exc: WorkerUnreachable) -> None:
        self.worker_failures.labels("after_output" if exc.produced else "before_output").inc()


class WorkerUnreachable(Exception):
    """The worker could not be reached or its stream broke; ``produced``: output had
    already gone to the client (so the request must not be resent)."""

    def __init__(self, worker_id: int, cause: object, produced: bool = False,
                 drained: bool = False, kv_source: dict | None = None,
                 stalled: bool = False) -> None:
        super().__init__(f"worker {worker_id:x} failed: {cause}")
        self.worker_id = worker_id
        self.produced = produced
        self.drained = drained
        """The worker handed the request back at its drain deadline (a planned move)."""
        self.stalled = stalled
        """Its stream went silent mid-answer (a worker cut off from the network)."""
        self.kv_source = kv_source
        """Where that worker parked the request's KV (live KV moves), if it did."""


class Resumable:
    """A request's first call and the tokens its workers streamed so far.

    Called by the backends for every chunk they pass on; after a worker breaks, the
    request continues on another worker from the prompt plus those tokens.
    """

    def __init__(self, call: WorkerCall) -> None:
        self.first = call
        self.generated: list[int] = []
        self.drained = 0
        """Moves so far because a worker handed the request back at its drain deadline."""

    def seen(self, chunk: dict) -> None:
        self.generated.extend(chunk.get("token_ids") or ())

    @property
    def mid_stream(self) -> bool:
        return bool(self.generated)

    def left(self) -> int:
        """Tokens the request may still produce."""
        return self.first.max_tokens - len(self.generated)

    def continued(self, call: WorkerCall, kv_source: dict | None = None) -> WorkerCall:
        """``call`` continued after the tokens streamed so far; with ``kv_source`` (the
        drained worker kept the KV of all of them but the last) the next worker reads
        that KV instead of recomputing it."""
        return call.resumed(self.first.token_ids, self.generated, self.first.max_tokens,
                            self.first.min_tokens or 0, kv_source)


def final_chunk() -> dict:
    """The end of a request whose worker died right after its last token."""
    return output_chunk([], FinishReason.LENGTH)


def migrate(exc: WorkerUnreachable, resume: Resumable, call: WorkerCall, attempt: int,
            limit: int, metrics: BackendMetrics) -> WorkerCall | None:
    """After ``exc``: the call that moves the request to another worker (resuming after
    the tokens already streamed), or None when it does not move.  Counts the failure and
    the move.  ``attempt``: moves so far.  A worker failure moves it while fewer than
    ``limit`` moves were for failures; a worker that handed it back at its drain deadline
    (a planned move, even with ``limit`` 0: no client should see a scale-down) moves it
    up to ``DRAINED_MOVES`` times."""
    if exc.drained:
        move = resume.drained < DRAINED_MOVES
    else:
        metrics.failed(exc)
        move = attempt - resume.drained < limit
    move = move and resume.left() > 0
    log.warning("%s%s", exc, ("; resuming on another worker after "
                              f"{len(resume.generated)} tokens" if resume.mid_stream
                              else "; retrying on another worker") if move else "")
    if not move:
        return None
    resume.drained += exc.drained
    metrics.migrated(resume.mid_stream, exc.drained, exc.stalled)
    return resume.continued(call, exc.kv_source) if resume.mid_stream else call
