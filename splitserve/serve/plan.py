"""Resolve a graph and a config into the list of processes `dynamo serve` will start.

``build_plan`` is pure: it validates every section and returns a ``ServePlan``; the
supervisor only executes it, and ``dynamo serve --dry-run`` only prints it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from splitserve.components.worker import registry
from splitserve.components.worker.registry import EngineSpec
from splitserve.contracts.config import (
    CommonConfig,
    ComponentRunConfig,
    ComponentConfig,
    ConfigError,
    apply_overrides,
    context_length_checks,
    format_validation_error,
    model_checks,
    placement_checks,
    read_yaml,
)
from splitserve.contracts.engine import EngineRequestParams
from splitserve.serve.graph import Graph

POLICY_FOLLOWER = "splitserve.components.policy.component:follow_policy"
"""What each component process calls to follow live policy versions (the components
stand below the policy store, so the supervisor names it for them)."""


@dataclass
class ComponentPlan:
    """A component of the plan: its validated config and its linked dependencies."""

    name: str
    entrypoint: str
    config: ComponentConfig
    links: list[str]
    pruned: list[str]
    shutdown_rank: int

    @property
    def replicas(self) -> int:
        return self.config.replicas


@dataclass
class ServePlan:
    """Everything needed to start a graph; printed by ``--dry-run``."""

    graph_ref: str
    source: str
    common: CommonConfig
    components: list[ComponentPlan]
    ignored_sections: list[str] = field(default_factory=list)
    engine_params: dict[str, EngineRequestParams] = field(default_factory=dict)
    """What each engine of ``engines()`` declares it honours (from the engine registry);
    every replica's run config carries it, for the frontend."""

    def component(self, name: str) -> ComponentPlan:
        return next(c for c in self.components if c.name == name)

    def argv(self, comp: ComponentPlan, config_file: Path) -> list[str]:
        """Command line of one replica."""
        return [sys.executable, "-m", comp.entrypoint, "--config", str(config_file)]

    def run_config(self, comp: ComponentPlan, replica: int, status_file: Path) -> ComponentRunConfig:
        """The config file content for one replica of ``comp``."""
        return ComponentRunConfig(
            component=comp.name, replica=replica, common=self.common,
            config=comp.config.model_dump(mode="json"), links=comp.links,
            status_file=str(status_file), engines=self.engines(),
            engine_params=self.engine_params, policy_follower=POLICY_FOLLOWER)

    def engines(self) -> list[str]:
        """Engine names of the sections that have one (``engine: torch`` ...), sorted."""
        return sorted({e for c in self.components
                       if isinstance(e := getattr(c.config, "engine", None), str)})

    def replica_env(self, comp: ComponentPlan, replica: int) -> dict[str, str]:
        """Environment one replica gets on top of the section's ``env``: its GPUs as
        ``CUDA_VISIBLE_DEVICES`` when the section assigns devices (an empty value, no
        GPU, for a replica beyond the device list).  Called by the supervisor at every
        spawn."""
        devices = comp.config.replica_devices(replica)
        if devices is None:
            return {}
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in devices)}

    def placement(self, comp: ComponentPlan) -> list[dict[str, Any]]:
        """Per replica: its environment from the plan and the ports it opens beside its
        metrics (sections with ``replica_ports``), as ``--dry-run`` shows them."""
        ports = getattr(comp.config, "replica_ports", None)
        return [{"replica": i, "env": self.replica_env(comp, i),
                 **(ports(i) if ports is not None else {})} for i in range(comp.replicas)]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able description (dry-run output and the control endpoint)."""
        return {
            "graph": self.graph_ref,
            "config": self.source,
            "common": self.common.model_dump(mode="json"),
            "components": [
                {"name": c.name, "entrypoint": c.entrypoint, "replicas": c.replicas,
                 "links": c.links, "pruned": c.pruned, "shutdown_rank": c.shutdown_rank,
                 "placement": self.placement(c),
                 "config": c.config.model_dump(mode="json")}
                for c in self.components
            ],
            "ignored_sections": self.ignored_sections,
        }


def build_plan(graph: Graph, graph_ref: str, raw: dict[str, Any], source: str,
               overrides: list[str] | None = None, known_sections: set[str] | None = None,
               engines: Mapping[str, EngineSpec] = registry.ENGINES) -> ServePlan:
    """Validate ``raw`` (parsed YAML) against the graph's components.

    ``known_sections`` are component names defined anywhere in the graph module (pruned
    ones included): their sections are accepted but ignored.  Any other section is an
    error, so a misspelt component name cannot silently fall back to defaults.  All
    problems are collected and raised together as one ConfigError.  ``engines``: the
    engine registry the graph's engines' request parameters are read from.
    """
    try:
        data = apply_overrides(raw, overrides or [])
    except ValueError as exc:
        raise ConfigError(source, [str(exc)]) from None
    errors: list[str] = []
    try:
        common = CommonConfig.model_validate(data.get("Common") or {})
    except ValidationError as exc:
        errors += format_validation_error("Common", exc)
        common = CommonConfig()
    comps: list[ComponentPlan] = []
    for name in graph.order():
        spec = graph.components[name]
        section = data.get(name)
        if section is None:
            section = {}
        if not isinstance(section, dict):
            errors.append(f"{name}: must be a mapping of fields")
            continue
        try:
            cfg = spec.config_model.model_validate(section)
        except ValidationError as exc:
            errors += format_validation_error(name, exc)
            continue
        problems = cfg.preflight()
        if problems:
            errors += [f"{name}.{p}" for p in problems]
            continue
        comps.append(ComponentPlan(name=name, entrypoint=spec.entrypoint, config=cfg,
                                   links=graph.links_of(name), pruned=graph.pruned_of(name),
                                   shutdown_rank=spec.shutdown_rank))
    errors += cross_section_checks(common, comps)
    allowed = set(graph.components) | graph.defined | (known_sections or set()) | {"Common"}
    ignored = []
    for key in data:
        if key not in allowed:
            known = ", ".join(sorted(allowed))
            errors.append(f"{key}: unknown section (sections here: {known})")
        elif key not in graph.components and key != "Common":
            ignored.append(key)
    if errors:
        raise ConfigError(source, errors)
    plan = ServePlan(graph_ref=graph_ref, source=source, common=common, components=comps,
                     ignored_sections=ignored)
    plan.engine_params = registry.request_params_of(plan.engines(), engines)
    return plan


def cross_section_checks(common: CommonConfig, comps: list[ComponentPlan]) -> list[str]:
    """Checks across the validated sections, called by ``build_plan``: each config's
    ``graph_checks(sections)`` (a worker's KV block size against the router's), the
    model's files, the context window, and GPU placement.  Returns lines of ``Section.field: message``."""
    sections = {c.name: c.config for c in comps}
    errors: list[str] = []
    for c in comps:
        graph_checks = getattr(c.config, "graph_checks", None)
        if graph_checks is not None:
            errors += [f"{c.name}.{p}" for p in graph_checks(sections)]
    errors += model_checks(common)
    errors += context_length_checks(common, sections)
    errors += placement_checks(common, sections)
    return errors


def load_plan(graph: Graph, graph_ref: str, config_path: Path | None,
              overrides: list[str] | None = None, known_sections: set[str] | None = None
              ) -> ServePlan:
    """Read the YAML file (if any) and build the plan."""
    raw = read_yaml(config_path) if config_path else {}
    source = str(config_path) if config_path else "<no config file>"
    return build_plan(graph, graph_ref, raw, source, overrides, known_sections)
