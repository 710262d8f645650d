"""What ``PrefillQueue.enqueue`` returns, or raises when the request was not queued."""

from __future__ import annotations

from dataclasses import dataclass


class EnqueueRejected(Exception):
    """The request was not queued; the decode worker prefills locally."""

    reason = "rejected"


class QueueFull(EnqueueRejected):
    """The stream is at ``max_msgs`` or ``max_bytes``; answered by the server at once."""

    reason = "full"


class QueueUnavailable(EnqueueRejected):
    """No answer within ``request_timeout_s``, no stream, or no connection."""

    reason = "unavailable"


@dataclass(frozen=True)
class Enqueued:
    """A request the server stored: its stream sequence and priority level."""

    stream_seq: int
    level: int
    duplicate: bool  # the same request id was already stored within duplicate_window_s
