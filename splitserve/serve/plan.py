"""Resolve a graph and a config into the list of processes `dynamo serve` will start.

``build_plan`` is pure: it validates every section and returns a ``ServePlan``; the
supervisor only executes it, and ``dynamo serve --dry-run`` only prints it.
"""

from __future__ import annotations

import re
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
    component: str = ""
    """The graph component it runs (``Worker``); ``name`` adds the pool
    (``Worker@qwen``).  Empty: ``name``."""
    pool: str | None = None
    """Its model pool (a key of ``Models``); None: the graph's first model."""
    common: CommonConfig | None = None
    """The pool's ``Common`` (its model and namespace); None: the graph's."""

    def __post_init__(self) -> None:
        self.component = self.component or self.name

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
    root: str = ""
    """The component the graph is served from (the frontend)."""
    pools: dict[str, CommonConfig] = field(default_factory=dict)
    """The model pools of ``Models`` beside the first model, by pool name: each one's
    ``Common`` (its model, served name and namespace)."""
    only: list[str] = field(default_factory=list)
    """The components this host runs when the graph is spread over hosts (``dynamo serve
    --only``, ``hosts.select_components``); empty: the whole graph."""

    def served_models(self) -> dict[str, str]:
        """Served model name -> the pool serving it ("" for the graph's first model)."""
        return {self.common.served_model_name: "",
                **{c.served_model_name: pool for pool, c in self.pools.items()}}

    def component(self, name: str) -> ComponentPlan:
        return next(c for c in self.components if c.name == name)

    def argv(self, comp: ComponentPlan, config_file: Path) -> list[str]:
        """Command line of one replica."""
        return [sys.executable, "-m", comp.entrypoint, "--config", str(config_file)]

    def run_config(self, comp: ComponentPlan, replica: int, status_file: Path) -> ComponentRunConfig:
        """The config file content for one replica of ``comp``."""
        return ComponentRunConfig(
            component=comp.component, replica=replica, common=comp.common or self.common,
            config=comp.config.model_dump(mode="json"), links=comp.links,
            status_file=str(status_file), engines=self.engines(),
            engine_params=self.engine_params, policy_follower=POLICY_FOLLOWER,
            pool=comp.pool, pools=self.pools)

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
            "models": {pool: {"model": c.model, "served_model_name": c.served_model_name,
                              "namespace": c.namespace}
                       for pool, c in self.pools.items()},
            "components": [
                {"name": c.name, "entrypoint": c.entrypoint, "replicas": c.replicas,
                 "model": (c.common or self.common).served_model_name,
                 "links": c.links, "pruned": c.pruned, "shutdown_rank": c.shutdown_rank,
                 "placement": self.placement(c),
                 "config": c.config.model_dump(mode="json")}
                for c in self.components
            ],
            "ignored_sections": self.ignored_sections,
            "only": self.only,
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
        cfg = _section_config(spec, section, name, errors)
        if cfg is None:
            continue
        comps.append(ComponentPlan(name=name, entrypoint=spec.entrypoint, config=cfg,
                                   links=graph.links_of(name), pruned=graph.pruned_of(name),
                                   shutdown_rank=spec.shutdown_rank))
    # A section that failed validation is missing from ``comps``: checks across the
    # sections would then report its absence (a worker to route to) on top of its own
    # error, so they wait until every section is valid.
    whole = len(comps) == len(graph.order())
    errors += cross_section_checks(common, comps) if whole else model_checks(common)
    pools, pool_comps, pool_errors = model_pools(graph, data, common)
    errors += pool_errors
    errors += _root_serves_pools(graph.root, comps, pools)
    errors += placement_checks(common, {c.name: c.config for c in comps + pool_comps})
    allowed = (set(graph.components) | graph.defined | (known_sections or set())
               | {"Common", "Models"})
    ignored = []
    for key in data:
        if key not in allowed:
            known = ", ".join(sorted(allowed))
            errors.append(f"{key}: unknown section (sections here: {known})")
        elif key not in graph.components and key not in ("Common", "Models"):
            ignored.append(key)
    if errors:
        raise ConfigError(source, errors)
    plan = ServePlan(graph_ref=graph_ref, source=source, common=common,
                     components=comps + pool_comps, ignored_sections=ignored, pools=pools,
                     root=graph.root)
    plan.engine_params = registry.request_params_of(plan.engines(), engines)
    return plan


def cross_section_checks(common: CommonConfig, comps: list[ComponentPlan],
                         prefix: str = "") -> list[str]:
    """Checks across the validated sections of one model pool, called by
    ``build_plan``: each config's ``graph_checks(sections)`` (a worker's KV block size
    against the router's), the model's files and the context window (GPU placement is
    checked across every pool).  Returns lines of ``Section.field: message``, each
    after ``prefix`` (``Models.<pool>.`` for a pool)."""
    sections = {c.component: c.config for c in comps}
    errors: list[str] = []
    for c in comps:
        graph_checks = getattr(c.config, "graph_checks", None)
        if graph_checks is not None:
            errors += [f"{c.component}.{p}" for p in graph_checks(sections)]
    errors += model_checks(common)
    errors += context_length_checks(common, sections)
    if prefix:  # a pool's own Common fields sit in the pool (Models.<pool>.model)
        errors = [e.removeprefix("Common.") for e in errors]
    return [prefix + e for e in errors]


POOL_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,30}$")
POOL_COMMON_FIELDS = ("model", "served_model_name", "context_length")
"""What a pool of ``Models`` sets of ``Common``; the rest is the graph's."""


def _merged(base: Any, over: Any) -> Any:
    """``over`` laid over ``base``, mappings merged key by key."""
    if isinstance(base, dict) and isinstance(over, dict):
        return {**base, **{k: _merged(base.get(k), v) for k, v in over.items()}}
    return over


