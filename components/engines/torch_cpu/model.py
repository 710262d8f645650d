"""A compact Llama-family forward pass over a flat batch of tokens and the paged KV cache.

The family's variants are the weights' own: biases on the attention projections (Qwen2,
or Llama with ``attention_bias``) and on the MLP (``mlp_bias``), a per-head RMSNorm of
queries and keys before RoPE (Qwen3), an explicit head dimension, tied embeddings.

One call computes a whole engine step: prefill chunks of some sequences and one
decode token of others, packed as rows of one ``[R, hidden]`` activation so the
linear layers run once for everybody. Only attention looks at sequence
boundaries, and LoRA adapters at the rows of the requests that use them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .attention import decode_attention, prefill_attention, prefill_mask
from .config import ModelConfig
from .lora import LoraRows, LoraWeights, add_lora
from .ops import Linear, apply_rope, rms_norm, rope_tables


@dataclass
class LayerWeights:
    """One decoder layer; projections fused where they share an input."""

    attn_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> (H + 2 * KVH) * D
    q_norm: torch.Tensor | None  # [D], per-head RMSNorm of queries before RoPE (Qwen3)
    k_norm: torch.Tensor | None  # [D], the same for keys
    o: Linear  # H * D -> hidden
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear  # intermediate -> hidden


@dataclass
class LlamaWeights:
    """Everything the forward pass reads, fp32."""

    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: Linear  # hidden -> vocab
    rope_cos: torch.Tensor  # [max_positions, D]
    rope_sin: torch.Tensor  # [max_positions, D]

    @classmethod
    def from_state_dict(cls, sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> LlamaWeights:
        """Build from a Hugging Face ``*ForCausalLM`` state dict of the Llama family
        (Llama, Mistral, Qwen2, Qwen3); called once at load. Biases and per-head norms
        are used where the checkpoint has them."""
        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            qkv = torch.cat([sd[attn + f"{n}_proj.weight"] for n in ("q", "k", "v")], dim=0)
            gate_up = torch.cat([sd[mlp + "gate_proj.weight"], sd[mlp + "up_proj.weight"]])
            layers.append(
                LayerWeights(
                    attn_norm=_vector(sd, p + "input_layernorm.weight"),
                    qkv=Linear(qkv, _fused_bias(sd, [attn + f"{n}_proj" for n in "qkv"])),
                    q_norm=_vector(sd, attn + "q_norm.weight", optional=True),
                    k_norm=_vector(sd, attn + "k_norm.weight", optional=True),
                    o=Linear(sd[attn + "o_proj.weight"], sd.get(attn + "o_proj.bias")),
                    mlp_norm=_vector(sd, p + "post_attention_layernorm.weight"),
                    gate_up=Linear(gate_up, _fused_bias(sd, [mlp + "gate_proj", mlp + "up_proj"])),
                    down=Linear(sd[mlp + "down_proj.weight"], sd.get(mlp + "down_proj.bias")),
                )
            )
        embed = sd["model.embed_tokens.weight"].float().contiguous()
        head = embed if cfg.tie_word_embeddings else sd["lm_head.weight"]
        cos, sin = rope_tables(
            cfg.rope_inv_freq, cfg.max_position_embeddings, cfg.rope_attention_scaling
        )
        return cls(
            embed, layers, _vector(sd, "model.norm.weight"), Linear(head, sd.get("lm_head.bias")),
            cos, sin,
        )


def _vector(sd: Mapping[str, torch.Tensor], key: str, optional: bool = False):
    if optional and key not in sd:
        return None
    return sd[key].float().contiguous()


def _fused_bias(sd: Mapping[str, torch.Tensor], names: list[str]) -> torch.Tensor | None:
    """The biases of projections fused into one matmul, concatenated like their weights
    (zeros for a part without one); None when none of them has a bias."""
    if all(n + ".bias" not in sd for n in names):
        return None
    parts = []
    for n in names:
        bias = sd.get(n + ".bias")
        parts.append(bias.float() if bias is not None
                     else torch.zeros(sd[n + ".weight"].shape[0], dtype=torch.float32))
    return torch.cat(parts)


@dataclass
class PrefillSpan:
    """Rows ``[start, end)`` of the batch are consecutive prompt positions of one sequence."""

    start: int
    end: int
    block_table: torch.Tensor  # [nb] long, padded to whole attention tiles
    masked: torch.Tensor  # [(end - start) * G, nb * bs] bool, see attention.prefill_mask


@dataclass
class ForwardBatch:
    """One step's input, built by the engine from the scheduler's decision.

    Rows are ordered: every prefill span, then one row per decoding sequence.
    """

    token_ids: torch.Tensor  # [R] long
    positions: torch.Tensor  # [R] long
    slot_blocks: torch.Tensor  # [R] long: block receiving each row's K/V
    slot_offsets: torch.Tensor  # [R] long: offset inside that block
    prefills: list[PrefillSpan]
    decode_start: int  # first decode row (== R when there is none)
    decode_tables: torch.Tensor  # [B, nb] long, padded to whole attention tiles
    decode_masked: torch.Tensor  # [B, nb * bs] bool, see attention.decode_mask
    logit_rows: torch.Tensor  # [S] long: rows whose next-token logits are needed
    loras: LoraRows = field(default_factory=list)  # adapters and the rows using each


def forward(
    w: LlamaWeights, cfg: ModelConfig, pool: torch.Tensor, batch: ForwardBatch, tile: int
) -> torch.Tensor:
    """Run every layer for the batch, writing new K/V into ``pool``.

    Called once per engine step. Returns logits [S, vocab] for ``logit_rows``.
    """
    heads, kvh, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rows = batch.token_ids.shape[0]
    cos = w.rope_cos[batch.positions].unsqueeze(1)  # [R, 1, D]
    sin = w.rope_sin[batch.positions].unsqueeze(1)
    x = w.embed[batch.token_ids]  # [R, hidden]
    d0 = batch.decode_start
    for li, layer in enumerate(w.layers):
        h = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
        qkv = add_lora(layer.qkv(h), h, li, "qkv", batch.loras)  # [R, (H + 2 * KVH) * D]
        q = qkv[:, : heads * dim].reshape(rows, heads, dim)  # [R, H, D]
        k = qkv[:, heads * dim : (heads + kvh) * dim].reshape(rows, kvh, dim)  # [R, KVH, D]
        if layer.q_norm is not None:
            q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
        if layer.k_norm is not None:
            k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = qkv[:, (heads + kvh) * dim :].reshape(rows, kvh, dim)  # [R, KVH, D]
        k_cache = pool[:, li, 0]  # [blocks, bs, KVH, D] view into the pool
        v_cache = pool[:, li, 1]
        k_cache[batch.slot_blocks, batch.slot_offsets] = k
        v_cache[batch.slot_blocks, batch.slot_offsets] = v
        attn = torch.empty(rows, heads * dim)  # [R, H * D]
        for span in batch.prefills:
            attn[span.start : span.end] = prefill_attention(
                q[span.start : span.end],
                k_cache,
                v_cache,
                span.block_table,
                span.masked,
                tile,
            )
        if d0 < rows:
            attn[d0:] = decode_attention(
                q[d0:], k_cache, v_cache, batch.decode_tables, batch.decode_masked, tile
            )
        x = x + add_lora(layer.o(attn), attn, li, "o", batch.loras)
        h = rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)
        gu = add_lora(layer.gate_up(h), h, li, "gate_up", batch.loras)  # [R, 2 * inter]
        inter = cfg.intermediate_size
        act = F.silu(gu[:, :inter]) * gu[:, inter:]  # [R, intermediate]
        x = x + add_lora(layer.down(act), act, li, "down", batch.loras)
    last = rms_norm(x[batch.logit_rows], w.final_norm, cfg.rms_norm_eps)  # [S, hidden]
    return w.lm_head(last)  # [S, vocab]


def score_prompt(
    w: LlamaWeights, cfg: ModelConfig, token_ids: list[int], block_size: int = 16, tile: int = 128,
    lora: LoraWeights | None = None,
) -> torch.Tensor:
    """Logits [n, vocab] at every position of one prompt, using a scratch KV pool;
    ``lora``: the adapter to apply (None: the base model).

    Not on the serving path: used to check the forward pass against a reference
    and to score text offline.
    """
    n = len(token_ids)
    nb = -(-n // tile) * (tile // block_size)
    pool = torch.zeros(nb, cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim)
    pos = torch.arange(n)
    batch = ForwardBatch(
        token_ids=torch.tensor(token_ids),
        positions=pos,
        slot_blocks=pos // block_size,
        slot_offsets=pos % block_size,
        prefills=[
            PrefillSpan(0, n, torch.arange(nb), prefill_mask(pos, nb * block_size, cfg.group_size))
        ],
        decode_start=n,
        decode_tables=torch.zeros(0, nb, dtype=torch.long),
        decode_masked=torch.zeros(0, nb * block_size, dtype=torch.bool),
        logit_rows=pos,
        loras=[] if lora is None else [(lora, pos)],
    )
    with torch.inference_mode():
        return forward(w, cfg, pool, batch, tile)
