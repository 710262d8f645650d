"""The router config file: plugins built by type name, composed into scheduling profiles.

Shape (modelled on the Gateway API Inference Extension's EndpointPickerConfig)::

    plugins:                                   # every plugin instance, by name
      - {name: overlap, type: kv-overlap}
      - {name: cost, type: latency-cost, parameters: {occupancy_weight: 3.0}}
      - {name: pick, type: max-score}
    schedulingProfiles:
      - name: default
        normalizeWeights: false                # optional: divide totals by the weight sum
        plugins: [{pluginRef: overlap, weight: 2}, {pluginRef: cost}, {pluginRef: pick}]
    defaultProfile: default                    # optional: the first profile otherwise

Validation happens in two passes, both raising ``pydantic.ValidationError`` with the field
path of each problem: pydantic checks the shape (unknown keys, negative weights), then
``check_router_config`` checks what needs the registry: plugin types, each plugin's
``parameters`` against its type's strict params model, references, and that every profile
has exactly one picker and weights only on scorers.  A scorer without a weight weighs 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError
from pydantic_core import InitErrorDetails

from splitserve.contracts.models import StrictModel

from .protocols import PluginKind
from .registry import PluginRegistry
from splitserve.contracts.validation import Loc, issue, raise_if_any, rebased, retitled

DEFAULT_WEIGHT = 1.0


class PluginSpec(StrictModel):
    """One plugin instance: a unique name, a registered type and that type's parameters."""

    name: str = Field(min_length=1, description="Name that profiles use in `pluginRef`.")
    type: str = Field(description="Registered plugin type, kebab-case (e.g. `kv-overlap`).")
    parameters: dict[str, Any] = Field(
        default_factory=dict,
        description="Parameters of the type; checked against the type's own strict model.")


class PluginRef(StrictModel):
    """A plugin used by a profile; scorers may carry a weight."""

    plugin_ref: str = Field(alias="pluginRef", description="Name of a plugin in `plugins`.")
    weight: float | None = Field(
        default=None, ge=0.0,
        description="Scorers only: multiplier of the scorer's [0, 1] score (default 1).")


class SchedulingProfileSpec(StrictModel):
    """Filters (in order), weighted scorers and exactly one picker."""

    name: str = Field(min_length=1, description="Profile name, shown in every decision.")
    plugins: list[PluginRef] = Field(min_length=1, description="Plugins of the profile.")
    normalize_weights: bool = Field(
        default=False, alias="normalizeWeights",
        description="Divide each total by the sum of scorer weights, keeping totals in [0, 1].")


class RouterConfig(StrictModel):
    """The whole router config file."""

    plugins: list[PluginSpec] = Field(min_length=1, description="Plugin instances.")
    scheduling_profiles: list[SchedulingProfileSpec] = Field(
        alias="schedulingProfiles", min_length=1, description="Scheduling profiles.")
    default_profile: str | None = Field(
        default=None, alias="defaultProfile",
        description="Profile used when the caller names none; the first one if unset.")


def _check_plugins(
    config: RouterConfig, registry: PluginRegistry, errors: list[InitErrorDetails],
) -> tuple[dict[str, PluginKind], dict[str, BaseModel]]:
    kinds: dict[str, PluginKind] = {}
    params: dict[str, BaseModel] = {}
    names: set[str] = set()
    for i, spec in enumerate(config.plugins):
        loc: Loc = ("plugins", i)
        if spec.name in names:
            errors.append(issue(loc + ("name",), f"duplicate plugin name {spec.name!r}",
                                spec.name))
            continue
        names.add(spec.name)
        plugin_type = registry.get(spec.type)
        if plugin_type is None:
            errors.append(issue(loc + ("type",), f"unknown plugin type {spec.type!r}; "
                                f"known: {', '.join(registry.names())}", spec.type))
            continue
        kinds[spec.name] = plugin_type.kind
        try:
            params[spec.name] = plugin_type.params_model.model_validate(spec.parameters)
        except ValidationError as exc:
            errors.extend(rebased(exc, loc + ("parameters",)))
    return kinds, params


def _check_profile(j: int, profile: SchedulingProfileSpec, kinds: dict[str, PluginKind],
                   defined: set[str], errors: list[InitErrorDetails]) -> None:
    loc: Loc = ("schedulingProfiles", j, "plugins")
    pickers = 0
    seen: set[str] = set()
    for k, ref in enumerate(profile.plugins):
        name = ref.plugin_ref
        if name not in defined:
            errors.append(issue(loc + (k, "pluginRef"),
                                f"unknown plugin {name!r}; not in `plugins`", name))
            continue
        if name in seen:
            errors.append(issue(loc + (k, "pluginRef"),
                                f"plugin {name!r} is referenced twice in profile", name))
        seen.add(name)
        kind = kinds.get(name)
        if kind is None:  # its spec was already reported as broken
            continue
        if kind is PluginKind.PICKER:
            pickers += 1
            if pickers > 1:
                errors.append(issue(loc + (k, "pluginRef"),
                                    f"second picker {name!r}; a profile has exactly one", name))
        if kind is not PluginKind.SCORER and ref.weight is not None:
            errors.append(issue(loc + (k, "weight"),
                                f"weight is only allowed on scorers; {name!r} is a {kind}",
                                ref.weight))
    types_known = all(kinds.get(ref.plugin_ref) is not None for ref in profile.plugins)
    if pickers == 0 and types_known:
        errors.append(issue(loc, f"profile {profile.name!r} has no picker",
                            [ref.plugin_ref for ref in profile.plugins]))


def check_router_config(config: RouterConfig, registry: PluginRegistry,
                        source: str = "router config") -> dict[str, BaseModel]:
    """Check what pydantic alone cannot; called before building a router from ``config``.

    Returns the validated params model of every plugin, by plugin name.  Raises one
    ``ValidationError`` titled ``source`` listing every problem with its field path.
    """
    errors: list[InitErrorDetails] = []
    kinds, params = _check_plugins(config, registry, errors)
    defined = {spec.name for spec in config.plugins}
    profile_names: set[str] = set()
    for j, profile in enumerate(config.scheduling_profiles):
        if profile.name in profile_names:
            errors.append(issue(("schedulingProfiles", j, "name"),
                                f"duplicate profile name {profile.name!r}", profile.name))
        profile_names.add(profile.name)
        _check_profile(j, profile, kinds, defined, errors)
    if config.default_profile is not None and config.default_profile not in profile_names:
        errors.append(issue(("defaultProfile",), f"unknown profile {config.default_profile!r}",
                            config.default_profile))
    raise_if_any(source, errors)
    return params


def parse_router_config(data: Mapping[str, Any], registry: PluginRegistry,
                        source: str = "router config") -> RouterConfig:
    """Validate a decoded config document fully; called by loaders and ``policy validate``.

    Returns the config; raises ``ValidationError`` titled ``source`` with field paths.
    """
    try:
        config = RouterConfig.model_validate(data)
    except ValidationError as exc:
        raise retitled(exc, source) from None
    check_router_config(config, registry, source)
    return config


def load_router_config_file(path: Path | str, registry: PluginRegistry) -> RouterConfig:
    """Read and validate a YAML (or JSON) router config; errors are titled with the path."""
    text = Path(path).read_text(encoding="utf-8")
    data = yaml.safe_load(text)
    if not isinstance(data, Mapping):
        raise_if_any(str(path), [issue((), "a router config must be a mapping", data)])
    return parse_router_config(data, registry, source=str(path))
