"""Config of the TensorRT-LLM engine and its mapping onto the LLM API's arguments.

TensorRT-LLM cannot be installed here, so the mapping follows the shapes Dynamo 1.6.1's
TensorRT-LLM worker passes to ``tensorrt_llm.LLM`` (PyTorch backend): ``model``,
``tensor_parallel_size``, ``kv_cache_config`` (a dict: free GPU memory fraction, block
reuse, the KV event buffer), ``cache_transceiver_config`` (the KV transfer backend of
disaggregated roles), batch and sequence limits.

The tokenizer is not skipped (Dynamo does not skip it either): TensorRT-LLM's
``LLM._prepare_sampling_params`` fills a request's ``end_id``/``pad_id`` from the
tokenizer and the model's generation config, and raises on every request when
``skip_tokenizer_init`` is set and no ``end_id`` is given.  Token ids still go in and
come out (``detokenize=False`` per request).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from splitserve.contracts.model_files import checked_model
from splitserve.contracts.models import StrictModel
from splitserve.contracts.sections import refuse_torch_tier_fields

Role = Literal["agg", "prefill", "decode"]

TESTED_VERSION = "1.3.0rc29"
"""The TensorRT-LLM release these calls follow (the one Dynamo 1.6.1 pins)."""

MAPPED = frozenset({"model", "tensor_parallel_size", "backend", "kv_cache_config",
                    "cache_transceiver_config", "max_batch_size", "max_num_tokens",
                    "max_seq_len", "skip_tokenizer_init", "enable_iter_perf_stats",
                    "disable_overlap_scheduler", "guided_decoding_backend"})

GIB = 1 << 30

# The torch engine's KV tier fields, refused here by name with what TensorRT-LLM offers
# instead (a plain "extra inputs" error would not say which tiers this adapter maps).
# TensorRT-LLM's own disk tier (KvCacheConfig.disk_cache_size / disk_cache_path, in
# releases around the pinned one) is not mapped: nothing here can check it against
# the pinned release.
_NO_DISK = "this adapter maps no disk KV tier for TensorRT-LLM, only host_cache_gib"
TORCH_TIER_FIELDS = {
    "host_kv_cache_gib": "TensorRT-LLM's host-memory KV tier is host_cache_gib",
    "disk_kv_cache_gib": _NO_DISK,
    "disk_kv_cache_dir": _NO_DISK,
}


class TrtllmEngineArgs(StrictModel):
    """Arguments of one in-process TensorRT-LLM engine (``tensorrt_llm.LLM``)."""

    model: str | None = Field(None, min_length=1, description="This pool's model, when it "
                              "is not Common.model: a local directory or a hub id in the "
                              "local cache; null: Common.model.  TensorRT-LLM gets the "
                              "directory either way (nothing is downloaded).")
    tensor_parallel_size: int = Field(1, ge=1, description="Tensor-parallel GPUs.")
    free_gpu_memory_fraction: float = Field(
        0.85, gt=0, lt=1, description="Fraction of the GPU memory left after the weights "
        "that the KV cache takes (kv_cache_config.free_gpu_memory_fraction).")
    tokens_per_block: int = Field(32, ge=1, description="Tokens per KV block "
                                  "(kv_cache_config.tokens_per_block); the Router's "
                                  "block_size must be equal.")
    enable_block_reuse: bool = Field(True, description="Prefix reuse; also what produces "
                                     "the KV events the router indexes.")
    kv_events: bool = Field(True, description="Relay TensorRT-LLM's KV events to the "
                            "router (needs enable_block_reuse).")
    event_buffer_max_size: int = Field(1024, ge=1, description="KV events the engine "
                                       "buffers between polls (must be > 0 for events).")
    host_cache_gib: float = Field(
        0, ge=0, allow_inf_nan=False, description="Host-memory KV tier per GPU in GiB "
        "(kv_cache_config.host_cache_size, in bytes; 0: off): a reusable block the GPU "
        "pool evicts moves there and is copied back on a prefix hit.  Needs "
        "enable_block_reuse (only reusable blocks are offloaded).")
    max_batch_size: int | None = Field(None, ge=1, description="Requests per step.")
    max_num_tokens: int | None = Field(None, ge=16, description="Tokens per step.")
    max_seq_len: int | None = Field(None, ge=16, description="Longest prompt plus output.")
    transfer_backend: Literal["NIXL", "UCX", "DEFAULT"] = Field(
        "NIXL", description="cache_transceiver_config.backend of disaggregated roles.")
    kv_transfer_timeout_ms: int = Field(
        60_000, ge=1_000, description="cache_transceiver_config.kv_transfer_timeout_ms of "
        "disaggregated roles: a context whose KV nobody fetched in time is freed, and a "
        "generation request whose KV never arrives (its prefill engine died) fails "
        "instead of waiting forever.")
    guided_decoding_backend: Literal["xgrammar", "llguidance"] | None = Field(
        "xgrammar", description="Backend that compiles a request's JSON schema into "
        "token masks (structured output: response_format, forced tool calls); null "
        "starts the LLM without one, and requests that carry a schema are refused.")
    accept_untested_version: bool = Field(
        False, description="Start with a TensorRT-LLM release other than the tested one "
        f"({TESTED_VERSION}); off, another version is refused at start.")
    extra_llm_args: dict[str, Any] = Field(
        default_factory=dict, description="Further LLM API arguments, passed unchanged "
        "(not checked here: TensorRT-LLM is not installable off GPU machines).")

    @model_validator(mode="before")
    @classmethod
    def _no_torch_tiers(cls, data: Any) -> Any:
        return refuse_torch_tier_fields(data, TORCH_TIER_FIELDS, "trtllm")

    @field_validator("model")
    @classmethod
    def _model_found(cls, v: str | None) -> str | None:
        return checked_model(v)

    @model_validator(mode="after")
    def _host_cache_needs_reuse(self) -> TrtllmEngineArgs:
        # TensorRT-LLM offloads a block to the host pool only when it stays in its reuse
        # tree; without reuse the pool would take host memory and never be read.
        if self.host_cache_gib > 0 and not self.enable_block_reuse:
            raise ValueError(f"host_cache_gib {self.host_cache_gib}: TensorRT-LLM offloads "
                             "only reusable blocks, and enable_block_reuse is false")
        return self

    @field_validator("extra_llm_args")
    @classmethod
    def _not_mapped(cls, v: dict[str, Any]) -> dict[str, Any]:
        for key in v:
            if key in MAPPED:
                raise ValueError(f"extra_llm_args.{key}: set by its own field here")
        return v

    def kv_events_enabled(self) -> bool:
        """Whether this engine publishes KV events (both switches on)."""
        return self.kv_events and self.enable_block_reuse

    def lower_tiers(self) -> dict[str, int | None]:
        """The tiers below the pool whose events reach the routers: TensorRT-LLM's host
        pool (``host_cache_gib``) when the engine publishes KV events; its size in
        blocks is TensorRT-LLM's to tell."""
        if self.host_cache_gib > 0 and self.kv_events_enabled():
            return {"host": None}
        return {}


