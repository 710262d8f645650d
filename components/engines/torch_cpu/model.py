"""A compact Llama forward pass over a flat batch of tokens and the paged KV cache.

One call computes a whole engine step: prefill chunks of some sequences and one
decode token of others, packed as rows of one ``[R, hidden]`` activation so the
linear layers run once for everybody. Only attention looks at sequence
boundaries.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import decode_attention, prefill_attention, prefill_mask
from .config import ModelConfig
from .ops import Linear, apply_rope, rms_norm, rope_tables


@dataclass
class LayerWeights:
    """One decoder layer; projections fused where they share an input."""

    attn_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> (H + 2 * KVH) * D
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
        """Build from a Hugging Face ``LlamaForCausalLM`` state dict; called once at load."""
        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in ("q", "k", "v")], dim=0)
            gate_up = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
            layers.append(
                LayerWeights(
                    attn_norm=sd[p + "input_layernorm.weight"].float().contiguous(),
                    qkv=Linear(qkv),
                    o=Linear(sd[p + "self_attn.o_proj.weight"]),
                    mlp_norm=sd[p + "post_attention_layernorm.weight"].float().contiguous(),
                    gate_up=Linear(gate_up),
                    down=Linear(sd[p + "mlp.down_proj.weight"]),
                )
            )
        embed = sd["model.embed_tokens.weight"].float().contiguous()
        head = embed if cfg.tie_word_embeddings else sd["lm_head.weight"]
        cos, sin = rope_tables(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling_factor
        )
        return cls(
            embed, layers, sd["model.norm.weight"].float().contiguous(), Linear(head), cos, sin
        )


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
        qkv = layer.qkv(h)  # [R, (H + 2 * KVH) * D]
        q = apply_rope(qkv[:, : heads * dim].reshape(rows, heads, dim), cos, sin)  # [R, H, D]
        k = apply_rope(
            qkv[:, heads * dim : (heads + kvh) * dim].reshape(rows, kvh, dim), cos, sin
        )  # [R, KVH, D]
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
        x = x + layer.o(attn)
        h = rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)
        gu = layer.gate_up(h)  # [R, 2 * intermediate]
        inter = cfg.intermediate_size
        x = x + layer.down(F.silu(gu[:, :inter]) * gu[:, inter:])
    last = rms_norm(x[batch.logit_rows], w.final_norm, cfg.rms_norm_eps)  # [S, hidden]
    return w.lm_head(last)  # [S, vocab]


def score_prompt(
    w: LlamaWeights, cfg: ModelConfig, token_ids: list[int], block_size: int = 16, tile: int = 128
) -> torch.Tensor:
    """Logits [n, vocab] at every position of one prompt, using a scratch KV pool.

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
    )
    with torch.inference_mode():
        return forward(w, cfg, pool, batch, tile)
