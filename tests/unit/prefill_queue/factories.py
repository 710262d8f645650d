"""Small factories for prefill-queue unit tests."""

from __future__ import annotations

from typing import Any

from splitserve.components.prefill_queue import PrefillRequest


BLOCK_FIELDS = ("nixl_agent", "block_ids", "block_size")


def request_fields(**over: Any) -> dict[str, Any]:
    """A valid PrefillRequest as a dict: 40 tokens into three 16-token blocks of a decode
    worker that takes pushed KV (``nixl_agent``, ``block_ids`` and ``block_size`` given
    here go into its ``destination``, which follows ``num_cached_tokens``)."""
    dest: dict[str, Any] = {"nixl_agent": "decode-0-agent", "block_ids": [4, 5, 6],
                            "block_size": 16}
    dest.update({k: over.pop(k) for k in BLOCK_FIELDS if k in over})
    fields: dict[str, Any] = {
        "request_id": "r1", "token_ids": list(range(1, 41)), "decode_worker_id": "decode-0",
        "destination": dest, "enqueued_at": 1000.0, "max_wait_s": 2.0}
    fields.update(over)
    if fields["destination"] is dest:
        dest["num_cached_tokens"] = fields.get("num_cached_tokens", 0)
    return fields


def version_1_fields(**over: Any) -> dict[str, Any]:
    """The same job as a decode worker of the release before wrote it (version 1: the
    blocks at the top level, and a handoff subject)."""
    fields = request_fields(handoff_subject="ns.decode.handoff.0")
    dest = fields.pop("destination")
    fields.update({k: dest[k] for k in BLOCK_FIELDS}, version=1)
    fields.update(over)
    return fields


def make_request(**over: Any) -> PrefillRequest:
    return PrefillRequest.model_validate(request_fields(**over))


class FakeJob:
    """A delivered prefill job as the prefill loop sees it (``make_request``'s request),
    recording how it was settled."""

    def __init__(self, **request_fields) -> None:
        self.request = make_request(**request_fields)
        self.delivery_count = 1
        self.settled: list[str] = []

    async def ack(self) -> None:
        self.settled.append("ack")

    async def nak(self, delay_s: float | None = None) -> None:
        self.settled.append("nak")

    async def term(self, reason: str = "terminated") -> None:
        self.settled.append(f"term:{reason}")

    async def in_progress(self) -> None:
        pass