def llm_kwargs(args: TrtllmEngineArgs, role: Role, *, local_prefill: bool = False) -> dict[str, Any]:
    """Keyword arguments of ``tensorrt_llm.LLM`` for one engine; called once at start
    (``local_prefill`` is accepted for symmetry with the other engines and unused).
    ``args.model`` is the model's directory (the registry's factory fills in
    Common.model's).

    Prefill and decode roles get a cache transceiver (how the engines move KV); a
    decode engine keeps serving ``context_and_generation`` requests for local prefills,
    which needs no extra engine.
    """
    kv_cache: dict[str, Any] = {
        "free_gpu_memory_fraction": args.free_gpu_memory_fraction,
        "enable_block_reuse": args.enable_block_reuse,
        "tokens_per_block": args.tokens_per_block,
        "event_buffer_max_size": args.event_buffer_max_size if args.kv_events_enabled() else 0,
    }
    if args.host_cache_gib > 0:
        kv_cache["host_cache_size"] = int(args.host_cache_gib * GIB)
    # enable_iter_perf_stats: without it get_stats_async yields nothing and the load
    # reports (KV blocks, queue) the router and admission read stay empty.
    kw: dict[str, Any] = {"model": args.model, "backend": "pytorch",
                          "tensor_parallel_size": args.tensor_parallel_size,
                          "kv_cache_config": kv_cache, "enable_iter_perf_stats": True}
    for name in ("max_batch_size", "max_num_tokens", "max_seq_len"):
        value = getattr(args, name)
        if value is not None:
            kw[name] = value
    if args.guided_decoding_backend is not None:
        kw["guided_decoding_backend"] = args.guided_decoding_backend
    if role != "agg":
        kw["cache_transceiver_config"] = {"backend": args.transfer_backend,
                                          "kv_transfer_timeout_ms": args.kv_transfer_timeout_ms}
    if role == "prefill":
        # TensorRT-LLM's disaggregated-serving guide: the overlap scheduler is not
        # supported on context servers.
        kw["disable_overlap_scheduler"] = True
    kw.update(args.extra_llm_args)
    return kw


def check_version(installed: str, args: TrtllmEngineArgs) -> None:
    """Refuse a TensorRT-LLM release other than the tested one unless the config accepts
    it; called at start, before the LLM is built."""
    if installed != TESTED_VERSION and not args.accept_untested_version:
        raise RuntimeError(
            f"TensorRT-LLM {installed} is installed; this adapter follows {TESTED_VERSION} "
            f"(install tensorrt-llm=={TESTED_VERSION}, or set "
            "engine_args.accept_untested_version: true)")
