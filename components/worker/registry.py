"""The engine registry: the one place that names engines.

Each entry maps an engine name (a section's ``engine`` key) to

- ``sections``: the module whose ``SECTIONS`` maps each role (agg, decode, prefill) to
  that engine's config section model;
- ``params``: its ``EngineRequestParams``, the OpenAI request parameters it honours (the
  supervisor hands the graph's to the frontend, which refuses the others by name);
- ``engine``: its class implementing the ``Engine`` protocol (a unit test checks each
  against the protocol's members);
- ``host``: what brings the engine up in a worker process (``hosting.host_in_process``
  unless the engine has more to set up);
- ``factory``: what builds the engine object, for the in-process host;
- ``serves_agg``: for an engine that serves the aggregated `generate` endpoint itself
  (the mocker's child process), its own aggregated main instead of the shell's.

Everything is named as ``"module:attribute"`` and imported only when asked for, so a
worker process imports its own engine's modules and no other.  Adding an engine is its
folder plus one line below.  Every function takes the table as ``engines`` (this
module's ``ENGINES`` unless given), so a test can add an engine without changing it.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from splitserve.contracts.engine import EngineRequestParams
from splitserve.contracts.kit.hosting import Hosted, Role

ENGINES_PKG = "splitserve.components.engines"
IN_PROCESS_HOST = "splitserve.contracts.kit.hosting:host_in_process"


@dataclass(frozen=True)
class EngineSpec:
    """How the worker shells find one engine's sections, request parameters, class,
    host and factory."""

    sections: str
    params: str
    engine: str
    host: str = IN_PROCESS_HOST
    factory: str | None = None
    serves_agg: str | None = None


def _in(folder: str, **refs: str) -> EngineSpec:
    """The entry of an engine under ``ENGINES_PKG``: ``refs`` relative to its folder."""
    pkg = f"{ENGINES_PKG}.{folder}"
    return EngineSpec(sections=f"{pkg}.sections", params=f"{pkg}.capabilities:REQUEST_PARAMS",
                      **{k: f"{pkg}.{v}" for k, v in refs.items()})


ENGINES: dict[str, EngineSpec] = {
    "torch": _in("torch_cpu", engine="adapter:TorchEngine", host="host:host_torch"),
    "vllm": _in("vllm", engine="engine:VllmEngine", factory="engine:make_engine"),
    "sglang": _in("sglang", engine="engine:SglangEngine", factory="engine:make_engine"),
    "trtllm": _in("trtllm", engine="engine:TrtllmEngine", factory="engine:make_engine"),
    "mocker": _in("mocker", engine="adapter:MockerEngine", host="host:host_mocker",
                  serves_agg="host:serve_aggregated"),
}
DEFAULT_ENGINE = "torch"
"""The engine of a section that names none."""


def resolve(ref: str) -> Any:
    """The object a ``"module:attribute"`` (or bare module) reference names."""
    module, _, attr = ref.partition(":")
    loaded = importlib.import_module(module)
    return getattr(loaded, attr) if attr else loaded


def spec(engine: str, engines: Mapping[str, EngineSpec] = ENGINES) -> EngineSpec:
    """The registry entry of ``engine``; raises ValueError for an unknown name."""
    try:
        return engines[engine]
    except KeyError:
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(engines)}") from None


def section(engine: str, role: Role, engines: Mapping[str, EngineSpec] = ENGINES) -> type:
    """The config section model of ``engine`` for ``role``."""
    return resolve(spec(engine, engines).sections).SECTIONS[role]


def section_choices(role: Role, engines: Mapping[str, EngineSpec] = ENGINES
                    ) -> dict[str, type]:
    """Engine name -> section model for ``role``, every engine (the catalog's selector)."""
    return {name: section(name, role, engines) for name in engines}


def request_params(engine: str, engines: Mapping[str, EngineSpec] = ENGINES
                   ) -> EngineRequestParams:
    """The OpenAI request parameters ``engine`` declares it honours (its folder's)."""
    declared = resolve(spec(engine, engines).params)
    if not isinstance(declared, EngineRequestParams):
        raise TypeError(f"engine {engine!r}: {spec(engine, engines).params} is a "
                        f"{type(declared).__name__}, not EngineRequestParams")
    return declared


def request_params_of(names: Iterable[str], engines: Mapping[str, EngineSpec] = ENGINES
                      ) -> dict[str, EngineRequestParams]:
    """Engine name -> its declared request parameters, for ``names`` (every registered
    engine's, in registry order, for the API docs' table: ``request_params_of(ENGINES)``)."""
    return {name: request_params(name, engines) for name in names}


def engine_class(engine: str, engines: Mapping[str, EngineSpec] = ENGINES) -> type:
    """The class implementing the ``Engine`` protocol for ``engine``."""
    return resolve(spec(engine, engines).engine)


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


async def host_engine(ctx, cfg, role: Role, stack: contextlib.AsyncExitStack,
                      engines: Mapping[str, EngineSpec] = ENGINES) -> Hosted | None:
    """Bring ``cfg``'s engine up for ``role`` through its registered host; None when the
    component was asked to stop before the engine came up."""
    entry = spec(cfg.engine, engines)
    factory = resolve(entry.factory) if entry.factory else None
    return await resolve(entry.host)(ctx, cfg, role, stack, factory=factory)
