"""LoRA adapters: a PEFT adapter directory read into per-layer low-rank deltas, and
their application to some rows of a step's batch.

An adapter adds ``(x @ A^T) @ B^T * scale`` to the output of a projection it targets.
The forward pass fuses q/k/v into one ``qkv`` Linear and gate/up into ``gate_up``
(``model.LayerWeights``), so each target becomes a column slice of a fused output.  Only
the rows of requests using the adapter pay for it, and each row's delta goes through
the same batch-invariant ``Linear`` as the base weights: a row's result does not depend
on which other rows (base model, other adapters) share the step.

Only what PEFT's plain LoRA computes is served; a variant that changes the computation
(DoRA, trained biases, replaced modules, per-module ranks, ...) is refused by name when
the adapter is read, never approximated.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ModelConfig
from .ops import Linear

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may target (a Llama-family decoder layer's linears)."""

MUST_BE_UNSET = (
    "use_dora", "lora_bias", "fan_in_fan_out", "modules_to_save", "rank_pattern",
    "alpha_pattern", "layer_replication", "trainable_token_indices",
    "alora_invocation_tokens", "use_qalora", "target_parameters", "arrow_config",
    "use_bdlora", "kasa_config", "monteclora_config",
)
"""adapter_config.json fields that, when set, make PEFT compute something other than
plain LoRA on the targeted linears (or change other modules)."""

_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\."
                  r"(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


@dataclass(frozen=True)
class Projection:
    """Where a target sits in the forward pass: its fused Linear, that Linear's input
    width, and the columns ``[start, end)`` of the fused output it produces."""

    fused: str  # a LayerWeights attribute: qkv, o, gate_up or down
    in_features: int
    start: int
    end: int


def projections(cfg: ModelConfig) -> dict[str, Projection]:
    """Each target's place in the fused layer of a model with shape ``cfg``."""
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "q_proj": Projection("qkv", hidden, 0, q),
        "k_proj": Projection("qkv", hidden, q, q + kv),
        "v_proj": Projection("qkv", hidden, q + kv, q + 2 * kv),
        "o_proj": Projection("o", q, 0, hidden),
        "gate_proj": Projection("gate_up", hidden, 0, inter),
        "up_proj": Projection("gate_up", hidden, inter, 2 * inter),
        "down_proj": Projection("down", inter, 0, hidden),
    }


@dataclass(frozen=True)
class LoraTarget:
    """One adapted projection of one layer: ``y[:, start:end] += b(a(x)) * scale``.

    ``a`` and ``b`` hold A [r, in] and B [out, r] in float32 as batch-invariant Linears."""

    name: str  # the PEFT module name, e.g. q_proj
    a: Linear
    b: Linear
    start: int
    end: int


@dataclass(frozen=True, eq=False)
class LoraWeights:
    """An adapter as the forward pass reads it; ``layers[i]`` maps a fused Linear's name
    to the targets that add into its output.  Compared (and hashed) by identity: one
    loaded adapter is one object."""

    path: str  # the directory it was read from, as given
    rank: int
    scale: float
    layers: tuple[Mapping[str, tuple[LoraTarget, ...]], ...]

    @property
    def targets(self) -> frozenset[str]:
        """The PEFT module names this adapter changes in at least one layer."""
        return frozenset(t.name for layer in self.layers for ts in layer.values() for t in ts)


