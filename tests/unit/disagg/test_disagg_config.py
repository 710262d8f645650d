"""Config validation with field paths, guards, forced decider, registry and schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from splitserve.components.disagg import (
    DeciderRegistry,
    ForcedDecider,
    build_decider,
    default_decider_registry,
    forced,
    load_disaggregated_router_file,
    parse_disaggregated_router,
)
from splitserve.components.disagg.schema import disaggregated_router_schema
from splitserve.contracts.validation import error_paths

from splitserve.contracts.models import StrictModel

from .disagg_factories import offload_request, offload_snapshot, rule

pytestmark = pytest.mark.unit

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
SEED_RULES = [rule("prefill_length", weight=0.7, threshold=256),
              rule("prefill_queue_depth", "prefer_local", 0.3, threshold=10)]


def section(**fields):
    """An enabled score section with the seed's rules, overridden by ``fields``."""
    return {"enable": True, "policies": SEED_RULES, "remote_prefill_min_score": 0.5, **fields}


BAD = {
    "enable missing": ({"policies": SEED_RULES}, "enable"),
    "unknown key": (section(remote_min=0.5), "remote_min"),
    "unknown decider": (section(decider="smart"), "decider"),
    "unknown metric": (section(policies=[rule("gpu_temp", threshold=1)]), "policies.0.metric"),
    "unknown action": (section(policies=[rule("prefill_length", "prefer_gpu", threshold=1)]),
                       "policies.0.action"),
    "negative weight": (section(policies=[SEED_RULES[0], rule("prefill_queue_depth", weight=-0.3,
                                                              threshold=10)]),
                        "policies.1.weight"),
    "negative threshold": (section(policies=[rule("prefill_length", threshold=-1)]),
                           "policies.0.threshold"),
    "missing threshold": (section(policies=[rule("prefill_length")]), "policies.0.threshold"),
    "kv threshold above 1": (section(policies=[rule("decode_kv_usage", threshold=80)]),
                             "policies.0.threshold"),
    "priority without classes": (section(policies=[rule("priority")]), "policies.0.classes"),
    "priority with threshold": (section(policies=[rule("priority", threshold=2, classes=["a"])]),
                                "policies.0.threshold"),
    "classes on a numeric metric": (
        section(policies=[rule("prefill_length", threshold=1, classes=["a"])]),
        "policies.0.classes"),
    "unknown rule key": (section(policies=[rule("prefill_length", threshold=1, name="x")]),
                         "policies.0.name"),
    "no rules": (section(policies=[]), "policies"),
    "min score zero": (section(remote_prefill_min_score=0), "remote_prefill_min_score"),
    "min score unreachable": (section(remote_prefill_min_score=0.8), "remote_prefill_min_score"),
    "threshold param on score": (section(prefill_length_threshold=256),
                                 "prefill_length_threshold"),
    "bad threshold param": ({"enable": True, "decider": "threshold", "prefill_queue_max": -1},
                            "prefill_queue_max"),
    "forced without answer": ({"enable": True, "decider": "forced"}, "remote"),
}


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_bad_section_names_the_field(case):
    document, path = case
    with pytest.raises(ValidationError) as caught:
        parse_disaggregated_router(document)
    assert path in error_paths(caught.value)


def test_file_errors_carry_file_name_and_section(tmp_path):
    path = tmp_path / "offload.yaml"
    path.write_text(yaml.safe_dump({"disaggregated_router": section(remote_prefill_min_score=-1)}))
    with pytest.raises(ValidationError) as caught:
        load_disaggregated_router_file(path)
    assert error_paths(caught.value) == ["disaggregated_router.remote_prefill_min_score"]
    assert str(path) in str(caught.value)
    path.write_text(yaml.safe_dump({"disaggregated_router": section(), "router": {}}))
    with pytest.raises(ValidationError, match="single key"):
        load_disaggregated_router_file(path)


@pytest.mark.parametrize("document", [
    {"enable": False},
    section(enable=False),
    {"enable": False, "decider": "forced", "remote": True},
])
def test_disabled_is_always_local(document):
    decision = build_decider(document).decide(offload_request(5000), offload_snapshot())
    assert (decision.remote, decision.reason) == (False, "disabled")


@pytest.mark.parametrize("document", [
    section(), {"enable": True, "decider": "threshold"},
    {"enable": True, "decider": "forced", "remote": True},
])
def test_no_prefill_workers_is_always_local(document):
    decider = build_decider(document)
    decision = decider.decide(offload_request(5000), offload_snapshot(prefill_workers=0))
    assert (decision.remote, decision.reason) == (False, "no-prefill-workers")
    assert decider.decide(offload_request(5000), offload_snapshot()).remote


@pytest.mark.parametrize(("remote", "reason"), [(True, "forced-remote"), (False, "forced-local")])
def test_forced(remote, reason):
    decider = build_decider({"enable": True, "decider": "forced", "remote": remote})
    for prompt, queue in [(1, 0), (10_000, 100)]:
        got = decider.decide(offload_request(prompt), offload_snapshot(queue))
        assert (got.remote, got.reason) == (remote, reason)


def test_enable_only_section_uses_the_seed_policy():
    decider = build_decider({"enable": True})
    assert decider.decide(offload_request(1000), offload_snapshot(queue=1)).remote
    assert not decider.decide(offload_request(1000), offload_snapshot(queue=10)).remote


def test_registry_rules():
    registry = DeciderRegistry(default_name="always")
    registry.register("always", StrictModel,
                      lambda params: ForcedDecider(forced.Params(remote=True)))
    with pytest.raises(ValueError, match="already registered"):
        registry.register("always", StrictModel, ForcedDecider)
    with pytest.raises(ValueError, match="kebab-case"):
        registry.register("Always", StrictModel, ForcedDecider)
    decider = build_decider({"enable": True}, registry)
    assert decider.decide(offload_request(1), offload_snapshot()).reason == "forced-remote"
    assert default_decider_registry().names() == ["forced", "score", "threshold"]


def test_exported_schema_is_current():
    shipped = json.loads((CONFIGS / "schemas" / "disaggregated_router.schema.json").read_text())
    assert shipped == json.loads(json.dumps(disaggregated_router_schema()))
    score = shipped["$defs"]["ScoreDisaggregatedRouter"]
    assert "enable" in score["required"] and "decider" not in score.get("required", [])
