"""Config sections of the disaggregated workers: `DecodeWorker:` and `PrefillWorker:`.

Each section's ``engine`` key picks its model, like the Worker section: ``torch`` (the
CPU reference engine, real KV moved over NIXL; the default) or ``mocker`` (Dynamo's
simulated engines behind this project's decider and prefill queue; docs/mocker.md).
``DecodeWorkerConfig`` / ``PrefillWorkerConfig`` are the selectors the catalog uses.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from splitserve.components.engines.sglang.sections import (
    SglangDecodeWorkerConfig,
    SglangPrefillWorkerConfig,
)
from splitserve.components.engines.trtllm.sections import (
    TrtllmDecodeWorkerConfig,
    TrtllmPrefillWorkerConfig,
)
from splitserve.components.kv_transfer.config import KvTransferConfig
from splitserve.components.mocker_worker.disagg_config import (
    MockerDecodeWorkerConfig,
    MockerPrefillWorkerConfig,
)
from splitserve.components.prefill_queue.config import PrefillQueueConfig
from splitserve.serve.config import SelectedBy

from .config import TorchEngineArgs, WorkerCommon


class TorchDecodeWorkerConfig(WorkerCommon):
    """A torch decode worker that runs the disaggregated router for each new request."""

    engine: Literal["torch"] = "torch"
    engine_args: TorchEngineArgs = Field(default_factory=TorchEngineArgs)
    disaggregated_router: dict[str, Any] = Field(
        default_factory=lambda: {"enable": True},
        description="The offload policy (`enable`, `decider`: score | threshold | forced, "
        "and the decider's parameters); the seed's score-based YAML loads as written.")
    remote_prefill_timeout_s: float = Field(
        30.0, gt=0, description="How long to wait for a remote prefill's KV before "
        "prefilling locally instead.")
    prefill_queue: PrefillQueueConfig = Field(default_factory=PrefillQueueConfig)
    kv_transfer: KvTransferConfig = Field(default_factory=KvTransferConfig)

    @field_validator("disaggregated_router")
    @classmethod
    def _policy_is_valid(cls, v: dict[str, Any]) -> dict[str, Any]:
        from splitserve.components.disagg import parse_disaggregated_router

        parse_disaggregated_router(v)  # raises with the field path; value unchanged
        return v


class TorchPrefillWorkerConfig(WorkerCommon):
    """A torch prefill worker: pulls prefill jobs and writes KV into decode workers."""

    engine: Literal["torch"] = "torch"
    engine_args: TorchEngineArgs = Field(default_factory=TorchEngineArgs)
    max_concurrent_jobs: int = Field(4, ge=1, description="Prefill jobs run at once (the "
                                     "engine batches their prompts).")
    prefill_queue: PrefillQueueConfig = Field(default_factory=PrefillQueueConfig)
    kv_transfer: KvTransferConfig = Field(default_factory=KvTransferConfig)


DecodeWorkerConfig = SelectedBy(
    "engine", {"torch": TorchDecodeWorkerConfig, "mocker": MockerDecodeWorkerConfig,
               "sglang": SglangDecodeWorkerConfig, "trtllm": TrtllmDecodeWorkerConfig}, "torch")
PrefillWorkerConfig = SelectedBy(
    "engine", {"torch": TorchPrefillWorkerConfig, "mocker": MockerPrefillWorkerConfig,
               "sglang": SglangPrefillWorkerConfig, "trtllm": TrtllmPrefillWorkerConfig},
    "torch")
