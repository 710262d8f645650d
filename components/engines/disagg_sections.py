"""Fields shared by the DecodeWorker / PrefillWorker sections of every engine.

The offload policy, the prefill queue and the waits mean the same for torch, the mocker,
vLLM, SGLang and TensorRT-LLM, so one YAML shape fits all; each engine's section adds
its ``engine_args`` (and torch its NIXL agent config).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from splitserve.components.prefill_queue.config import PrefillQueueConfig
from splitserve.components.worker.config import WorkerCommon


class EngineDecodeSection(WorkerCommon):
    """Common fields of a decode worker (which runs the offload decider)."""

    disaggregated_router: dict[str, Any] = Field(
        default_factory=lambda: {"enable": True},
        description="The offload policy (`enable`, `decider`: score | threshold | forced, "
        "and the decider's parameters); the seed's score-based YAML loads as written.")
    remote_prefill_timeout_s: float = Field(
        30.0, gt=0, description="How long to wait for a remote prefill's handoff before "
        "prefilling locally (engines that can) or answering 503 (engines that cannot).")
    no_prefill_worker_wait_s: float = Field(
        5.0, ge=0, description="An engine that cannot prefill locally: how long a request "
        "waits for a live prefill worker before it is answered 503 with Retry-After.")
    retry_after_s: float = Field(
        2.0, gt=0, description="Retry-After of that 503 (seconds).")
    prefill_queue: PrefillQueueConfig = Field(default_factory=PrefillQueueConfig)

    @field_validator("disaggregated_router")
    @classmethod
    def _policy_is_valid(cls, v: dict[str, Any]) -> dict[str, Any]:
        from splitserve.components.disagg import parse_disaggregated_router

        parse_disaggregated_router(v)  # raises with the field path; value unchanged
        return v


class EnginePrefillSection(WorkerCommon):
    """Common fields of a prefill worker."""

    max_concurrent_jobs: int = Field(8, ge=1, description="Prefill jobs in flight at once "
                                     "(the engine batches their prompts).")
    prefill_queue: PrefillQueueConfig = Field(default_factory=PrefillQueueConfig)
