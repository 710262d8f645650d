"""The prefill request on the wire, and the pure decisions about one received message.

A ``PrefillRequest`` crosses processes (decode worker -> queue -> prefill worker), so it is
versioned: a prefill worker that receives a version it does not know terminates the
message instead of guessing.  JSON keeps messages readable with the ``nats`` CLI; a
prompt of 100k tokens is about 600 kB, under NATS's default 1 MB payload limit.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from splitserve.contracts.engine import TorchBlocksHandoff
from splitserve.contracts.priority import DEFAULT_TABLE, PriorityTable

from .prefill_queue import PrefillQueueConfig

WIRE_VERSION = 2
"""Version 2 made the job engine-neutral: version 1 required the decode worker's NIXL
agent, block ids and block size at the top level, which engines that move KV themselves
had to fake.  Version 2 carries them as an optional ``destination``."""
READABLE_VERSIONS = (1, WIRE_VERSION)
"""A version-1 job (from decode workers of the release before) is read as version 2: its
blocks become the ``destination``, which only prefill engines that push KV look at."""
ADDED_FIELDS = ("ignore_eos", "min_tokens", "lora", "top_k", "min_p", "presence_penalty",
                "frequency_penalty", "repetition_penalty", "logit_bias")
"""Optional fields added to version 1 after its first release (see ``encode``)."""
RETIRED_FIELDS = ("trace_id", "parent_span_id")
"""Fields of version 1's first release that nothing ever read: still accepted as null,
because decode workers of that release write them so in every job, never written, and
refused with a value (it would be dropped silently)."""


class PrefillRequest(BaseModel):
    """What a decode worker asks the prefill pool to do for one prompt."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[2] = Field(default=2, description="Wire format version.")
    request_id: str = Field(min_length=1, description="Request id (with the decode worker "
                            "and `enqueued_at`, the dedup key: see ``dedup_key``).")
    priority: StrictInt | StrictStr = Field(
        default="default", description="The request's priority level (0 = highest: its "
        "class's position in the router's priority table), which the queue serves it at "
        "(its last level when past it) and the prefill engine schedules it at; or, from "
        "decode workers of an earlier release, a class name, ranked by the queue's "
        "`priorities`.")
    token_ids: list[int] = Field(min_length=1, description="The full prompt's token ids.")
    num_cached_tokens: int = Field(
        default=0, ge=0, description="Leading prompt tokens whose KV the decode worker "
        "already holds; the prefill worker writes KV only for the rest.")
    decode_worker_id: str = Field(min_length=1, description="Decode worker to notify.")
    destination: TorchBlocksHandoff | None = Field(
        default=None, description="For prefill engines that write KV into blocks the "
        "decode side reserved (capabilities.pushes_kv: torch over NIXL): the decode "
        "worker's agent and block ids for the tokens after `num_cached_tokens`. None for "
        "engines that move KV themselves (vLLM, SGLang, TensorRT-LLM) or have none (the "
        "mocker): their handoff comes back on `handoff_subject`.")
    enqueued_at: float = Field(ge=0, description="Wall-clock time of enqueue (Unix s).")
    max_wait_s: float | None = Field(
        default=None, gt=0, description="The decode worker falls back to local prefill "
        "after this long; a prefill worker that pulls it later drops it.")
    temperature: float = Field(default=0.0, ge=0.0, description="Sampling temperature of "
                               "the request (the prefill worker samples its first token).")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    seed: int | None = Field(default=None, description="Per-request sampling seed.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Tokens that end "
                                      "generation besides the model's EOS.")
    ignore_eos: bool = Field(default=False, description="The request ignores EOS: the "
                             "prefill's one token must not end it before the handoff.")
    min_tokens: int = Field(default=0, ge=0, description="Tokens the request produces "
                            "before a stop token may end it (applies to the prefill's "
                            "first token too).")
    top_k: int = Field(default=0, ge=0, description="The request's top-k (0: off): the "
                       "prefill samples its first token as the decode side would.")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="The request's min-p "
                         "(0: off).")
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="OpenAI's "
                                    "presence penalty (no output yet: it shapes nothing "
                                    "for the first token, and is carried for engines that "
                                    "check it).")
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="OpenAI's "
                                     "frequency penalty (as presence_penalty).")
    repetition_penalty: float = Field(default=1.0, gt=0.0, description="CTRL's repetition "
                                      "penalty over prompt and output (1: off): it shapes "
                                      "the first token through the prompt's tokens.")
    logit_bias: list[tuple[int, float]] = Field(default_factory=list, description="(token "
                                                "id, bias) pairs added to the logits.")
    lora: str | None = Field(
        default=None, min_length=1, description="The LoRA adapter the prompt is computed "
        "with, by the name workers loaded it under; None: the base model. Decode workers "
        "send one only while every live prefill worker reports it loaded (a prefill "
        "worker of an earlier release loads none and reports nothing).")
    handoff_subject: str | None = Field(
        default=None, min_length=1, description="The NATS subject on which the decode "
        "worker waits for the prefill result (its first token and the engine's handoff: "
        "a vLLM transfer, an SGLang bootstrap room, a TensorRT-LLM context result, or the "
        "written blocks); the prefill worker sends it there as a request and acks the job "
        "after the reply. A job without one cannot be handed over and is terminated.")
    trace_id: None = Field(default=None, description="Retired; null only (see "
                           "RETIRED_FIELDS).")
    parent_span_id: None = Field(default=None, description="Retired; null only (see "
                                 "RETIRED_FIELDS).")

    def dedup_key(self) -> str:
        """The publish's ``Nats-Msg-Id``: one enqueue of this job.  A publish of the same
        job retried is stored once; the same request enqueued again (resumed after its
        worker was lost, or resent whole to another decode worker) is a new job, which a
        key of the request id alone would drop as a duplicate while its decode worker
        waited for a result that never came."""
        return f"{self.request_id}@{self.decode_worker_id}@{self.enqueued_at!r}"

    @model_validator(mode="before")
    @classmethod
    def _read_version_1(cls, data: Any) -> Any:
        """A version-1 job as version 2: its top-level blocks become the ``destination``
        (for engines that do not push KV they were placeholders, and such engines never
        read the destination); its ``handoff`` field was never written and stays refused
        with a value."""
        if not isinstance(data, dict) or data.get("version") != 1:
            return data
        data = dict(data, version=WIRE_VERSION)
        blocks = {k: data.pop(k) for k in ("nixl_agent", "block_ids", "block_size")
                  if k in data}
        if data.get("handoff", 0) is None:
            del data["handoff"]
        if blocks:
            data["destination"] = {**blocks,
                                   "num_cached_tokens": data.get("num_cached_tokens", 0)}
        return data

    @model_validator(mode="after")
    def _check_shape(self) -> PrefillRequest:
        # Cross-field checks, after field validation: raise, never adjust.
        if isinstance(self.priority, int) and self.priority < 0:
            raise ValueError(f"an integer priority is a level index >= 0, got {self.priority}")
        if self.num_cached_tokens >= len(self.token_ids):
            raise ValueError(f"num_cached_tokens ({self.num_cached_tokens}) leaves nothing "
                             f"to prefill in {len(self.token_ids)} prompt tokens")
        if self.token_ids and min(self.token_ids) < 0:
            raise ValueError("token ids must be >= 0")
        dest = self.destination
        if dest is None:
            return self
        needed = self.tokens_to_prefill
        if len(dest.block_ids) * dest.block_size < needed:
            raise ValueError(f"{len(dest.block_ids)} blocks of {dest.block_size} tokens "
                             f"cannot hold the {needed} tokens to prefill")
        if any(b < 0 for b in dest.block_ids):
            raise ValueError("block ids must be >= 0")
        if dest.num_cached_tokens != self.num_cached_tokens:
            raise ValueError(f"destination.num_cached_tokens ({dest.num_cached_tokens}) "
                             f"differs from num_cached_tokens ({self.num_cached_tokens})")
        return self

    @property
    def tokens_to_prefill(self) -> int:
        """The prompt less the prefix the decode worker found cached: what the job asks
        its prefill worker to compute (at least 1: the model refuses less)."""
        return len(self.token_ids) - self.num_cached_tokens

    def level(self, table: PriorityTable = DEFAULT_TABLE) -> int:
        """The level the prefill engine schedules this job at: its own, or its class
        name's in ``table`` (``contracts/priority.py``'s rule for a name it lacks)."""
        if isinstance(self.priority, int):
            return self.priority
        return table.level_of(self.priority)

    @property
    def deadline(self) -> float | None:
        """Wall-clock time after which the decode worker no longer waits, or None."""
        return None if self.max_wait_s is None else self.enqueued_at + self.max_wait_s

    def encode(self) -> bytes:
        """Serialise for publishing; called by the adapter on enqueue.  Fields added to
        version 1 later (``ADDED_FIELDS``) are written only when set, so a prefill worker
        of the previous release, which refuses unknown fields, still reads every request
        that does not use them."""
        return json_omitting_defaults(self, ADDED_FIELDS, always=RETIRED_FIELDS)