def lora_scale(alpha: float, rank: int, rslora: bool) -> float:
    """PEFT's scaling of the low-rank product: alpha / r, or alpha / sqrt(r) (rsLoRA)."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def read_lora(path: str | Path, cfg: ModelConfig, max_rank: int) -> LoraWeights:
    """Read the PEFT adapter directory ``path`` for a base model of shape ``cfg``.

    Called when an adapter is loaded, off the engine thread (it reads files only).
    Raises ValueError naming the file and field (or tensor) that this engine cannot
    serve exactly: a missing file, a variant other than plain LoRA, a rank above
    ``max_rank``, a module outside the decoder's projections, a layer or shape the base
    model does not have.
    """
    directory = Path(path)
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for f in (config_path, weights_path):
        if not f.is_file():
            raise ValueError(f"{f}: missing (a LoRA adapter directory holds {CONFIG_FILE} "
                             f"and {WEIGHTS_FILE})")
    settings = _read_config(config_path)
    rank, alpha = _check_config(config_path, settings, max_rank)
    from safetensors.torch import load_file

    tensors = load_file(str(weights_path))
    pairs = _pair_tensors(weights_path, tensors, cfg.num_layers)
    scale = lora_scale(alpha, rank, bool(settings.get("use_rslora")))
    layers = _build_layers(weights_path, pairs, projections(cfg), rank, cfg.num_layers)
    return LoraWeights(str(path), rank, scale, layers)


def _read_config(config_path: Path) -> dict:
    try:
        settings = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{config_path}: not readable JSON ({exc})") from exc
    if not isinstance(settings, dict):
        raise ValueError(f"{config_path}: not a JSON object")
    return settings


def _check_config(config_path: Path, settings: dict, max_rank: int) -> tuple[int, float]:
    """The adapter's rank and alpha, once its config asks for nothing but plain LoRA."""
    kind = settings.get("peft_type", "LORA")
    if kind != "LORA":
        raise ValueError(f"{config_path}: peft_type {kind!r}; only LORA adapters are served")
    for name in MUST_BE_UNSET:
        if settings.get(name):
            raise ValueError(f"{config_path}: {name}={settings[name]!r} is not supported "
                             "(plain LoRA only)")
    bias = settings.get("bias", "none")
    if bias != "none":
        raise ValueError(f"{config_path}: bias={bias!r} is not supported (only 'none')")
    targets = settings.get("target_modules")
    if isinstance(targets, list):
        other = sorted(set(targets) - set(TARGETS))
        if other:
            raise ValueError(f"{config_path}: target_modules {', '.join(other)} outside "
                             f"the projections this engine adapts ({', '.join(TARGETS)})")
    rank, alpha = settings.get("r"), settings.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{config_path}: r={rank!r} is not a positive integer")
    if rank > max_rank:
        raise ValueError(f"{config_path}: r={rank} is above this engine's "
                         f"max_lora_rank={max_rank}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise ValueError(f"{config_path}: lora_alpha={alpha!r} is not a number")
    return rank, float(alpha)


def _pair_tensors(weights_path: Path, tensors: Mapping[str, torch.Tensor], num_layers: int
                  ) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """(layer, module) -> {"A": ..., "B": ...}; refuses a tensor of anything else."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None or _PARENT.get(m[3]) != m[2]:
            raise ValueError(f"{weights_path}: tensor {key} is not a LoRA A or B weight of "
                             f"a decoder projection ({', '.join(TARGETS)})")
        layer = int(m[1])
        if layer >= num_layers:
            raise ValueError(f"{weights_path}: tensor {key} is for layer {layer}; the base "
                             f"model has {num_layers} layers")
        pairs.setdefault((layer, m[3]), {})[m[4]] = tensor
    for (layer, module), pair in pairs.items():
        if len(pair) != 2:
            missing = "B" if "A" in pair else "A"
            raise ValueError(f"{weights_path}: layer {layer} {module} has no lora_{missing}")
    return pairs


def _build_layers(weights_path: Path, pairs, places: dict[str, Projection], rank: int,
                  num_layers: int) -> tuple[Mapping[str, tuple[LoraTarget, ...]], ...]:
    """Each layer's targets grouped by fused Linear, after checking every shape."""
    layers: list[dict[str, list[LoraTarget]]] = [{} for _ in range(num_layers)]
    for (layer, module), pair in sorted(pairs.items()):
        place = places[module]
        want_a, want_b = (rank, place.in_features), (place.end - place.start, rank)
        for part, want in (("A", want_a), ("B", want_b)):
            got = tuple(pair[part].shape)
            if got != want:
                raise ValueError(f"{weights_path}: layer {layer} {module} lora_{part} has "
                                 f"shape {list(got)}; the base model (r={rank}) needs "
                                 f"{list(want)}")
        target = LoraTarget(module, Linear(pair["A"].float()), Linear(pair["B"].float()),
                            place.start, place.end)
        layers[layer].setdefault(place.fused, []).append(target)
    return tuple({fused: tuple(ts) for fused, ts in layer.items()} for layer in layers)


def same_directory(a: str | Path, b: str | Path) -> bool:
    """True when two adapter paths name the same directory (loading a name again from
    it is a no-op)."""
    return Path(a).resolve() == Path(b).resolve()


class LoraSlots:
    """The adapters an engine has loaded, by name, at most ``capacity`` at once.

    Pure bookkeeping, owned by the engine core (its thread alone changes it); whether a
    request still uses an adapter is the core's to check before ``remove``.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._loaded: dict[str, LoraWeights] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._loaded

    def add(self, name: str, adapter: LoraWeights) -> None:
        """Take a slot for ``adapter`` under ``name`` (nothing changes when it is loaded
        from the same directory already); ValueError when the name is taken by another
        directory or no slot is left."""
        if not name:
            raise ValueError("an adapter needs a non-empty name")
        have = self._loaded.get(name)
        if have is not None:
            if same_directory(have.path, adapter.path):
                return
            raise ValueError(f"adapter {name!r} is loaded from {have.path} already; "
                             f"unload it before loading {adapter.path}")
        if len(self._loaded) >= self.capacity:
            raise ValueError(f"no LoRA slot left for {name!r}: max_loras={self.capacity} "
                             f"adapters are loaded ({', '.join(sorted(self._loaded))})")
        self._loaded[name] = adapter

    def remove(self, name: str) -> None:
        """Free ``name``'s slot; KeyError when it is not loaded."""
        if name not in self._loaded:
            raise KeyError(f"adapter {name!r} is not loaded")
        del self._loaded[name]

    def get(self, name: str) -> LoraWeights:
        """The adapter loaded under ``name``; ValueError when there is none."""
        adapter = self._loaded.get(name)
        if adapter is None:
            raise ValueError(f"adapter {name!r} is not loaded")
        return adapter

    def paths(self) -> dict[str, str]:
        """Name -> the directory each loaded adapter was read from."""
        return {name: a.path for name, a in self._loaded.items()}


LoraRows = list[tuple[LoraWeights, torch.Tensor]]
"""A step's adapters and the batch rows (long tensor) that use each; rows absent from
every entry use the base model."""


def add_lora(y: torch.Tensor, x: torch.Tensor, layer: int, fused: str,
             loras: LoraRows) -> torch.Tensor:
    """Add every adapter's delta for fused Linear ``fused`` of ``layer`` into its rows of
    ``y`` [R, out] (in place, after the base projection and its bias, as PEFT adds it);
    ``x`` [R, in] is that Linear's input.  Returns ``y``."""
    for adapter, rows in loras:
        targets = adapter.layers[layer].get(fused, ())
        if not targets:
            continue
        xr = x.index_select(0, rows)  # [n, in]
        for t in targets:
            delta = t.b(t.a(xr)) * adapter.scale  # [n, end - start]
            y[:, t.start : t.end].index_add_(0, rows, delta)
    return y
