"""Load a Llama-family model from a Hugging Face directory: its config.json, tokenizer
files and safetensors.

``model`` is what ``Common.model`` names: a local directory, a hub id whose snapshot is
in the local cache, or the packaged SmolLM2-135M-Instruct (its GGUF de-quantised once
per machine and cached beside its exported files).  The architectures this engine runs
are listed below; any other is refused at start, by name.  Transformers reads the
config (and computes scaled RoPE frequencies exactly as its own models do); the weights
are repacked for our own forward pass, in float32 whatever dtype they are stored in.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from splitserve.contracts.model_files import PACKAGED_MODEL, ModelInfo, read_model_info

from .config import ModelConfig
from .model import LlamaWeights
from .ops import default_inv_freq

log = logging.getLogger(__name__)

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM")
"""What this engine's forward pass computes (SmolLM checkpoints are LlamaForCausalLM)."""
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""RoPE scalings whose frequencies do not depend on the sequence's length."""

ProgressFn = Callable[[str, float], None]
"""Called with a stage name and the fraction of loading done (0.0 .. 1.0)."""


class UnsupportedModel(ValueError):
    """The model's config asks for something this engine does not compute."""


@dataclass
class LoadedModel:
    """What an engine needs from a checkpoint."""

    weights: LlamaWeights
    config: ModelConfig
    tokenizer: Any  # a transformers tokenizer (with the model's chat template, if any)
    hf_model: Any | None = None  # the transformers model, only when asked for (tests, benchmarks)
    info: ModelInfo | None = None  # what the model's config files say


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


def check_architecture(info: ModelInfo, model: str) -> None:
    """Refuse, by name, a model this engine's forward pass does not compute."""
    runs = ", ".join(ARCHITECTURES)
    if not info.architectures:
        raise UnsupportedModel(f"{model}: config.json names no architectures; the torch "
                               f"engine runs {runs}")
    other = [a for a in info.architectures if a not in ARCHITECTURES]
    if other:
        raise UnsupportedModel(f"{model}: architecture {', '.join(other)} is not one the "
                               f"torch engine runs ({runs})")
    act = info.config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"{model}: hidden_act {act!r}; the torch engine computes silu")


def rope_frequencies(hf_config: Any, head_dim: int) -> tuple[tuple[float, ...], float]:
    """RoPE's inverse frequencies and attention scaling for a transformers config."""
    rope = dict(getattr(hf_config, "rope_parameters", None)
                or getattr(hf_config, "rope_scaling", None) or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        theta = float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
        return default_inv_freq(head_dim, theta), 1.0
    if kind not in ROPE_TYPES:
        raise UnsupportedModel(f"rope_type {kind!r} is not supported by the torch engine "
                               f"(it computes {', '.join(ROPE_TYPES)})")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](hf_config)
    return tuple(inv_freq.float().tolist()), float(scaling)


def model_config_from_hf(hf_config: Any, info: ModelInfo, tokenizer: Any) -> ModelConfig:
    """Our ``ModelConfig`` from a transformers config of the Llama family and what the
    model's files say (end-of-sequence ids: generation_config.json, config.json and the
    tokenizer's EOS token)."""
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    inv_freq, scaling = rope_frequencies(hf_config, head_dim)
    eos_ids = set(info.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos_ids.add(tokenizer.eos_token_id)
    positions = info.context_length
    if info.sliding_window is not None and info.sliding_window < positions:
        # Attention here spans the whole sequence: within the window both agree.
        log.warning("the model attends over a sliding window of %d tokens; this engine "
                    "serves sequences up to that length", info.sliding_window)
        positions = info.sliding_window
    return ModelConfig(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf_config.rms_norm_eps),
        rope_inv_freq=inv_freq,
        rope_attention_scaling=scaling,
        max_position_embeddings=positions,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        eos_token_ids=tuple(sorted(eos_ids)),
    )


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its index names, else
    ``model.safetensors`` (other ``*.safetensors`` beside them, such as Mistral's
    ``consolidated.safetensors``, hold the same weights under other names)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / n for n in names]
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{directory}: no model.safetensors or "
                            "model.safetensors.index.json (the torch engine loads safetensors)")


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, as float32."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        for key, tensor in load_file(str(path)).items():
            state[key] = tensor if tensor.dtype == torch.float32 else tensor.float()
    return state


def load_model(model: str = PACKAGED_MODEL, progress: ProgressFn | None = None,
               keep_hf_model: bool = False) -> LoadedModel:
    """Load ``model`` (a ``Common.model`` value); called once per process at start.

    The packaged default's first load on a machine exports its tokenizer and de-quantises
    its GGUF (~30 s on 2 cores); later loads read the cached files (~1 s).
    ``progress`` receives each stage (the worker turns it into readiness); by default
    stages are logged.  With ``keep_hf_model`` the transformers model is returned too,
    from the same files, as a reference for tests and benchmarks.
    """
    report = progress or (
        lambda stage, frac: log.info("loading model: %s (%.0f%%)", stage, frac * 100)
    )
    from transformers import AutoConfig

    from splitserve.contracts.kit.model_dir import load_tokenizer, weights_dir

    report("locating weights", 0.0)
    directory = weights_dir(model)
    info = read_model_info(directory)
    check_architecture(info, model)
    report("loading tokenizer", 0.2)
    tokenizer = load_tokenizer(directory)
    hf_config = AutoConfig.from_pretrained(str(directory))
    report("reading weights", 0.35)
    state = read_weights(directory)
    cfg = model_config_from_hf(hf_config, info, tokenizer)
    report("packing weights", 0.85)
    weights = LlamaWeights.from_state_dict(state, cfg)
    hf = reference_model(directory) if keep_hf_model else None
    report("ready", 1.0)
    log.info("loaded %s (%s, stored as %s) from %s", model, ", ".join(info.architectures),
             info.dtype or "unnamed dtype", directory)
    return LoadedModel(weights, cfg, tokenizer, hf, info)


def reference_model(directory: Path) -> Any:
    """The transformers model over the same files, in float32 (tests, benchmarks)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Apply the chat template (with the assistant turn opened) and return token ids."""
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)