def model_pools(graph: Graph, data: dict[str, Any], common: CommonConfig
                ) -> tuple[dict[str, CommonConfig], list[ComponentPlan], list[str]]:
    """The config's ``Models``: more models served by the same frontend, each by its own
    copy of every other component of the graph (its workers, router, planner), in its
    own Dynamo namespace.  Shape::

        Models:
          qwen:                       # the pool's name: lowercase letters, digits, - _
            model: /models/Qwen3-0.6B # required: a directory or a cached hub id
            served_model_name: qwen3  # optional (default: from model)
            context_length: 8192      # optional (default: the model's own)
            Worker: {replicas: 2}     # optional: laid over the graph's Worker section

    Returns each pool's ``Common``, the pools' component plans (named
    ``<Component>@<pool>``) and the errors found, each naming its field."""
    raw = data.get("Models")
    if raw is None:
        return {}, [], []
    if not isinstance(raw, dict):
        return {}, [], ["Models: must be a mapping of pool name to its model and sections"]
    pools: dict[str, CommonConfig] = {}
    plans: list[ComponentPlan] = []
    errors: list[str] = []
    served = {common.served_model_name: "Common.model"}
    members = [n for n in graph.order() if n != graph.root]
    for pool, body in raw.items():
        where = f"Models.{pool}"
        if not isinstance(pool, str) or not POOL_NAME.match(pool):
            errors.append(f"{where}: a pool name is 1-31 lowercase letters, digits, - or _, "
                          "starting with a letter")
            continue
        if not isinstance(body, dict):
            errors.append(f"{where}: must be a mapping (model, served_model_name, "
                          "context_length, and sections of the graph's components)")
            continue
        unknown = [k for k in body if k not in POOL_COMMON_FIELDS and k not in members]
        if unknown:
            allowed = ", ".join(list(POOL_COMMON_FIELDS) + members)
            errors += [f"{where}.{k}: unknown field (a pool sets: {allowed})" for k in unknown]
            continue
        if "model" not in body:
            errors.append(f"{where}.model: required (the pool's model directory or hub id)")
            continue
        base = common.model_dump(exclude={"model", "served_model_name", "context_length"})
        try:
            pc = CommonConfig.model_validate(
                {**base, **{k: body[k] for k in POOL_COMMON_FIELDS if k in body},
                 "namespace": f"{common.namespace}-{pool}"})
        except ValidationError as exc:
            errors += format_validation_error(where, exc)
            continue
        if pc.served_model_name in served:
            errors.append(f"{where}.served_model_name: {pc.served_model_name!r} is already "
                          f"served by {served[pc.served_model_name]}")
            continue
        served[pc.served_model_name] = where
        pools[pool] = pc
        mine = _pool_components(graph, data, pool, pc, body, members, errors)
        errors += (cross_section_checks(pc, mine, prefix=f"{where}.")
                   if len(mine) == len(members) else
                   [f"{where}.{e.removeprefix('Common.')}" for e in model_checks(pc)])
        plans += mine
    return pools, plans, errors


def _section_config(spec, section: Any, where: str, errors: list[str]):
    """``section`` validated by ``spec``'s config model and its preflight, or None with
    the problems added to ``errors``, each after ``where`` (the section's path)."""
    if not isinstance(section, dict):
        errors.append(f"{where}: must be a mapping of fields")
        return None
    try:
        cfg = spec.config_model.model_validate(section)
    except ValidationError as exc:
        errors += format_validation_error(where, exc)
        return None
    problems = cfg.preflight()
    if problems:
        errors += [f"{where}.{p}" for p in problems]
        return None
    return cfg


def _root_serves_pools(root: str, comps: list[ComponentPlan],
                       pools: dict[str, CommonConfig]) -> list[str]:
    """A frontend routing in its own process serves one model (its routing service
    watches the first model's workers): refuse it with ``Models``."""
    cfg = next((c.config for c in comps if c.name == root), None)
    if pools and getattr(cfg, "routing", None) == "in_process":
        return [f"{root}.routing: in_process routes one model; a graph with Models routes "
                "each pool through its own Router process (routing: router)"]
    return []


def _pool_components(graph: Graph, data: dict[str, Any], pool: str, common: CommonConfig,
                     body: dict[str, Any], members: list[str], errors: list[str]
                     ) -> list[ComponentPlan]:
    """One pool's copy of each component but the graph's root: the graph's section
    with the pool's laid over it."""
    out: list[ComponentPlan] = []
    for name in members:
        spec = graph.components[name]
        section = _merged(data.get(name) or {}, body.get(name) or {})
        where = f"Models.{pool}.{name}"
        cfg = _section_config(spec, section, where, errors)
        if cfg is None:
            continue
        if name == "Planner" and "components" not in section:
            # the pool's planner scales the pool's own prefill and decode workers
            cfg = cfg.model_copy(update={"components": {
                role: f"{comp}@{pool}" for role, comp in cfg.components.items()}})
        out.append(ComponentPlan(name=f"{name}@{pool}", entrypoint=spec.entrypoint,
                                 config=cfg, links=graph.links_of(name),
                                 pruned=graph.pruned_of(name),
                                 shutdown_rank=spec.shutdown_rank, component=name,
                                 pool=pool, common=common))
    return out


def load_plan(graph: Graph, graph_ref: str, config_path: Path | None,
              overrides: list[str] | None = None, known_sections: set[str] | None = None
              ) -> ServePlan:
    """Read the YAML file (if any) and build the plan."""
    raw = read_yaml(config_path) if config_path else {}
    source = str(config_path) if config_path else "<no config file>"
    return build_plan(graph, graph_ref, raw, source, overrides, known_sections)
