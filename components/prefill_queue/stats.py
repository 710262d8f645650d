"""Counters of one queue client, as plain data; adapters export them as metrics."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class PrefillQueueStats:
    """Monotonic counters since the client started; read them, never reset them.

    Producer side: ``enqueued``, ``rejected_full``, ``rejected_unavailable``.
    Consumer side: ``delivered`` (every delivery pulled, including redeliveries and
    dropped ones), ``redelivered`` (deliveries with a delivery count above 1), ``expired``
    (acked and dropped past their deadline), ``malformed`` (terminated as unreadable),
    ``acked``, ``naked``, ``terminated`` (all terms, malformed included),
    ``pull_timeouts`` (pull requests the server did not answer within
    ``request_timeout_s``: that scan stopped there, and any late answer is redelivered),
    ``stolen`` (jobs taken from another worker's own queue after ``steal_after_s``) and
    ``dropped_by_reason`` (``expired``, ``unknown-version``, ``bad-shape``).
    """

    enqueued: int = 0
    rejected_full: int = 0
    rejected_unavailable: int = 0
    delivered: int = 0
    redelivered: int = 0
    expired: int = 0
    malformed: int = 0
    acked: int = 0
    naked: int = 0
    terminated: int = 0
    pull_timeouts: int = 0
    stolen: int = 0
    dropped_by_reason: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, int]:
        """Flat snapshot for metrics export: counter name -> value, drops as ``dropped_<reason>``."""
        out = {k: v for k, v in vars(self).items() if isinstance(v, int)}
        for reason, n in sorted(self.dropped_by_reason.items()):
            out[f"dropped_{reason.replace('-', '_')}"] = n
        return out
