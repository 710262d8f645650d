"""Messages between components.

Workers speak Dynamo's engine protocol (the shape of Dynamo's ``PreprocessedRequest`` and
``LLMEngineOutput``), so our torch worker, Dynamo's mocker, and SGLang / TensorRT-LLM
workers are interchangeable behind the router, and Dynamo's own frontend can drive our
workers in side-by-side benchmarks.  Fields this project adds travel in
``extra_args["splitserve"]`` (a versioned dict) which other engines ignore.

Router calls are this project's own small, versioned messages.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

PROTOCOL_VERSION = 1


class FinishReason(StrEnum):
    """Why a request ended: the project's one finish vocabulary.

    Engines end their deltas with it (``TokenDelta.finish_reason``: each engine adapter
    maps its engine's own reasons into it once, in its folder), the worker shells count
    and send it, and a wire chunk's ``finish_reason`` is its value, which is Dynamo's
    ``LLMEngineOutput`` string (so Dynamo's mocker and frontend read ours and we read
    theirs).  The frontend maps it once to OpenAI's strings
    (``components/frontend/responses.py``'s ``openai_finish_reason``).
    """

    EOS = "eos"
    """A stop token ended it: the model's end-of-sequence or one the request named."""
    STOP = "stop"
    """A stop string matched (engines that match text, and the frontend's own check)."""
    LENGTH = "length"
    """The token limit (``max_tokens``, or the context's end) was reached."""
    CANCELLED = "cancelled"
    """Aborted before its end: the client left, the engine or its drain dropped it."""
    ERROR = "error"
    """The engine failed the request."""

    @classmethod
    def from_wire(cls, raw: str) -> FinishReason:
        """A wire chunk's (non-empty) finish reason.  A value outside this vocabulary
        (an engine speaking a later Dynamo release) ended the request normally: it
        reads as ``EOS``, which the frontend answers ``stop``, as it always has."""
        try:
            return cls(raw)
        except ValueError:
            return cls.EOS


class StopConditions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    max_tokens: int | None = None
    stop: list[str] | None = None
    stop_token_ids_hidden: list[int] | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None


class SamplingOptions(BaseModel):
    """How the next token is chosen (Dynamo's SamplingOptions fields, plus ``logit_bias``).

    None means the engine's neutral value: no penalty, no bias, no top-k / min-p cut.
    """

    model_config = ConfigDict(extra="ignore")
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    """Token id -> bias added to its logit before sampling (OpenAI's range -100..100)."""
    guided_decoding: GuidedDecoding | None = None


class GuidedDecoding(BaseModel):
    """Structured output (Dynamo's guided-decoding options): the output must be JSON valid
    against ``json`` (a JSON schema; ``{"type": "object"}`` for any object)."""

    model_config = ConfigDict(extra="ignore")
    json_schema: dict[str, Any] | None = Field(None, alias="json")


class OutputOptions(BaseModel):
    """What a worker returns beside the tokens (Dynamo's OutputOptions fields)."""

    model_config = ConfigDict(extra="ignore")
    logprobs: int | None = None
    """Return each sampled token's log-probability and this many most likely
    alternatives (0: the sampled token's only; None: no log-probabilities)."""
    prompt_logprobs: int | None = None
    """Return the log-probability of every prompt token after the first (and this many
    alternatives at each position); None: none."""


class KvSource(BaseModel):
    """Where a moved request's KV waits: the drained replica that parked it, under which
    request id, and how many of the request's tokens it holds (all but the last)."""

    model_config = ConfigDict(extra="ignore")
    worker_id: int
    request_id: str = Field(min_length=1)
    tokens: int = Field(ge=1)


class RequestMeta(BaseModel):
    """This project's per-request fields, carried in ``extra_args['splitserve']``."""

    model_config = ConfigDict(extra="ignore")
    version: int = PROTOCOL_VERSION
    request_id: str = ""
    priority: str = "default"
    """The request's priority class name (the one the router resolved, when a router
    placed it)."""
    priority_level: int | None = Field(None, ge=0)
    """That class's level in the router's priority table (``contracts/priority.py``;
    0 = most important).  None: no router ranked it; the worker ranks ``priority``
    by the built-in table under that module's rule."""
    prefill_locally: bool = False
    kv_source: KvSource | None = None
    """Set by the frontend when the request continues after a drain whose replica kept
    its KV: the worker reads the KV from there instead of recomputing it."""
    lora: str | None = None
    """The LoRA adapter the request is served with (``worker_request``'s ``lora``);
    None: the base model."""
    tpot_ms: float | None = Field(None, gt=0)
    """The TPOT target of the request's QoS class (set by the router that placed it): a
    decode worker keeps local prefills from stalling the answer past it."""


class WorkerRequest(BaseModel):
    """What a worker's ``generate`` endpoint receives (Dynamo PreprocessedRequest shape)."""

    model_config = ConfigDict(extra="ignore")
    model: str = ""
    token_ids: list[int]
    stop_conditions: StopConditions = Field(default_factory=StopConditions)
    sampling_options: SamplingOptions = Field(default_factory=SamplingOptions)
    output_options: OutputOptions = Field(default_factory=OutputOptions)
    eos_token_ids: list[int] = Field(default_factory=list)
    annotations: list[str] = Field(default_factory=list)
    extra_args: dict[str, Any] | None = None

    def meta(self) -> RequestMeta:
        raw = (self.extra_args or {}).get("splitserve") or {}
        return RequestMeta.model_validate(raw)


def worker_request(*, model: str, token_ids: list[int], max_tokens: int,
                   temperature: float | None, top_p: float | None, seed: int | None,
                   eos_token_ids: list[int], request_id: str, priority: str,
                   sampling: dict[str, Any] | None = None, min_tokens: int | None = None,
                   output: dict[str, Any] | None = None,
                   lora: str | None = None) -> dict[str, Any]:
    """Build the dict sent to a worker (plain dict: it goes straight onto the wire).

    ``sampling`` holds further SamplingOptions fields and ``output`` OutputOptions
    fields; both are left off the wire when empty, so engines that predate them see the
    request they always saw.  ``lora``: the adapter to apply (the name the worker loaded
    it under), carried as ``extra_args.splitserve.lora`` only when set."""
    stop: dict[str, Any] = {"max_tokens": max_tokens}
    if min_tokens:
        stop["min_tokens"] = min_tokens
    req: dict[str, Any] = {
        "model": model,
        "token_ids": token_ids,
        "stop_conditions": stop,
        "sampling_options": {"temperature": temperature, "top_p": top_p, "seed": seed,
                             **(sampling or {})},
        "eos_token_ids": eos_token_ids,
        "annotations": [],
        "extra_args": {"splitserve": {"version": PROTOCOL_VERSION, "request_id": request_id,
                                      "priority": priority}},
    }
    if output:
        req["output_options"] = output
    if lora is not None:
        req["extra_args"]["splitserve"]["lora"] = lora
    return req


def chunk_data(item: Any) -> Any:
    """The payload of a response item from Dynamo's client (annotated or plain)."""
    data = getattr(item, "data", item)
    return data() if callable(data) else data


KV_SOURCE = "kv_source"
"""The request meta field that names a drained worker's parked KV
(``RequestMeta.kv_source``)."""


DRAINED = "drained"
"""Key of the last chunk a worker sends for a request its drain did not finish: no
finish reason, the frontend resumes the request elsewhere (a planned move, not a
failure: it does not use up the request's ``migration_limit``)."""


KV_PARKED = "kv"
"""Key of a drained chunk's ``{"request_id", "tokens"}``: the replica kept the request's
KV for the worker that continues it (live KV moves)."""


def drained_chunk(token_ids: list[int] | None = None,
                  kv: dict[str, Any] | None = None) -> dict[str, Any]:
    """The end of a stream cut by its worker's drain deadline; ``token_ids``: output the
    engine produced that had not been sent yet; ``kv``: where the replica parked the
    request's KV."""
    chunk: dict[str, Any] = {"token_ids": list(token_ids or ()), DRAINED: True}
    if kv is not None:
        chunk[KV_PARKED] = kv
    return chunk


def output_chunk(token_ids: list[int], finish_reason: FinishReason | None = None,
                 *, prompt_tokens: int | None = None, cached_tokens: int | None = None,
                 completion_tokens: int | None = None, error: str | None = None,
                 logprobs: TokenLogprobs | None = None,
                 prompt_logprobs: TokenLogprobs | None = None) -> dict[str, Any]:
    """One streamed item of a worker's answer (Dynamo LLMEngineOutput shape).

    ``logprobs`` (one entry per token of ``token_ids``) travels as Dynamo's ``log_probs``
    and ``top_logprobs``; ``prompt_logprobs`` (one entry per prompt token after the
    first) only on the first chunk."""
    out: dict[str, Any] = {"token_ids": token_ids}
    if logprobs is not None:
        out["log_probs"] = logprobs.logprobs
        out["top_logprobs"] = logprobs.top
    if prompt_logprobs is not None:
        out["prompt_logprobs"] = {"log_probs": prompt_logprobs.logprobs,
                                  "top_logprobs": prompt_logprobs.top}
    if finish_reason is not None:
        out["finish_reason"] = FinishReason(finish_reason).value
    if prompt_tokens is not None:
        out["completion_usage"] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens or 0,
            "total_tokens": prompt_tokens + (completion_tokens or 0),
            "prompt_tokens_details": {"cached_tokens": cached_tokens or 0},
        }
    if error is not None:
        out["error"] = error
    return out


# A log-probability the engine could not give (a token sampled elsewhere, a banned
# token): OpenAI's value for it, since JSON has no -inf or NaN.
NO_LOGPROB = -9999.0


class TokenLogprobs(BaseModel):
    """Log-probabilities of a run of tokens: for each token its own, and its position's
    most likely tokens as ``[[token_id, logprob], ...]`` (best first)."""

    model_config = ConfigDict(extra="ignore")
    logprobs: list[float] = Field(default_factory=list)
    top: list[list[tuple[int, float]]] = Field(default_factory=list)


def chunk_logprobs(chunk: dict[str, Any]) -> TokenLogprobs | None:
    """The sampled tokens' log-probabilities of a worker chunk, if it carries them."""
    if chunk.get("log_probs") is None:
        return None
    return TokenLogprobs(logprobs=chunk["log_probs"], top=chunk.get("top_logprobs") or [])


def chunk_prompt_logprobs(chunk: dict[str, Any]) -> TokenLogprobs | None:
    """The prompt's log-probabilities of a worker chunk, if it carries them."""
    raw = chunk.get("prompt_logprobs")
    if raw is None:
        return None
    return TokenLogprobs(logprobs=raw["log_probs"], top=raw.get("top_logprobs") or [])


# ---- router calls -----------------------------------------------------------------------

class RouteCall(BaseModel):
    """Frontend → router: pick a worker for this request (or only explain the choice)."""

    model_config = ConfigDict(extra="forbid")
    version: int = PROTOCOL_VERSION
    request_id: str
    token_ids: list[int]
    priority: str | None = None
    """The priority header's value as the client sent it (None: no header)."""
    user: str | None = None
    metadata: dict[str, str] | None = None
    max_tokens: int = 1
    explain: bool = False
    record: bool = True
    failed_workers: list[int] = []
    """Workers this request could not reach (a retry): the router marks them down."""
    lora: str | None = None
    """The LoRA adapter the request is served with (None: the base model): its prefix
    hashes are keyed by it and only workers that report it loaded may take it."""
    waited_ms: float = Field(default=0.0, ge=0)
    """How long the request has been in the frontend already (parsing, tokenising, a
    busy event loop, earlier placements of a retry): part of its client's TTFT, so
    admission counts it in every TTFT prediction."""


class RouteReply(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int = PROTOCOL_VERSION
    worker_id: int | None
    reason: str
    decision: dict[str, Any] | None = None
    endpoint: str = ""
    """Endpoint path of the chosen worker (``ns.component.generate``)."""
    class_name: str = "default"
    class_level: int | None = None
    """``class_name``'s level in the router's priority table (0 = most important),
    which the frontend passes to the worker; None on a refusal."""
    retry_after_s: int | None = None
    """Set on a QoS rejection: answer 503 with this Retry-After."""
    max_tokens: int | None = None
    """Set when admission capped the generation limit (graceful degradation)."""
    prefill_locally: bool = False
    """Set when admission asks the decode worker not to offload this prefill."""
    tpot_ms: float | None = None
    """The TPOT target of the request's class, which the frontend passes to the worker
    (``RequestMeta.tpot_ms``); None on a refusal."""
    qos: dict[str, Any] | None = None


class RouterStatus(BaseModel):
    """Router → frontend (its `status` endpoint): the workers it would route to now."""

    model_config = ConfigDict(extra="forbid")
    version: int = PROTOCOL_VERSION
    workers: list[int]
    """Live, reachable, not draining: a request routed now goes to one of these."""
    endpoint: str = ""
    """Endpoint path of those workers (``ns.component.generate``)."""


class ReleaseCall(BaseModel):
    """Frontend → router: the request finished; its load leaves the worker."""

    model_config = ConfigDict(extra="forbid")
    version: int = PROTOCOL_VERSION
    request_id: str
    worker_id: int
    outcome: str = "ok"
    """ok, cancelled, error, or unreachable (the worker could not be reached: the router
    marks it down)."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    duration_s: float | None = None


PROGRESS_BATCH_MAX = 4096
"""Reports in one ``ProgressBatch`` at most (the frontend sends the rest in the next)."""


class ProgressReport(BaseModel):
    """One placed request's output so far, as the frontend streamed it."""

    model_config = ConfigDict(extra="forbid")
    request_id: str
    worker_id: int
    """The worker it streams from: a report from a worker the request is no longer placed
    on (it migrated) is ignored."""
    tokens: int = Field(ge=1)
    """Output tokens streamed from this placement so far."""
    age_s: float = Field(ge=0, le=3600)
    """How long before the batch was sent the frontend saw them (the router dates the
    report on its own clock: its receipt less this)."""
    first_token: bool = False
    """The request's first token is among them: its prompt is prefilled."""
    progress: bool = False
    """A decode progress report (every few tokens): its pace so far."""
    wake: bool = False
    """Judge the requests the router holds again now (the report teaches a fit)."""


class ProgressBatch(BaseModel):
    """Frontend → router (its ``progress`` endpoint, a few times a second): the first
    tokens and decode progress of the requests that router placed, which the frontend
    routing in process reports to its own routing service directly.  Without them a
    router learns a request's TTFT and TPOT at its release only, and counts its prompt
    as work ahead of later requests until then."""

    model_config = ConfigDict(extra="forbid")
    version: int = PROTOCOL_VERSION
    reports: list[ProgressReport] = Field(max_length=PROGRESS_BATCH_MAX)


class WorkerLoad(BaseModel):
    """Worker → routers (NATS, a few times a second): the worker's own view of its load."""

    model_config = ConfigDict(extra="ignore")
    version: int = PROTOCOL_VERSION
    worker_id: int
    active: int = 0
    waiting: int = 0
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0
    draining: bool = False
    loras: list[str] = Field(default_factory=list)
    """The LoRA adapters loaded on the worker now (engines that serve them)."""
    lora_errors: dict[str, str] = Field(default_factory=dict)
    """Adapters the worker was asked to load and could not: name -> why."""


def load_subject(namespace: str, component: str) -> str:
    """NATS subject on which the workers of ``component`` publish WorkerLoad."""
    return f"splitserve.{namespace}.{component.lower()}.load"
