"""Canonical forms: equal meaning gives equal bytes and hash; diffs are readable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from splitserve.components.router.qos import default_classes
from splitserve.components.policy import (
    canonical_dict,
    canonical_json,
    canonical_yaml,
    load_policy_file,
    parse_policy,
    policy_sha256,
    unified_diff,
)

from .policy_factories import CONFIGS, edited, full, seed

pytestmark = pytest.mark.unit


def test_yaml_and_json_seed_hash_alike() -> None:
    a = load_policy_file(CONFIGS / "policies" / "seed.yaml")
    b = load_policy_file(CONFIGS / "policies" / "seed.json")
    assert canonical_json(a) == canonical_json(b)
    assert policy_sha256(a) == policy_sha256(b)


def test_key_order_and_spelled_out_defaults_do_not_matter() -> None:
    doc = seed()
    shuffled = {key: doc[key] for key in reversed(list(doc))}
    defaults = edited(doc, "qos.metadata_key", "priority")
    defaults = edited(defaults, "qos.classes", [c.model_dump() for c in default_classes()])
    defaults = edited(defaults, "qos.degradation", {"cap_max_tokens": {"max_tokens": 256}})
    hashes = {policy_sha256(parse_policy(d)) for d in (doc, shuffled, defaults)}
    assert len(hashes) == 1


def test_a_change_changes_the_hash() -> None:
    changed = edited(seed(), "split_policy.prompt_length_threshold", 512)
    assert policy_sha256(parse_policy(changed)) != policy_sha256(parse_policy(seed()))


@pytest.mark.parametrize("make", [seed, full])
def test_canonical_form_round_trips(make) -> None:
    policy = parse_policy(make())
    data = canonical_dict(policy)
    assert parse_policy(json.loads(json.dumps(data))) == policy
    assert parse_policy(yaml.safe_load(canonical_yaml(policy))) == policy


def test_canonical_yaml_keeps_schema_order_and_leaves_out_unset_sections() -> None:
    text = canonical_yaml(parse_policy({"cache": {"reuse_prefix": True}, "router": "kv_aware"}))
    assert text.splitlines() == ["enable_hotspot_prevention: false", "cache:",
                                 "  reuse_prefix: true", "  min_cache_hit_ratio: 0.0",
                                 "router: kv_aware"]


def test_diff_is_empty_for_equal_policies() -> None:
    assert unified_diff(parse_policy(seed()), parse_policy(seed()), "a", "b") == ""


def test_diff_shows_the_changed_field_under_its_section() -> None:
    old = parse_policy(seed())
    new = parse_policy(edited(seed(), "autoscale.decode.max_replicas", 32))
    text = unified_diff(old, new, "v1", "v2")
    assert text.startswith("--- v1\n+++ v2\n")
    assert "-    max_replicas: 24\n+    max_replicas: 32\n" in text
    assert "  decode:\n" in text  # context names the section


def test_diff_accepts_stored_documents(tmp_path: Path) -> None:
    old = canonical_dict(parse_policy(seed()))
    new = canonical_dict(parse_policy(edited(seed(), "enable_hotspot_prevention", False)))
    assert "+enable_hotspot_prevention: false" in unified_diff(old, new, "v1", "v2")
