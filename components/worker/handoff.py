"""The prefill-result handoff between mocker prefill and decode workers.

Mocker engines move no KV bytes, so where the torch path writes KV over NIXL the mocker
path sends the prefill *result* instead: the prefill worker sends a ``PrefillHandoff``
as a NATS request to the subject named in the job (``handoff_subject``: one per decode
worker replica) and waits for a ``HandoffReply``.  The decode worker answers
``accepted`` only while the request is still waiting for it; the prefill worker acks the
job after any reply, and hands it back (nak) when nobody answers in time.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from splitserve.contracts.prefill_job import json_omitting_defaults

log = logging.getLogger("splitserve.mocker_disagg")

HANDOFF_VERSION = 1


class PrefillHandoff(BaseModel):
    """Prefill worker -> decode worker: one finished prefill (KV "transferred")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1] = Field(default=1, description="Wire format version.")
    request_id: str = Field(min_length=1, description="The prefill job's request id.")
    first_token: int = Field(ge=0, description="The token the prefill engine sampled "
                             "(0 with ``refused``).")
    disaggregated_params: Any = Field(
        default=None, description="The prefill engine's `disaggregated_params`, passed to "
        "the decode engine as `prefill_result.disaggregated_params`.")
    completion_usage: dict[str, Any] | None = Field(
        default=None, description="The prefill chunk's usage (TRT-LLM mockers send one; "
        "its cached_tokens is the prefill worker's prefix hit).")
    prefill_worker_id: str = Field(min_length=1, description="Prefill worker, hex id.")
    compute_s: float = Field(ge=0, description="Engine time to the first token.")
    transfer_s: float = Field(ge=0, description="Simulated KV transfer time (from the "
                              "first token to the end of the prefill stream).")
    finish_reason: str | None = Field(
        default=None, min_length=1, description="Set when the request ended at its first "
        "token (EOS or a stop token; the contracts' FinishReason value): there is no KV "
        "to hand over, and the decode worker answers that token and ends the request. "
        "Written only when set.")
    refused: str | None = Field(
        default=None, min_length=1, description="Set instead of a result when the prefill "
        "engine refused the job itself (its parameters, for this engine): no delivery "
        "could succeed, so the decode worker prefills the request at once instead of "
        "waiting out its timeout. Written only when set.")

    def encode(self) -> bytes:
        """Serialise for the NATS request; called by the prefill worker.  ``refused`` and
        ``finish_reason`` are written only when set, so a decode worker of the release
        before reads every ordinary result."""
        return json_omitting_defaults(self, ("refused", "finish_reason"))


class HandoffReply(BaseModel):
    """Decode worker -> prefill worker: whether the result was taken."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1] = Field(default=1, description="Wire format version.")
    accepted: bool = Field(description="True: the request was waiting and resumes now.")
    reason: str = Field(default="", description="Why not accepted: 'not-waiting', "
                        "'bad-message'.")


def handoff_subject(namespace: str, component: str, worker_id: int) -> str:
    """The NATS subject on which one decode worker replica takes prefill results."""
    return f"splitserve.{namespace}.{component.lower()}.handoff.{worker_id:x}"


def affinity_subject(namespace: str, component: str) -> str:
    """The NATS subject on which a pool's decode workers tell each other where prefill
    jobs went (``prefill_affinity.share``)."""
    return f"splitserve.{namespace}.{component.lower()}.prefill_affinity"


class HandoffInbox:
    """The decode worker's side: futures for requests waiting on a remote prefill.

    ``expect(rid)`` is called before the job is enqueued, so a fast result cannot
    arrive unexpected; ``forget(rid)`` when the request stops waiting (timeout, local
    fallback or cancellation).  ``on_message`` is the NATS subscription callback.
    """

    def __init__(self) -> None:
        self._waiting: dict[str, asyncio.Future[PrefillHandoff]] = {}

    def expect(self, request_id: str) -> asyncio.Future[PrefillHandoff]:
        """Register a waiting request; returns the future its handoff will resolve."""
        fut: asyncio.Future[PrefillHandoff] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = fut
        return fut

    def forget(self, request_id: str) -> None:
        """Stop waiting for ``request_id``; a later handoff is answered 'not-waiting'."""
        fut = self._waiting.pop(request_id, None)
        if fut is not None and not fut.done():
            fut.cancel()

    @property
    def waiting(self) -> int:
        """Requests currently waiting for a prefill result."""
        return len(self._waiting)

    def take(self, data: bytes) -> HandoffReply:
        """Resolve the waiting request named in ``data``; returns the reply to send."""
        try:
            handoff = PrefillHandoff.model_validate_json(data)
        except ValidationError as exc:
            log.warning("unreadable prefill handoff: %s", str(exc).splitlines()[0])
            return HandoffReply(accepted=False, reason="bad-message")
        fut = self._waiting.pop(handoff.request_id, None)
        if fut is None or fut.done():
            return HandoffReply(accepted=False, reason="not-waiting")
        fut.set_result(handoff)
        return HandoffReply(accepted=True)

    async def on_message(self, msg) -> None:
        """nats-py callback: take the handoff and answer on the message's reply subject."""
        reply = self.take(msg.data)
        if msg.reply:
            try:
                await msg.respond(reply.model_dump_json().encode("utf-8"))
            except Exception as exc:  # noqa: BLE001 - the sender then times out and naks
                log.warning("could not answer a prefill handoff: %s", exc)


async def hand_over(nc, subject: str, handoff: PrefillHandoff, timeout_s: float
                    ) -> HandoffReply:
    """Send one result to a decode worker and wait for its reply; called by the prefill
    worker before acking.  Raises nats' NoRespondersError when no decode worker listens
    on ``subject`` and TimeoutError when none answers within ``timeout_s``."""
    import nats.errors

    try:
        msg = await nc.request(subject, handoff.encode(), timeout=timeout_s)
    except nats.errors.TimeoutError as exc:
        raise TimeoutError(f"no reply on {subject} within {timeout_s}s") from exc
    return HandoffReply.model_validate_json(msg.data)
