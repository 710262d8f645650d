"""Messages between components.

Workers speak Dynamo's engine protocol (the shape of Dynamo's ``PreprocessedRequest`` and
``LLMEngineOutput``), so our torch worker, Dynamo's mocker, and SGLang / TensorRT-LLM
workers are interchangeable behind the router, and Dynamo's own frontend can drive our
workers in side-by-side benchmarks.  Fields this project adds travel in
``extra_args["splitserve"]`` (a versioned dict) which other engines ignore.

Router calls are this project's own small, versioned messages.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

PROTOCOL_VERSION = 1

FinishReason = Literal["eos", "length", "stop", "error", "cancelled"]


class StopConditions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    max_tokens: int | None = None
    stop: list[str] | None = None
    stop_token_ids_hidden: list[int] | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None


class SamplingOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None


class RequestMeta(BaseModel):
    """This project's per-request fields, carried in ``extra_args['splitserve']``."""

    model_config = ConfigDict(extra="ignore")
    version: int = PROTOCOL_VERSION
    request_id: str = ""
    priority: str = "default"
    prefill_locally: bool = False


class WorkerRequest(BaseModel):
    """What a worker's ``generate`` endpoint receives (Dynamo PreprocessedRequest shape)."""

    model_config = ConfigDict(extra="ignore")
    model: str = ""
    token_ids: list[int]
    stop_conditions: StopConditions = Field(default_factory=StopConditions)
    sampling_options: SamplingOptions = Field(default_factory=SamplingOptions)
    eos_token_ids: list[int] = Field(default_factory=list)
    annotations: list[str] = Field(default_factory=list)
    extra_args: dict[str, Any] | None = None

    def meta(self) -> RequestMeta:
        raw = (self.extra_args or {}).get("splitserve") or {}
        return RequestMeta.model_validate(raw)


def worker_request(*, model: str, token_ids: list[int], max_tokens: int,
                   temperature: float | None, top_p: float | None, seed: int | None,
                   eos_token_ids: list[int], request_id: str, priority: str) -> dict[str, Any]:
    """Build the dict sent to a worker (plain dict: it goes straight onto the wire)."""
    return {
        "model": model,
        "token_ids": token_ids,
        "stop_conditions": {"max_tokens": max_tokens},
        "sampling_options": {"temperature": temperature, "top_p": top_p, "seed": seed},
        "eos_token_ids": eos_token_ids,
        "annotations": [],
        "extra_args": {"splitserve": {"version": PROTOCOL_VERSION, "request_id": request_id,
                                      "priority": priority}},
    }


def output_chunk(token_ids: list[int], finish_reason: FinishReason | None = None,
                 *, prompt_tokens: int | None = None, cached_tokens: int | None = None,
                 completion_tokens: int | None = None, error: str | None = None
                 ) -> dict[str, Any]:
    """One streamed item of a worker's answer (Dynamo LLMEngineOutput shape)."""
    out: dict[str, Any] = {"token_ids": token_ids}
    if finish_reason is not None:
        out["finish_reason"] = finish_reason
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


class RouteReply(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int = PROTOCOL_VERSION
    worker_id: int | None
    reason: str
    decision: dict[str, Any] | None = None
    endpoint: str = ""
    """Endpoint path of the chosen worker (``ns.component.generate``)."""
    class_name: str = "default"
    retry_after_s: int | None = None
    """Set on a QoS rejection: answer 503 with this Retry-After."""
    max_tokens: int | None = None
    """Set when admission capped the generation limit (graceful degradation)."""
    prefill_locally: bool = False
    """Set when admission asks the decode worker not to offload this prefill."""
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


def load_subject(namespace: str, component: str) -> str:
    """NATS subject on which the workers of ``component`` publish WorkerLoad."""
    return f"splitserve.{namespace}.{component.lower()}.load"
