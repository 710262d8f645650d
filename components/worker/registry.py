"""The engine registry: the one place that names engines.

Each entry maps an engine name (a section's ``engine`` key) to

- ``sections``: the module whose ``SECTIONS`` maps each role (agg, decode, prefill) to
  that engine's config section model;
- ``host``: what brings the engine up in a worker process (``hosting.host_in_process``
  unless the engine has more to set up);
- ``factory``: what builds the engine object, for the in-process host;
- ``serves_agg``: for an engine that serves the aggregated `generate` endpoint itself
  (the mocker's child process), its own aggregated main instead of the shell's.

Everything is named as ``"module:attribute"`` and imported only when asked for, so a
worker process imports its own engine's modules and no other.  Adding an engine is its
folder plus one line below.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Any

from splitserve.contracts.kit.hosting import Hosted, Role

ENGINES_PKG = "splitserve.components.engines"
IN_PROCESS_HOST = "splitserve.contracts.kit.hosting:host_in_process"


@dataclass(frozen=True)
class EngineSpec:
    """How the worker shells find one engine's sections, host and factory."""

    sections: str
    host: str = IN_PROCESS_HOST
    factory: str | None = None
    serves_agg: str | None = None


ENGINES: dict[str, EngineSpec] = {
    "torch": EngineSpec(f"{ENGINES_PKG}.torch_cpu.sections",
                        host=f"{ENGINES_PKG}.torch_cpu.host:host_torch"),
    "mocker": EngineSpec(f"{ENGINES_PKG}.mocker.sections",
                         host=f"{ENGINES_PKG}.mocker.host:host_mocker",
                         serves_agg=f"{ENGINES_PKG}.mocker.host:serve_aggregated"),
    "vllm": EngineSpec(f"{ENGINES_PKG}.vllm.sections",
                       factory=f"{ENGINES_PKG}.vllm.engine:make_engine"),
    "sglang": EngineSpec(f"{ENGINES_PKG}.sglang.sections",
                         factory=f"{ENGINES_PKG}.sglang.engine:make_engine"),
    "trtllm": EngineSpec(f"{ENGINES_PKG}.trtllm.sections",
                         factory=f"{ENGINES_PKG}.trtllm.engine:make_engine"),
}
DEFAULT_ENGINE = "torch"
"""The engine of a section that names none."""


def resolve(ref: str) -> Any:
    """The object a ``"module:attribute"`` (or bare module) reference names."""
    module, _, attr = ref.partition(":")
    loaded = importlib.import_module(module)
    return getattr(loaded, attr) if attr else loaded


def spec(engine: str) -> EngineSpec:
    """The registry entry of ``engine``; raises ValueError for an unknown name."""
    try:
        return ENGINES[engine]
    except KeyError:
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}") from None


def section(engine: str, role: Role) -> type:
    """The config section model of ``engine`` for ``role``."""
    return resolve(spec(engine).sections).SECTIONS[role]


def section_choices(role: Role) -> dict[str, type]:
    """Engine name -> section model for ``role``, every engine (the catalog's selector)."""
    return {name: section(name, role) for name in ENGINES}


def check_section(role: Role, cfg: Any) -> None:
    """What a role's section needs beyond its engine's model, checked when the graph's
    config is loaded: a decode worker's offload policy, validated by the decider plugins.
    Raises ``ValidationError`` with the field path."""
    if role != "decode":
        return
    from pydantic import ValidationError

    from splitserve.components.disagg import parse_disaggregated_router
    from splitserve.contracts.validation import retitled

    try:
        parse_disaggregated_router(cfg.disaggregated_router)  # the value stays as written
    except ValidationError as exc:
        raise retitled(exc, exc.title, ("disaggregated_router",)) from None


def engine_of(raw_section: dict[str, Any]) -> str:
    """The engine a raw (not yet validated) section names."""
    return raw_section.get("engine", DEFAULT_ENGINE)


async def host_engine(ctx, cfg, role: Role, stack: contextlib.AsyncExitStack
                      ) -> Hosted | None:
    """Bring ``cfg``'s engine up for ``role`` through its registered host; None when the
    component was asked to stop before the engine came up."""
    entry = spec(cfg.engine)
    factory = resolve(entry.factory) if entry.factory else None
    return await resolve(entry.host)(ctx, cfg, role, stack, factory=factory)
