"""Config section of the mocker-backed Worker component."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from splitserve.contracts.models import StrictModel

# Block sizes the real engines use by default; the mocker picks the same when unset
# (vLLM 64, SGLang 1, TRT-LLM 32).  We always pass one explicitly so routers and
# indexers in other processes can be configured with the same number.
DEFAULT_BLOCK_SIZE = 16


class MockerEngineArgs(StrictModel):
    """`engine_args` of a Worker with `engine: mocker`: one mocker process per replica,
    registered as ``<namespace>.<component>.generate``."""

    engine_type: Literal["sglang", "trtllm", "vllm"] = Field(
        "sglang", description="Which engine's scheduler and KV-cache manager the mocker "
                              "simulates (passed as --engine-type).")
    disaggregation_mode: Literal["agg", "prefill", "decode"] = Field(
        "agg", description="Aggregated worker, prefill-only or decode-only worker. Decode "
                           "workers publish no KV events.")
    workers_per_process: int = Field(1, ge=1, le=256, description="Simulated engines in "
                                     "this one mocker process (--num-workers). 1 keeps "
                                     "replicas = workers; more saves ~175 MiB per extra engine "
                                     "in big fleets.")
    block_size: int = Field(DEFAULT_BLOCK_SIZE, ge=1, le=1024,
                            description="KV block size in tokens; every KV indexer or router "
                                        "reading this worker's events must use the same.")
    num_gpu_blocks: int = Field(16384, ge=1, description="Simulated KV capacity in blocks "
                                "(--num-gpu-blocks-override).")
    speedup_ratio: float = Field(1.0, gt=0, description="Divides every simulated step time; "
                                 "1 is real time, 1000 is effectively no delay. (The mocker "
                                 "treats 0 like 1, so 0 is refused here.)")
    max_num_seqs: int = Field(256, ge=1, description="Maximum sequences per scheduler step.")
    max_num_batched_tokens: int = Field(8192, ge=1,
                                        description="Maximum tokens per scheduler step.")
    enable_prefix_caching: bool = Field(True, description="Keep finished requests' blocks "
                                        "for reuse (and publish KV events about them).")
    kv_transfer_bandwidth: float | None = Field(
        None, ge=0, description="Simulated KV transfer bandwidth in GB/s for disaggregated "
                                "modes; None keeps the mocker's default, 0 disables the delay.")
    model_cache_dir: str | None = Field(
        None, description="Where the packaged default model's weight-less directory is "
                          "exported; None uses `~/.cache/splitserve/models`.  A model "
                          "given as a directory or hub id is read where it is.")
    ready_timeout_s: float = Field(60.0, gt=0, description="How long the mocker may take to "
                                   "register its instance in etcd before this replica fails.")
    stop_timeout_s: float | None = Field(
        None, gt=0, description="Grace period after SIGTERM to the mocker (which stops "
                                "taking requests and lets its streams finish) before it is "
                                "killed; None: the worker's drain_timeout_s.")
    extra_args: list[str] = Field(default_factory=list,
                                  description="Further `python -m dynamo.mocker` flags, appended "
                                              "verbatim (e.g. ['--sglang-schedule-policy', "
                                              "'lpm']).")

    def stop_grace_s(self, default_s: float) -> float:
        """Seconds the mocker gets after SIGTERM: ``stop_timeout_s`` when set, else
        ``default_s`` (the aggregated worker's drain; a short grace behind a decode
        worker, which has drained its requests before it stops its engines)."""
        return self.stop_timeout_s if self.stop_timeout_s is not None else default_s

    @model_validator(mode="after")
    def _no_managed_flags_in_extra_args(self) -> MockerEngineArgs:
        managed = {"--endpoint", "--model-path", "--model-name", "--num-workers",
                   "--engine-type", "--block-size", "--disaggregation-mode",
                   "--discovery-backend", "--event-plane", "--request-plane",
                   "--max-model-len"}
        clashes = sorted({a.split("=", 1)[0] for a in self.extra_args} & managed)
        if clashes:
            raise ValueError(f"extra_args {clashes} are set from other fields of this section "
                             "or from Common; use those instead")
        return self
