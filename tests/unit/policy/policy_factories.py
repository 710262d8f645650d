"""Policy documents for tests: the seed, a document using every section, and edits."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def seed() -> dict[str, Any]:
    """The seed's policy file, as shipped."""
    return yaml.safe_load((CONFIGS / "policies" / "seed.yaml").read_text())


def full() -> dict[str, Any]:
    """The seed plus every optional section: classes, degradation, offload, router."""
    doc = seed()
    doc["qos"].update({
        "classes": [
            {"name": "interactive", "ttft_ms": 300, "tpot_ms": 50, "may_reject": False,
             "may_degrade": False},
            {"name": "standard", "ttft_ms": 1000, "tpot_ms": 100, "may_reject": False,
             "may_degrade": True},
            {"name": "batch", "ttft_ms": 5000, "tpot_ms": 250, "may_reject": True,
             "may_degrade": True},
        ],
        "default_class": "standard",
        "user_map": {"nightly-eval": "batch"},
        "metadata_key": "priority",
        "degradation": {
            "cap_max_tokens": {"enable": True, "max_tokens": 512, "kv_usage_threshold": 0.9},
            "disable_remote_prefill_for_low_priority": {
                "enable": True, "prefill_queue_depth_threshold": 8},
            "adaptive_generation_limit": {"enable": False},
        },
    })
    doc["disaggregated_router"] = {
        "enable": True,
        "policies": [
            {"metric": "prefill_length", "threshold": 256, "action": "prefer_remote",
             "weight": 0.7},
            {"metric": "prefill_queue_depth", "threshold": 10, "action": "prefer_local",
             "weight": 0.3}],
        "remote_prefill_min_score": 0.5,
    }
    doc["router"] = "kv_aware"
    return doc


def edited(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """Return a copy of ``doc`` with the dotted ``path`` set to ``value`` (list indexes as
    numbers); a ``value`` of ``DELETE`` removes the key."""
    out = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node: Any = out
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    key: Any = int(last) if isinstance(node, list) else last
    if value is DELETE:
        del node[key]
    else:
        node[key] = value
    return out


DELETE = object()
