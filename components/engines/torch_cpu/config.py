"""Configuration: the model's shape (read from the checkpoint) and the engine's limits."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field, model_validator

from splitserve.contracts.models import StrictModel


@dataclass(frozen=True)
class ModelConfig:
    """Shape and constants of a Llama-family checkpoint, as the forward pass needs them
    (read from its config.json by the loader)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_inv_freq: tuple[float, ...]  # [head_dim / 2] RoPE inverse frequencies, scaling applied
    rope_attention_scaling: float  # multiplies cos and sin (yarn); 1.0 for the others
    max_position_embeddings: int  # positions served (capped at a sliding window's length)
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]

    @property
    def group_size(self) -> int:
        """Query heads sharing one KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads


class EngineConfig(StrictModel):
    """Limits of one engine instance; every field has a safe default for a small model."""

    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV block.")
    num_blocks: int = Field(
        512, ge=1, description="Blocks in the KV pool (each holds every layer's K and V)."
    )
    max_running: int = Field(
        32, ge=1, description="Most sequences decoding (or prefilling) at the same time."
    )
    max_prefill_tokens: int = Field(
        512,
        ge=1,
        description="Most prompt tokens computed in one step; longer prompts are chunked.",
    )
    max_chunk_tokens: int | None = Field(
        None,
        ge=1,
        description="Most prompt tokens of one sequence computed in one step; None = "
        "max_prefill_tokens. Below max_prefill_tokens it leaves room in every step for "
        "other prompts, so a long prompt cannot hold short ones back until it is done.",
    )
    max_model_len: int | None = Field(
        None,
        ge=2,
        description="Longest sequence (prompt + output); None = the model's position limit.",
    )
    attention_tile: int = Field(
        128,
        ge=1,
        description="Keys per attention tile. Must be a multiple of block_size. "
        "Each query always reduces over whole tiles in the same order, which keeps "
        "results independent of batch composition.",
    )

    max_loras: int = Field(
        4, ge=1, description="LoRA adapters loaded at the same time (each a slot); loading "
        "one more is refused until one is unloaded."
    )
    max_lora_rank: int = Field(
        64, ge=1, description="Highest LoRA rank (r) an adapter may have to be loaded."
    )

    host_kv_cache_gib: float = Field(
        0.0, ge=0, allow_inf_nan=False,
        description="Host-memory KV tier, GiB (0: off). A prefix block evicted from the "
        "pool is copied here instead of dropped, and copied back when a new request's "
        "prefix needs it; bytes per token = layers x 2 x KV heads x head dim x 4. Refused "
        "at start when the machine has less memory available.",
    )
    disk_kv_cache_dir: str | None = Field(
        None,
        description="Directory of the disk KV tier; the engine writes one file per block "
        "in a folder of its own there (several engines may share it) and removes it when "
        "it stops. Required when disk_kv_cache_gib > 0.",
    )
    disk_kv_cache_gib: float = Field(
        0.0, ge=0, allow_inf_nan=False,
        description="Disk KV tier, GiB (0: off): blocks the host tier evicts (or the pool, "
        "without a host tier) are written here by a background writer. Refused at start "
        "when the directory has less free space.",
    )

    @model_validator(mode="after")
    def _disk_tier_has_a_directory(self) -> EngineConfig:
        if self.disk_kv_cache_gib > 0 and not self.disk_kv_cache_dir:
            raise ValueError(f"disk_kv_cache_gib={self.disk_kv_cache_gib} needs "
                             "disk_kv_cache_dir (the directory to write blocks in)")
        if self.disk_kv_cache_dir and self.disk_kv_cache_gib == 0:
            raise ValueError(f"disk_kv_cache_dir={self.disk_kv_cache_dir!r} is set but "
                             "disk_kv_cache_gib=0 turns the disk tier off")
        return self

    @model_validator(mode="after")
    def _tile_is_whole_blocks(self) -> EngineConfig:
        if self.attention_tile % self.block_size:
            raise ValueError(
                f"attention_tile={self.attention_tile} must be a multiple of "
                f"block_size={self.block_size}"
            )
        return self
