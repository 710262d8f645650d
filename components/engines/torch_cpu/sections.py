"""Config sections with ``engine: torch`` (the CPU reference engine, serving the graph's
``Common.model`` of the Llama family): Worker, DecodeWorker and PrefillWorker.  ``SECTIONS`` is what the engine
registry reads."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from splitserve.contracts.models import StrictModel
from splitserve.components.engines.torch_cpu.kv_transfer.config import KvTransferConfig
from splitserve.contracts.sections import (
    EngineDecodeSection,
    EnginePrefillSection,
    WorkerCommon,
)


class TorchEngineArgs(StrictModel):
    """Arguments of the CPU reference engine."""

    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV block.")
    num_blocks: int = Field(1024, ge=4, description="KV blocks in the pool, each holding "
                            "every layer's K and V in float32 (layers x 2 x KV heads x head "
                            "dim x 4 bytes per token: 46 KB for SmolLM2-135M, so 1024 blocks "
                            "of 16 tokens is about 750 MB).")
    max_num_seqs: int = Field(32, ge=1, description="Requests decoded together per step.")
    # Defaults from benchmarks/bench_chunked_prefill.py (a running decode, a 3,000-token
    # prompt and seven short requests): 2048/none gave the short requests 16.4 s and the
    # decode a 9.9 s pause; 256/128 gave 0.75 s and 0.44 s, and the long prompt finished
    # sooner (7.1 s against 16.2 s).
    max_prefill_tokens: int = Field(256, ge=16, description="Prompt tokens prefilled per "
                                    "step; longer prompts are chunked.")
    max_chunk_tokens: int | None = Field(128, ge=16, description="Prompt tokens of one "
                                         "request prefilled per step (None: "
                                         "max_prefill_tokens); smaller leaves room in each "
                                         "step for other prompts and keeps running decodes "
                                         "moving.")
    max_loras: int = Field(4, ge=1, description="LoRA adapters loaded at the same time "
                           "(load_lora); one more is refused until one is unloaded. Only "
                           "the rows of requests using an adapter pay for it.")
    max_lora_rank: int = Field(64, ge=1, description="Highest LoRA rank (r) an adapter may "
                               "have to be loaded; a higher one is refused by name.")
    threads: int | None = Field(None, ge=1, description="torch intra-op threads; default: "
                                "OMP_NUM_THREADS when set, else the usable cores divided "
                                "among this component's replicas.")
    host_kv_cache_gib: float = Field(0.0, ge=0, allow_inf_nan=False, description="KV "
                                     "offload to host memory, GiB (0: off): prefix blocks "
                                     "evicted from the pool are kept here and copied back "
                                     "instead of recomputed (docs/kv_tiers.md).")
    disk_kv_cache_dir: str | None = Field(None, description="Directory of the disk KV "
                                          "tier (needed when disk_kv_cache_gib > 0).")
    disk_kv_cache_gib: float = Field(0.0, ge=0, allow_inf_nan=False, description="KV "
                                     "offload to disk, GiB (0: off): the blocks the host "
                                     "tier (or the pool) evicts.")

    @model_validator(mode="after")
    def _disk_tier_has_a_directory(self) -> TorchEngineArgs:
        if (self.disk_kv_cache_gib > 0) != bool(self.disk_kv_cache_dir):
            raise ValueError("disk_kv_cache_gib > 0 and disk_kv_cache_dir go together: "
                             f"got {self.disk_kv_cache_gib} and {self.disk_kv_cache_dir!r}")
        return self


class KvMovesFields(StrictModel):
    """Live KV moves (``components/worker/kv_moves.py``), for the replicas that decode."""

    kv_moves: bool = Field(
        False, description="Live KV moves: a request this worker's drain does not finish "
        "keeps its KV here, and the worker that continues it reads the KV over NIXL "
        "instead of recomputing the prompt and the tokens so far (a recompute when the "
        "move fails). An aggregated replica then gets a NIXL agent (kv_transfer).")
    kv_move_hold_s: float = Field(
        15.0, gt=0, description="How long a drained replica keeps a request's KV for the "
        "worker that continues it; then it frees it and stops.")


class TorchWorkerConfig(KvMovesFields, WorkerCommon):
    """A worker running the CPU reference engine."""

    engine: Literal["torch"] = "torch"
    engine_args: TorchEngineArgs = Field(default_factory=TorchEngineArgs)
    kv_transfer: KvTransferConfig = Field(default_factory=KvTransferConfig)


class TorchDecodeWorkerConfig(KvMovesFields, EngineDecodeSection):
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


SECTIONS = {"agg": TorchWorkerConfig, "decode": TorchDecodeWorkerConfig,
            "prefill": TorchPrefillWorkerConfig}
