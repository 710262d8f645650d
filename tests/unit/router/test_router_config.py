"""Config validation (with field paths), registry rules, built-ins and the exported files."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from splitserve.components.router import (
    PluginKind,
    PluginRegistry,
    build_router,
    default_registry,
    load_router_config_file,
    parse_router_config,
)
from splitserve.components.router.builtin import BUILTIN_CONFIGS, builtin_config
from splitserve.components.router.schema import router_config_schema
from splitserve.contracts.validation import error_paths

from splitserve.contracts.models import StrictModel

from .router_factories import request, snapshot, worker

pytestmark = pytest.mark.unit

CONFIGS = Path(__file__).resolve().parents[3] / "configs"

GOOD = {
    "plugins": [
        {"name": "overlap", "type": "kv-overlap"},
        {"name": "load", "type": "least-requests"},
        {"name": "cost", "type": "latency-cost", "parameters": {"occupancy_weight": 3.0}},
        {"name": "alive", "type": "healthy"},
        {"name": "pick", "type": "max-score"},
        {"name": "draw", "type": "weighted-random"},
    ],
    "schedulingProfiles": [{"name": "default", "plugins": [
        {"pluginRef": "overlap", "weight": 2}, {"pluginRef": "load", "weight": 1},
        {"pluginRef": "pick"}]}],
}


def edited(path: str, value: object) -> dict:
    """GOOD with the dotted ``path`` set to ``value`` (``None`` deletes the key)."""
    document = copy.deepcopy(GOOD)
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    node = document
    for part in parents:
        node = node[part]
    if value is None:
        del node[last]
    else:
        node[last] = value
    return document


def test_seed_example_builds_and_routes():
    registry = default_registry()
    rt = build_router(parse_router_config(GOOD, registry), registry)
    decision = rt.route(request(4), snapshot(worker(1), worker(2), overlap={2: 4}))
    assert (decision.profile, decision.worker_id) == ("default", 2)


BAD = {
    "unknown top-level key": (edited("extra", 1), "extra"),
    "unknown plugin key": (edited("plugins.0.params", {}), "plugins.0.params"),
    "unknown plugin type": (edited("plugins.1.type", "fewest-requests"), "plugins.1.type"),
    "unknown parameter": (edited("plugins.2.parameters", {"occupancy": 3.0}),
                          "plugins.2.parameters.occupancy"),
    "bad parameter value": (edited("plugins.2.parameters", {"cache_match_weight": -1}),
                            "plugins.2.parameters.cache_match_weight"),
    "bad picker parameter": (edited("plugins.4.parameters", {"tie_break": "first"}),
                             "plugins.4.parameters.tie_break"),
    "duplicate plugin name": (edited("plugins.1.name", "overlap"), "plugins.1.name"),
    "unknown pluginRef": (edited("schedulingProfiles.0.plugins.1.pluginRef", "lod"),
                          "schedulingProfiles.0.plugins.1.pluginRef"),
    "negative weight": (edited("schedulingProfiles.0.plugins.0.weight", -2),
                        "schedulingProfiles.0.plugins.0.weight"),
    "weight on a picker": (edited("schedulingProfiles.0.plugins.2.weight", 1),
                           "schedulingProfiles.0.plugins.2.weight"),
    "weight on a filter": (edited("schedulingProfiles.0.plugins.2",
                                  {"pluginRef": "alive", "weight": 1}),
                           "schedulingProfiles.0.plugins.2.weight"),
    "no picker": (edited("schedulingProfiles.0.plugins.2", {"pluginRef": "cost"}),
                  "schedulingProfiles.0.plugins"),
    "two pickers": (edited("schedulingProfiles.0.plugins.1", {"pluginRef": "draw"}),
                    "schedulingProfiles.0.plugins.2.pluginRef"),
    "plugin twice in a profile": (
        edited("schedulingProfiles.0.plugins.1", {"pluginRef": "overlap"}),
        "schedulingProfiles.0.plugins.1.pluginRef"),
    "profile key misspelt": (edited("schedulingProfiles.0.plugins.0", {"pluginref": "overlap"}),
                             "schedulingProfiles.0.plugins.0.pluginRef"),
    "empty profile": (edited("schedulingProfiles.0.plugins", []),
                      "schedulingProfiles.0.plugins"),
    "unknown default profile": (edited("defaultProfile", "fast"), "defaultProfile"),
}


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_bad_config_names_the_field(case):
    document, path = case
    with pytest.raises(ValidationError) as caught:
        parse_router_config(document, default_registry(), source="router.yaml")
    assert path in error_paths(caught.value)
    assert "router.yaml" in str(caught.value)


def test_file_errors_carry_the_file_name(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(edited("schedulingProfiles.0.plugins.0.weight", -1)))
    with pytest.raises(ValidationError) as caught:
        load_router_config_file(path, default_registry())
    assert str(path) in str(caught.value)
    path.write_text("- just a list\n")
    with pytest.raises(ValidationError, match="must be a mapping"):
        load_router_config_file(path, default_registry())


def test_registry_rules():
    registry = PluginRegistry()
    registry.register("my-scorer", PluginKind.SCORER, StrictModel, object)
    with pytest.raises(ValueError, match="already registered"):
        registry.register("my-scorer", PluginKind.SCORER, StrictModel, object)
    with pytest.raises(ValueError, match="kebab-case"):
        registry.register("MyScorer", PluginKind.SCORER, StrictModel, object)
    assert registry.names() == ["my-scorer"]
    assert default_registry() is not default_registry()
    assert {"healthy", "kv-headroom", "queue-limit", "round-robin", "least-requests",
            "kv-overlap", "latency-cost", "max-score", "weighted-random"} <= set(
                default_registry().names())


@pytest.mark.parametrize("name", sorted(BUILTIN_CONFIGS))
def test_builtin_configs_validate_and_match_shipped_yaml(name):
    registry = default_registry()
    built = build_router(builtin_config(name, registry), registry)
    assert built.route(request(), snapshot(worker(1), worker(2))).worker_id in (1, 2)
    shipped = load_router_config_file(CONFIGS / "router" / f"{name}.yaml", registry)
    assert shipped == builtin_config(name, registry)


def test_exported_schema_is_current():
    shipped = json.loads((CONFIGS / "schemas" / "router.schema.json").read_text())
    assert shipped == json.loads(json.dumps(router_config_schema(default_registry())))
    variants = {ref["$ref"].rsplit("/", 1)[-1]
                for ref in shipped["properties"]["plugins"]["items"]["oneOf"]}
    assert "LatencyCostPlugin" in variants
    assert shipped["$defs"]["LatencyCostPlugin"]["properties"]["parameters"]
