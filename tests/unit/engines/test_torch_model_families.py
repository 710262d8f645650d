"""The torch engine serves a user's Llama-family model from its own files: greedy output
token for token equal to transformers' for each family (Llama, SmolLM, Mistral, Qwen2,
Qwen3), the shape and end-of-sequence ids read from the files, and any other
architecture refused at start by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from splitserve.components.engines.torch_cpu import (
    EngineConfig,
    EngineCore,
    LoadedModel,
    Request,
    UnsupportedModel,
    load_model,
)
from splitserve.components.engines.torch_cpu.model import score_prompt
from tests.fixtures.tiny_models import FAMILIES

pytestmark = pytest.mark.unit

PROMPTS = ["The quick brown fox jumps over", "def f(x):\n    return", "Paris is the"]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def loaded(tiny_models):
    cache: dict[str, LoadedModel] = {}

    def load(family: str) -> LoadedModel:
        if family not in cache:
            cache[family] = load_model(str(tiny_models[family]), keep_hf_model=True)
        return cache[family]

    return load


def reference(model: LoadedModel, ids: list[int]) -> list[int]:
    """transformers' greedy continuation of ``ids`` (it stops at an EOS id, like ours)."""
    prompt = torch.tensor([ids])
    with torch.inference_mode():
        out = model.hf_model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                      max_new_tokens=NEW_TOKENS, do_sample=False,
                                      pad_token_id=model.tokenizer.pad_token_id)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_output_equals_transformers(loaded, family):
    model = loaded(family)
    prompts = [model.tokenizer(p)["input_ids"] for p in PROMPTS]
    expected = [reference(model, ids) for ids in prompts]
    engine = EngineCore(model.weights, model.config, EngineConfig(num_blocks=64))
    for i, ids in enumerate(prompts):  # batched together, as a worker runs them
        engine.add_request(Request(f"r{i}", tuple(ids), max_tokens=NEW_TOKENS))
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
    assert [got[f"r{i}"] for i in range(len(prompts))] == expected
    assert all(len(e) == NEW_TOKENS for e in expected)  # no early EOS hid a difference


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(loaded, family):
    model = loaded(family)
    ids = model.tokenizer(PROMPTS[0])["input_ids"]
    ours = score_prompt(model.weights, model.config, ids)
    with torch.inference_mode():
        ref = model.hf_model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_shape_and_stop_ids_come_from_the_files(loaded):
    qwen3, qwen2, smollm = loaded("qwen3"), loaded("qwen2"), loaded("smollm")
    assert qwen3.config.head_dim == 32 and qwen3.config.num_heads == 4
    assert qwen3.config.eos_token_ids == (2, 7)  # generation_config.json adds 7
    assert qwen3.config.rope_attention_scaling > 1.0  # yarn
    assert qwen3.weights.layers[0].q_norm is not None
    assert qwen2.weights.layers[0].qkv.bias is not None and qwen2.config.tie_word_embeddings
    assert qwen2.weights.layers[0].o.bias is None
    assert smollm.config.head_dim == 16 and smollm.info.dtype == "bfloat16"
    assert smollm.weights.embed.dtype == torch.float32
    # Mistral's sliding window bounds the sequences this engine serves
    assert loaded("mistral").config.max_position_embeddings == 256
    assert loaded("llama").config.max_position_embeddings == 512


def edited(src: Path, dst: Path, **config) -> Path:
    shutil.copytree(src, dst)
    path = dst / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return dst


def test_another_architecture_is_refused_by_name(tiny_models, tmp_path):
    gpt = edited(tiny_models["llama"], tmp_path / "gpt", architectures=["GPT2LMHeadModel"],
                 model_type="gpt2")
    with pytest.raises(UnsupportedModel, match="architecture GPT2LMHeadModel is not one the "
                                               "torch engine runs"):
        load_model(str(gpt))
    gelu = edited(tiny_models["llama"], tmp_path / "gelu", hidden_act="gelu")
    with pytest.raises(UnsupportedModel, match="hidden_act 'gelu'"):
        load_model(str(gelu))


def test_a_rope_scaling_that_depends_on_the_length_is_refused(tiny_models, tmp_path):
    dynamic = edited(tiny_models["llama"], tmp_path / "dynamic", rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(UnsupportedModel, match="rope_type 'dynamic'"):
        load_model(str(dynamic))


def test_sharded_checkpoints_load_from_their_index(loaded, tiny_models, tmp_path):
    model = loaded("qwen2")
    sharded = tmp_path / "sharded"
    model.hf_model.save_pretrained(str(sharded), max_shard_size="2MB")
    assert (sharded / "model.safetensors.index.json").exists()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_models["qwen2"] / name, sharded / name)
    again = load_model(str(sharded))
    ids = model.tokenizer(PROMPTS[1])["input_ids"]
    assert torch.equal(score_prompt(again.weights, again.config, ids),
                       score_prompt(model.weights, model.config, ids))
