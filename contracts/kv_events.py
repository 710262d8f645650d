"""Reading a worker's KV events and load metrics straight off NATS.

Dynamo 1.6.1's Python wheel exposes ``RadixTree`` but not ``KvIndexer``; a process that
wants its own prefix index (our router) subscribes to the worker endpoint's event
subjects and feeds the tree itself.  Every message on these subjects is a msgpack
envelope ``{publisher_id, sequence, published_at, topic, payload}`` whose ``payload`` is
itself msgpack: a list of KV events for ``kv-events``, one dict for the metric topics.
See docs/mocker.md for the field lists.
"""

from __future__ import annotations

from typing import Any

import msgspec

KV_EVENTS = "kv-events"
KV_METRICS = "kv_metrics"
FORWARD_PASS_METRICS = "forward-pass-metrics"


def event_subject(namespace: str, component: str, topic: str,
                  endpoint: str = "generate") -> str:
    """NATS subject a worker endpoint publishes ``topic`` on."""
    return f"namespace.{namespace}.component.{component}.endpoint.{endpoint}.{topic}"


def decode_envelope(data: bytes) -> tuple[str, Any]:
    """Return (topic, decoded payload) of one event-plane message."""
    env = msgspec.msgpack.decode(data)
    return env["topic"], msgspec.msgpack.decode(env["payload"])


def apply_kv_events(tree: Any, events: list[dict]) -> int:
    """Apply a decoded ``kv-events`` payload to a ``dynamo.llm.RadixTree``.

    ``RadixTree.apply_event`` takes the JSON of the inner ``event`` object
    (``{event_id, data: {stored|removed|cleared: ...}}``) and the publishing worker's
    id.  Returns how many events were applied.
    """
    encode = msgspec.json.encode  # ~10x json.dumps on the long block lists of stored events
    for ev in events:
        tree.apply_event(int(ev["worker_id"]), encode(ev["event"]))
    return len(events)
