"""Validation of policy documents: good files load, each mistake names its field path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitserve.components.router.qos import QosConfig, default_classes, resolve_class
from splitserve.components.policy import PolicyError, export_schema, load_policy_file, parse_policy
from splitserve.components.policy.schema import policy_schema

from .policy_factories import CONFIGS, DELETE, edited, full, seed

pytestmark = pytest.mark.unit

CLASSES = "qos.classes"
PREFILL = "autoscale.prefill"
LOCAL_PREFILL = "qos.degradation.disable_remote_prefill_for_low_priority"

# case name -> (path to edit, new value, the one error path expected)
BAD = {
    "unknown top-level key": ("split_polcy", {}, "split_polcy"),
    "unknown key in a section": ("cache.reuse", True, "cache.reuse"),
    "string for an int (no coercion)": ("split_policy.prompt_length_threshold", "256",
                                        "split_policy.prompt_length_threshold"),
    "float for an int": ("split_policy.prompt_length_threshold", 256.5,
                         "split_policy.prompt_length_threshold"),
    "negative weight": ("split_policy.queue_length_weight", -1,
                        "split_policy.queue_length_weight"),
    "missing required field": ("split_policy.decode_load_weight", DELETE,
                               "split_policy.decode_load_weight"),
    "ratio above 1": ("cache.min_cache_hit_ratio", 75, "cache.min_cache_hit_ratio"),
    "yes is not a boolean": ("enable_hotspot_prevention", "yes", "enable_hotspot_prevention"),
    "min above max replicas": (f"{PREFILL}.min_replicas", 13, f"{PREFILL}.min_replicas"),
    "scale_down equal to scale_up": (f"{PREFILL}.scale_down.queue_length", 8,
                                     f"{PREFILL}.scale_down.queue_length"),
    "scale_down above scale_up": ("autoscale.decode.scale_down.kv_cache_usage", 80,
                                  "autoscale.decode.scale_down.kv_cache_usage"),
    "percent above 100": (f"{PREFILL}.scale_up.gpu_utilization", 180,
                          f"{PREFILL}.scale_up.gpu_utilization"),
    "no scaling signal": (f"{PREFILL}.scale_up", {}, f"{PREFILL}.scale_up"),
    "unknown pool": ("autoscale.encode", {}, "autoscale.encode"),
    "duplicate class name": (CLASSES, full()["qos"]["classes"] + [full()["qos"]["classes"][1]],
                             f"{CLASSES}.3.name"),
    "upper-case class name": (f"{CLASSES}.0.name", "Gold", f"{CLASSES}.0.name"),
    "zero ttft": (f"{CLASSES}.0.ttft_ms", 0, f"{CLASSES}.0.ttft_ms"),
    "class without a TPOT target": (f"{CLASSES}.2.tpot_ms", DELETE, f"{CLASSES}.2.tpot_ms"),
    "no classes": (CLASSES, [], CLASSES),
    "default class not defined": ("qos.default_class", "gold", "qos.default_class"),
    "user mapped to unknown class": ("qos.user_map", {"bob": "gold"}, "qos.user_map.bob"),
    "a qos header (the frontend's setting is read)": ("qos.header", "x-priority",
                                                      "qos.header"),
    "string for a qos number (no coercion)": ("qos.low_priority_threshold_ms", "500",
                                              "qos.low_priority_threshold_ms"),
    "negative rejection slack": ("qos.low_priority_threshold_ms", -1,
                                 "qos.low_priority_threshold_ms"),
    "yes is not a qos boolean": ("qos.enable_early_rejection", "yes",
                                 "qos.enable_early_rejection"),
    "unknown key in qos": ("qos.fallback_class", "batch", "qos.fallback_class"),
    "cap of zero tokens": ("qos.degradation.cap_max_tokens.max_tokens", 0,
                           "qos.degradation.cap_max_tokens.max_tokens"),
    "KV usage as a percent": ("qos.degradation.cap_max_tokens.kv_usage_threshold", 85,
                              "qos.degradation.cap_max_tokens.kv_usage_threshold"),
    "unknown degradation": ("qos.degradation.drop_requests", {"enable": True},
                            "qos.degradation.drop_requests"),
    "local-prefill depth under its old name": (f"{LOCAL_PREFILL}.queue_depth", 8,
                                               f"{LOCAL_PREFILL}.queue_depth"),
    "local-prefill depth of zero": (f"{LOCAL_PREFILL}.prefill_queue_depth_threshold", 0,
                                    f"{LOCAL_PREFILL}.prefill_queue_depth_threshold"),
    "adaptive limit of zero tokens": (
        "qos.degradation.adaptive_generation_limit", {"enable": True, "min_tokens": 0},
        "qos.degradation.adaptive_generation_limit.min_tokens"),
    "adaptive limit with a KV range": (
        "qos.degradation.adaptive_generation_limit", {"start_kv_usage": 70},
        "qos.degradation.adaptive_generation_limit.start_kv_usage"),
    "estimator smoothing above 1": ("qos.estimator", {"smoothing": 2},
                                    "qos.estimator.smoothing"),
    "offload weight negative": ("disaggregated_router.policies.1.weight", -0.3,
                                "disaggregated_router.policies.1.weight"),
    "offload unknown decider": ("disaggregated_router.decider", "smart",
                                "disaggregated_router.decider"),
    "offload enable missing": ("disaggregated_router.enable", DELETE,
                               "disaggregated_router.enable"),
    "unknown built-in router": ("router", "fastest", "router"),
    "router plugin of unknown type": (
        "router", {"plugins": [{"name": "p", "type": "warp-drive"}],
                   "schedulingProfiles": [{"name": "d", "plugins": [{"pluginRef": "p"}]}]},
        "router.plugins.0.type"),
    "router profile referencing nothing": (
        "router", {"plugins": [{"name": "p", "type": "max-score"}],
                   "schedulingProfiles": [{"name": "d", "plugins": [{"pluginRef": "q"}]}]},
        "router.schedulingProfiles.0.plugins.0.pluginRef"),
}


def paths(error: PolicyError) -> list[str]:
    return [line.split(": ", 1)[0] for line in error.errors]


@pytest.mark.parametrize("name", list(BAD))
def test_bad_document_names_the_field(name: str) -> None:
    path, value, expected = BAD[name]
    with pytest.raises(PolicyError) as info:
        parse_policy(edited(full(), path, value), "p.yaml")
    assert paths(info.value) == [expected], info.value.errors
    assert info.value.file == "p.yaml"


def test_cross_field_errors_name_both_fields() -> None:
    doc = edited(full(), f"{PREFILL}.min_replicas", 13)
    doc = edited(doc, "qos.default_class", "gold")
    with pytest.raises(PolicyError) as info:
        parse_policy(doc)
    text = "\n".join(info.value.errors)
    assert "min_replicas (13)" in text and "max_replicas (12)" in text
    assert "'gold'" in text and "classes[].name ['interactive', 'standard', 'batch']" in text


def test_every_problem_is_collected() -> None:
    doc = edited(full(), "cache.min_cache_hit_ratio", 2)
    doc = edited(doc, f"{PREFILL}.min_replicas", 13)
    doc = edited(doc, "qos.user_map", {"a": "x", "b": "y"})
    doc = edited(doc, "disaggregated_router.policies.0.weight", -1)
    with pytest.raises(PolicyError) as info:
        parse_policy(doc)
    assert paths(info.value) == ["cache.min_cache_hit_ratio", f"{PREFILL}.min_replicas",
                                 "qos.user_map.a", "qos.user_map.b",
                                 "disaggregated_router.policies.0.weight"]


def test_degradation_without_a_degradable_class_loads() -> None:
    # Degradation steps only ever apply to classes with may_degrade; with none, they
    # never fire (the QoS core's rule), which is not an error.
    doc = full()
    for cls in doc["qos"]["classes"]:
        cls["may_degrade"] = False
    policy = parse_policy(doc)
    assert policy.qos.degradation.cap_max_tokens.enable
    assert not any(cls.may_degrade for cls in policy.qos.classes)


def test_qos_section_is_the_qos_core_config() -> None:
    # The router applies policy.qos as is, so it must be the QoS core's own model.
    policy = parse_policy(full())
    assert type(policy.qos) is QosConfig
    assert resolve_class(None, "nightly-eval", None, policy.qos).name == "batch"
    # header, then metadata, then user_map; unknown names go to default_class
    assert resolve_class(None, "nightly-eval", {"priority": "interactive"},
                         policy.qos).name == "interactive"
    assert resolve_class("gold", None, None, policy.qos).name == "standard"


@pytest.mark.parametrize("doc, message", [
    ({}, "at least one section"),
    ([], "must be a mapping"),
    ("split_policy", "must be a mapping"),
])
def test_document_level_errors(doc, message: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(doc)
    assert paths(info.value) == ["(root)"] and message in info.value.errors[0]


@pytest.mark.parametrize("name", ["seed.yaml", "seed.json"])
def test_shipped_seed_files_load(name: str) -> None:
    policy = load_policy_file(CONFIGS / "policies" / name)
    assert policy.split_policy.prompt_length_threshold == 256
    assert policy.autoscale.decode.max_replicas == 24
    assert policy.qos == QosConfig(enable_early_rejection=True, low_priority_threshold_ms=500,
                                   reject_on_slo_violation=True)
    assert policy.qos.classes == default_classes()
    assert policy.qos.default_class == "default"


def test_full_document_loads_with_sections_of_other_components() -> None:
    policy = parse_policy(full())
    assert policy.disaggregated_router.decider == "score"
    assert policy.router == "kv_aware"
    assert policy.qos.default_class == "standard"
    assert policy.qos.rank("interactive") == 0 and policy.qos.rank("batch") == 2


def test_default_class_left_out_must_exist_among_classes() -> None:
    # When unset, default_class is `default`: fine with the built-in classes, an error
    # (at its own path) with classes that have no class of that name.
    assert parse_policy(seed()).qos.default_class == "default"
    with pytest.raises(PolicyError) as info:
        parse_policy(edited(full(), "qos.default_class", DELETE))
    assert paths(info.value) == ["qos.default_class"]


def test_router_section_may_be_a_full_config() -> None:
    router = {"plugins": [{"name": "pick", "type": "max-score"}],
              "schedulingProfiles": [{"name": "d", "plugins": [{"pluginRef": "pick"}]}]}
    policy = parse_policy(edited(seed(), "router", router))
    assert policy.router.scheduling_profiles[0].name == "d"


@pytest.mark.parametrize("suffix, text, message", [
    (".yaml", "cache: {reuse_prefix: true}\ncache: {reuse_prefix: false}\n", "duplicate key"),
    (".json", '{"cache": {"reuse_prefix": true, "reuse_prefix": false}}', "duplicate key"),
    (".yaml", "cache: [unclosed\n", "invalid YAML: line 2, column 1: expected ',' or ']'"),
    (".json", "{", "invalid JSON"),
    (".toml", "x = 1", "unsupported file type"),
])
def test_file_errors(tmp_path: Path, suffix: str, text: str, message: str) -> None:
    path = tmp_path / f"policy{suffix}"
    path.write_text(text)
    with pytest.raises(PolicyError) as info:
        load_policy_file(path)
    assert info.value.file == str(path) and message in info.value.errors[0]


def test_missing_file_is_a_policy_error(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="cannot read"):
        load_policy_file(tmp_path / "absent.yaml")


def test_validation_does_not_change_the_input() -> None:
    doc = full()
    before = json.dumps(doc, sort_keys=True)
    parse_policy(doc)
    assert json.dumps(doc, sort_keys=True) == before


def test_shipped_schema_matches_the_code(tmp_path: Path) -> None:
    fresh = export_schema(tmp_path / "policy.schema.json")
    shipped = CONFIGS / "schemas" / "policy.schema.json"
    assert json.loads(shipped.read_text()) == json.loads(fresh.read_text()), \
        "run `python -m splitserve.components.policy configs` to refresh the shipped schema"


def test_schema_describes_every_field() -> None:
    schema = policy_schema()
    for name, model in [("PolicyFile", schema), *schema["$defs"].items()]:
        for field, spec in model["properties"].items():
            assert spec.get("description"), f"{name}.{field} has no description"
