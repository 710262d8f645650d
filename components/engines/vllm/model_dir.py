"""A loadable Hugging Face directory of SmolLM2 for vLLM.

vLLM loads ``config.json``, the tokenizer files and ``*.safetensors`` from one
directory.  The project's exported (weight-less) directory already holds the first two,
and ``fp32_weights`` (the hosting kit's model files) caches the de-quantised fp32 weights beside them under Hugging
Face Llama key names; this module links both into a sibling directory whose weights
file is named ``model.safetensors``, so no tensor is copied.
"""

from __future__ import annotations

import os
from pathlib import Path

WEIGHTS_NAME = "model.safetensors"
# The weight-less export carries files the mocker and the frontend read; vLLM reads the
# same ones plus the weights.
_LINKED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "chat_template.jinja")


def _link(src: Path, dst: Path) -> None:
    """Point ``dst`` at ``src``, atomically replacing a stale link."""
    if dst.is_symlink() and os.readlink(dst) == str(src):
        return
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(src)
    tmp.replace(dst)


def vllm_model_dir() -> Path:
    """Return a directory vLLM can load SmolLM2-135M-Instruct from.

    Called by the vLLM engine before it starts; the first call may take ~15 s (the
    weights are de-quantised once per machine), later calls only check links.
    """
    from splitserve.contracts.kit.cache import model_cache_dir
    from splitserve.contracts.kit.model_dir import (export_model_dir, fp32_weights,
                                                    served_model_name)

    src = export_model_dir(model_cache_dir(served_model_name()))
    weights = fp32_weights(src)
    dst = model_cache_dir(served_model_name() + "-vllm")
    dst.mkdir(parents=True, exist_ok=True)
    for name in _LINKED:
        if (src / name).exists():
            _link(src / name, dst / name)
    _link(weights, dst / WEIGHTS_NAME)
    return dst