def json_omitting_defaults(model: BaseModel, optional: Iterable[str],
                           always: Iterable[str] = ()) -> bytes:
    """``model`` as JSON bytes without those of ``optional`` that hold their default and
    without ``always``: fields added to a wire message after its first release are
    written only when set, so a reader of the release before (which refuses unknown
    fields) still reads every message that does not use them."""
    defaults = _defaults(type(model), tuple(optional))
    unset = {k for k, default in defaults.items() if getattr(model, k) == default}
    return model.model_dump_json(exclude=unset | set(always)).encode("utf-8")


@functools.lru_cache(maxsize=64)
def _defaults(cls: type[BaseModel], names: tuple[str, ...]) -> dict[str, object]:
    """The defaults of ``names`` on ``cls``, read once per class: pydantic inspects a
    default factory's signature on every ``get_default`` (a few microseconds per field,
    paid on every enqueue and handoff).  A factory is called once here, so the fields
    so compared have factories that always build the same value."""
    fields = cls.model_fields
    return {k: fields[k].get_default(call_default_factory=True) for k in names}


def priority_level(priority: int | str, config: PrefillQueueConfig) -> int:
    """Return the level (0 = highest) a request is queued at; called on enqueue.

    An integer is the request's level and goes to that level, or to the last one when it
    is past it; a class name is ranked by the queue's table under
    ``contracts/priority.py``'s rule: a name it lacks goes to ``default_priority`` (QoS
    classes are defined elsewhere and may be newer than this queue's configuration, so a
    typo should not drop work).
    """
    table = config.table()
    if isinstance(priority, int):
        return min(max(priority, 0), table.lowest_level)
    return table.level_of(priority)


