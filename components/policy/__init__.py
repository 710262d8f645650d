"""Policy files as a product: one strict schema, versions in etcd, hot reload.

``schema`` validates files, ``store`` keeps immutable versions in etcd, ``signing``
authenticates them, ``watch`` lets a running component follow the current version
(``component.follow_policy``, which the supervisor names in each run config).  The
``dynamo policy`` command is ``splitserve/cli/policy_cmd.py``.
"""

from .canonical import canonical_dict, canonical_json, canonical_yaml, policy_sha256, unified_diff
from .decide import Step, StepKind, WatchState, after_attempt, decide, status_record
from .records import ComponentStatus, CurrentPointer, PolicyKeys, PolicyVersion
from .schema import (
    PolicyError,
    PolicyFile,
    PolicyRegistries,
    export_schema,
    load_policy_file,
    parse_policy,
    policy_schema,
)
from .signing import PolicyKey
from .store import PolicyConflict, PolicyNotFound, PolicyStore
from .watch import PolicyWatcher

__all__ = [
    "ComponentStatus", "CurrentPointer", "PolicyConflict", "PolicyError", "PolicyFile",
    "PolicyKey", "PolicyKeys", "PolicyNotFound", "PolicyRegistries", "PolicyStore", "PolicyVersion",
    "PolicyWatcher", "Step", "StepKind", "WatchState", "after_attempt", "canonical_dict",
    "canonical_json", "canonical_yaml", "decide", "export_schema", "load_policy_file",
    "parse_policy", "policy_schema", "policy_sha256", "status_record", "unified_diff",
]
