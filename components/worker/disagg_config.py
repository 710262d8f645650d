"""Config sections of the disaggregated workers: `DecodeWorker:` and `PrefillWorker:`.

Each section's ``engine`` key picks its model, like the Worker section: ``torch`` (the
CPU reference engine, real KV moved over NIXL; the default) or ``mocker`` (Dynamo's
simulated engines behind this project's decider and prefill queue; docs/mocker.md).
``DecodeWorkerConfig`` / ``PrefillWorkerConfig`` are the selectors the catalog uses.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from splitserve.components.engines.disagg_sections import (
    EngineDecodeSection,
    EnginePrefillSection,
)
from splitserve.components.engines.sglang.sections import (
    SglangDecodeWorkerConfig,
    SglangPrefillWorkerConfig,
)
from splitserve.components.engines.trtllm.sections import (
    TrtllmDecodeWorkerConfig,
    TrtllmPrefillWorkerConfig,
)
from splitserve.components.engines.vllm.sections import (
    VllmDecodeWorkerConfig,
    VllmPrefillWorkerConfig,
)
from splitserve.components.kv_transfer.config import KvTransferConfig
from splitserve.components.mocker_worker.disagg_config import (
    MockerDecodeWorkerConfig,
    MockerPrefillWorkerConfig,
)
from splitserve.serve.config import SelectedBy

from .config import TorchEngineArgs


class TorchDecodeWorkerConfig(EngineDecodeSection):
    """A torch decode worker that runs the disaggregated router for each new request."""

    engine: Literal["torch"] = "torch"
    engine_args: TorchEngineArgs = Field(default_factory=TorchEngineArgs)
    kv_transfer: KvTransferConfig = Field(default_factory=KvTransferConfig)


class TorchPrefillWorkerConfig(EnginePrefillSection):
    """A torch prefill worker: pulls prefill jobs and writes KV into decode workers."""

    engine: Literal["torch"] = "torch"
    engine_args: TorchEngineArgs = Field(default_factory=TorchEngineArgs)
    max_concurrent_jobs: int = Field(4, ge=1, description="Prefill jobs run at once (the "
                                     "engine batches their prompts).")
    kv_transfer: KvTransferConfig = Field(default_factory=KvTransferConfig)


DecodeWorkerConfig = SelectedBy(
    "engine", {"torch": TorchDecodeWorkerConfig, "mocker": MockerDecodeWorkerConfig,
               "vllm": VllmDecodeWorkerConfig, "sglang": SglangDecodeWorkerConfig,
               "trtllm": TrtllmDecodeWorkerConfig}, "torch")
PrefillWorkerConfig = SelectedBy(
    "engine", {"torch": TorchPrefillWorkerConfig, "mocker": MockerPrefillWorkerConfig,
               "vllm": VllmPrefillWorkerConfig, "sglang": SglangPrefillWorkerConfig,
               "trtllm": TrtllmPrefillWorkerConfig}, "torch")
