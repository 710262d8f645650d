"""The decider registry: kebab-case name -> (params model, factory).

An ordinary object: ``default_decider_registry()`` returns a fresh one with the built-ins;
nothing registers itself on import.  For each decider the registry also derives the model
of a whole ``disaggregated_router`` section using it: the decider's parameters sit next to
``enable`` and ``decider`` at the top of the section, which is how the seed's score policy
is written.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field, create_model

from . import forced, score, threshold
from .types import Decider

_KEBAB = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")


@dataclass(frozen=True)
class DeciderType:
    """One registered decider: its params model, its section model and its factory."""

    name: str
    params_model: type[BaseModel]
    section_model: type[BaseModel]
    factory: Callable[[Any], Decider]


def _section_model(name: str, params_model: type[BaseModel], is_default: bool) -> type[BaseModel]:
    camel = "".join(part.capitalize() for part in name.split("-"))
    description = "Decider type name (kebab-case)."
    if is_default:
        decider_field = Field(default=name, description=description + " Optional: the default.")
    else:
        decider_field = Field(description=description)
    return create_model(
        f"{camel}DisaggregatedRouter", __base__=params_model,
        __doc__=f"`disaggregated_router` section using the `{name}` decider.",
        enable=(bool, Field(description="false: always prefill locally (reason 'disabled').")),
        decider=(Literal[name], decider_field),
        protect_tpot_ms=(float | None, Field(
            default=None, gt=0, description="A local verdict goes remote (reason "
            "'protects-decoding') when its prefill would stall an answer decoding in the "
            "same batch past this TPOT (ms) or its QoS class's tpot_ms, whichever is "
            "tighter, predicted from the measured prefill speed "
            "(components/worker/stall_guard.py).  Unset: the classes' targets alone.")),
    )


class DeciderRegistry:
    """Maps decider names to ``DeciderType``; read by the config loader and ``build_decider``."""

    def __init__(self, default_name: str) -> None:
        self.default_name = default_name
        self._types: dict[str, DeciderType] = {}

    def register(self, name: str, params_model: type[BaseModel],
                 factory: Callable[[Any], Decider]) -> None:
        """Add a decider; called while assembling a registry, before configs are loaded."""
        if not _KEBAB.match(name):
            raise ValueError(f"decider name {name!r} is not kebab-case")
        if name in self._types:
            raise ValueError(f"decider {name!r} is already registered")
        section = _section_model(name, params_model, name == self.default_name)
        self._types[name] = DeciderType(name, params_model, section, factory)

    def get(self, name: str) -> DeciderType | None:
        """Return the decider registered as ``name``, or None."""
        return self._types.get(name)

    def names(self) -> list[str]:
        """Return the registered names, sorted."""
        return sorted(self._types)

    def types(self) -> list[DeciderType]:
        """Return every registered decider, sorted by name."""
        return [self._types[name] for name in self.names()]


def default_decider_registry() -> DeciderRegistry:
    """Return a new registry with ``score`` (the default), ``threshold`` and ``forced``."""
    registry = DeciderRegistry(default_name=score.TYPE_NAME)
    registry.register(score.TYPE_NAME, score.Params, score.ScoreDecider)
    registry.register(threshold.TYPE_NAME, threshold.Params, threshold.ThresholdDecider)
    registry.register(forced.TYPE_NAME, forced.Params, forced.ForcedDecider)
    return registry
