"""The planner policy file: the seed's autoscale section unchanged, the planner block,
cross-field checks, and the exported schemas."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitserve.planner import PlannerPolicy, load_planner_policy, parse_planner_policy
from splitserve.planner.cli import schemas
from splitserve.components.policy import PolicyError, load_policy_file

from .planner_factories import SEED_AUTOSCALE

pytestmark = pytest.mark.unit

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def errors(doc: dict) -> list[str]:
    with pytest.raises(PolicyError) as info:
        parse_planner_policy(doc, "test")
    return info.value.errors


def test_seed_policy_file_loads_unchanged():
    planner = load_planner_policy(CONFIGS / "policies" / "seed.yaml")
    assert planner.autoscale == load_policy_file(CONFIGS / "policies" / "seed.yaml").autoscale
    assert planner.planner == PlannerPolicy(autoscale=planner.autoscale).planner


@pytest.mark.parametrize("name", ["seed.yaml", "budget.yaml", "sla.yaml"])
def test_shipped_planner_files_load(name):
    assert isinstance(load_planner_policy(CONFIGS / "planner" / name), PlannerPolicy)


def test_autoscale_alone_is_a_planner_file(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"autoscale": SEED_AUTOSCALE}))
    p = load_planner_policy(path)
    assert p.planner.interval_s == 10 and p.planner.hysteresis.scale_down_intervals == 3
    assert list(p.pools()) == ["prefill", "decode"]


ERRORS = [
    ({"planner": {"cooldwn": {}}}, "planner.cooldwn: Extra inputs are not permitted"),
    ({"planner": {"interval_s": "10"}}, "planner.interval_s: Input should be a valid number"),
    ({"planner": {"max_step": {"scale_up": 0}}},
     "planner.max_step.scale_up: Input should be greater than or equal to 1"),
    ({"planner": {"gpu_budget": {"total_gpus": 11}}},
     ("planner.gpu_budget.total_gpus: total_gpus (11) is below the GPUs the pools' "
      "min_replicas hold (12)")),
    ({"planner": {"gpu_budget": {"total_gpus": 40, "prefill_gpus_per_replica": 2}}},
     "planner.gpu_budget.moves: moves need equal GPUs per replica; prefill has 2, decode has 1"),
    ({"planner": {"sla": {"prefill": {"tokens_per_s": 1, "requests_per_s": 1}}}},
     "planner.sla.prefill: set exactly one of tokens_per_s, requests_per_s"),
    ({"planner": {"sla": {"predictor": "holt-winters"}}},
     "planner.sla.predictor: Input should be 'constant', 'moving-average' or 'linear-trend'"),
]


@pytest.mark.parametrize(("extra", "expected"), ERRORS, ids=[e[1][:40] for e in ERRORS])
def test_planner_block_errors(extra, expected):
    assert expected in errors({"autoscale": SEED_AUTOSCALE, **extra})


def test_sla_for_an_unscaled_pool_is_an_error():
    doc = {"autoscale": {"prefill": SEED_AUTOSCALE["prefill"]},
           "planner": {"sla": {"decode": {"tokens_per_s": 100}}}}
    assert errors(doc) == [("planner.sla.decode: sla.decode is set but autoscale.decode is "
                            "not: the pool is not scaled")]


def test_autoscale_checks_still_apply():
    bad = {"prefill": {**SEED_AUTOSCALE["prefill"], "scale_down": {"queue_length": 9}}}
    assert errors({"autoscale": bad}) == [
        ("autoscale.prefill.scale_down.queue_length: scale_down.queue_length (9) must be "
         "below scale_up.queue_length (8)")]


def test_whole_policy_file_rules():
    seed = {"cache": {"reuse_prefix": True}, "autoscale": SEED_AUTOSCALE}
    assert parse_planner_policy(seed).autoscale.decode.min_replicas == 8
    assert errors({**seed, "planner": {}})[0].startswith("planner: a `planner` block goes")
    assert errors({"cache": {"reuse_prefix": True}}) == [
        "autoscale: the policy file has no autoscale section"]


def test_exported_schemas_are_current():
    for name, text in schemas().items():
        assert (CONFIGS / "planner" / name).read_text() == text, "run: dynamo planner schema"
