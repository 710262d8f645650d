"""Small factories for prefill-queue unit tests."""

from __future__ import annotations

from typing import Any

from splitserve.components.prefill_queue import PrefillRequest


def request_fields(**over: Any) -> dict[str, Any]:
    """A valid PrefillRequest as a dict: 40 tokens into three 16-token blocks."""
    fields: dict[str, Any] = {
        "request_id": "r1", "token_ids": list(range(1, 41)), "decode_worker_id": "decode-0",
        "nixl_agent": "decode-0-agent", "block_ids": [4, 5, 6], "block_size": 16,
        "enqueued_at": 1000.0, "max_wait_s": 2.0}
    fields.update(over)
    return fields


def make_request(**over: Any) -> PrefillRequest:
    return PrefillRequest.model_validate(request_fields(**over))
