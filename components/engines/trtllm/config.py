"""Config of the TensorRT-LLM engine and its mapping onto the LLM API's arguments.

TensorRT-LLM cannot be installed here, so the mapping follows the shapes Dynamo 1.6.1's
TensorRT-LLM worker passes to ``tensorrt_llm.LLM`` (PyTorch backend): ``model``,
``tensor_parallel_size``, ``kv_cache_config`` (a dict: free GPU memory fraction, block
reuse, the KV event buffer), ``cache_transceiver_config`` (the KV transfer backend of
disaggregated roles), batch and sequence limits, and token ids in / token ids out.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from splitserve.common.models import StrictModel

Role = Literal["agg", "prefill", "decode"]

MAPPED = frozenset({"model", "tensor_parallel_size", "backend", "kv_cache_config",
                    "cache_transceiver_config", "max_batch_size", "max_num_tokens",
                    "max_seq_len", "skip_tokenizer_init"})


class TrtllmEngineArgs(StrictModel):
    """Arguments of one in-process TensorRT-LLM engine (``tensorrt_llm.LLM``)."""

    model: str = Field("meta-llama/Llama-3.1-8B-Instruct", min_length=1,
                       description="Hugging Face id or local directory of the weights.")
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
    max_batch_size: int | None = Field(None, ge=1, description="Requests per step.")
    max_num_tokens: int | None = Field(None, ge=16, description="Tokens per step.")
    max_seq_len: int | None = Field(None, ge=16, description="Longest prompt plus output.")
    transfer_backend: Literal["NIXL", "UCX", "DEFAULT"] = Field(
        "NIXL", description="cache_transceiver_config.backend of disaggregated roles.")
    extra_llm_args: dict[str, Any] = Field(
        default_factory=dict, description="Further LLM API arguments, passed unchanged "
        "(not checked here: TensorRT-LLM is not installable off GPU machines).")

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


def llm_kwargs(args: TrtllmEngineArgs, role: Role, *, local_prefill: bool = False) -> dict[str, Any]:
    """Keyword arguments of ``tensorrt_llm.LLM`` for one engine; called once at start.

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
    kw: dict[str, Any] = {"model": args.model, "backend": "pytorch",
                          "tensor_parallel_size": args.tensor_parallel_size,
                          "kv_cache_config": kv_cache, "skip_tokenizer_init": True}
    for name in ("max_batch_size", "max_num_tokens", "max_seq_len"):
        value = getattr(args, name)
        if value is not None:
            kw[name] = value
    if role != "agg":
        kw["cache_transceiver_config"] = {"backend": args.transfer_backend}
    kw.update(args.extra_llm_args)
    return kw