Verdict = Literal["ok", "expired", "unknown-version", "bad-shape"]


@dataclass(frozen=True)
class Triage:
    """What to do with one received message: work on it (``ok``) or drop it (others)."""

    verdict: Verdict
    request: PrefillRequest | None = None
    detail: str = ""


def triage(data: bytes, now: float) -> Triage:
    """Decide what a prefill worker does with a received payload; called per delivery.

    Returns ``ok`` with the request, ``expired`` (the decode worker has stopped waiting:
    ack and drop), or ``unknown-version`` / ``bad-shape`` (terminate: redelivering a
    message that cannot be read would fail the same way on every worker).
    """
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        return Triage("bad-shape", detail=f"not JSON: {exc}")
    if not isinstance(raw, dict):
        return Triage("bad-shape", detail=f"expected an object, got {type(raw).__name__}")
    if raw.get("version") not in READABLE_VERSIONS:
        return Triage("unknown-version", detail=f"version {raw.get('version')!r}")
    try:
        request = PrefillRequest.model_validate(raw)
    except ValidationError as exc:
        return Triage("bad-shape", detail=str(exc).splitlines()[0])
    deadline = request.deadline
    if deadline is not None and now > deadline:
        return Triage("expired", request, f"{now - deadline:.3f}s past its deadline")
    return Triage("ok", request)
