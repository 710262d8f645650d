"""Canonical forms of a policy: what is stored, hashed and diffed.

The canonical document is the validated policy with defaults filled in and unset
sections left out, so two files that mean the same thing (JSON or YAML, any key order,
defaults spelled out or not) store the same bytes and hash alike, and a component reads
back exactly what was validated even if a later release changes a default.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from typing import Any

import yaml

from .schema import PolicyFile


def canonical_dict(policy: PolicyFile) -> dict[str, Any]:
    """Return the policy as plain JSON data in schema order (sections, then fields)."""
    return policy.model_dump(mode="json", by_alias=True, exclude_none=True)


def canonical_json(policy: PolicyFile) -> str:
    """Return compact JSON with sorted keys: the bytes that are hashed."""
    return json.dumps(canonical_dict(policy), sort_keys=True, separators=(",", ":"))


def canonical_yaml(policy: PolicyFile | dict[str, Any]) -> str:
    """Return block YAML in schema order, for people and for diffs."""
    data = canonical_dict(policy) if isinstance(policy, PolicyFile) else policy
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def policy_sha256(policy: PolicyFile) -> str:
    """Return the hex SHA-256 of ``canonical_json``; equal policies have equal hashes."""
    return hashlib.sha256(canonical_json(policy).encode()).hexdigest()


def unified_diff(old: PolicyFile | dict[str, Any], new: PolicyFile | dict[str, Any],
                 old_label: str, new_label: str) -> str:
    """Return a unified diff of the two canonical YAML forms; empty when they are equal."""
    lines = difflib.unified_diff(canonical_yaml(old).splitlines(keepends=True),
                                 canonical_yaml(new).splitlines(keepends=True),
                                 fromfile=old_label, tofile=new_label)
    return "".join(lines)
