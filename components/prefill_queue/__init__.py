"""Prefill queue: the NATS JetStream work queue between decode and prefill workers.

Decode workers ``enqueue`` a ``PrefillRequest`` (or get ``QueueFull`` at once) and read
the depth through a ``QueueDepthMonitor``; prefill workers ``pull`` ``PrefillJob``s,
highest priority first, and ack each only after its KV reached the decode worker.
Pure parts (names, message model, triage, priority levels) have no NATS import.
"""

from splitserve.contracts.prefill_queue import PrefillQueueConfig
from .depth import QueueDepth, QueueDepthMonitor
from .enqueue import Enqueued, EnqueueRejected, QueueFull, QueueUnavailable
from .job import PrefillJob
from splitserve.contracts.prefill_job import WIRE_VERSION, PrefillRequest, Triage, priority_level, triage
from .naming import QueueNames, queue_names, sanitise_token
from .nats_queue import PrefillQueue
from .stats import PrefillQueueStats

__all__ = [
    "WIRE_VERSION",
    "EnqueueRejected",
    "Enqueued",
    "PrefillJob",
    "PrefillQueue",
    "PrefillQueueConfig",
    "PrefillQueueStats",
    "PrefillRequest",
    "QueueDepth",
    "QueueDepthMonitor",
    "QueueFull",
    "QueueNames",
    "QueueUnavailable",
    "Triage",
    "priority_level",
    "queue_names",
    "sanitise_token",
    "triage",
]
