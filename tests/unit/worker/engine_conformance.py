"""What makes a class an engine the worker shells can drive: every member the ``Engine``
protocol declares, with the protocol's parameters, and optional abilities that its
capabilities only claim where the class implements them (not through a ``Without...``
class).  Used by test_engine_protocol.py (the registered engines) and
test_toy_engine.py (an engine added in a test)."""

from __future__ import annotations

import inspect

from splitserve.contracts import engine as contract

ABILITY_MEMBERS: dict[str, tuple[str, ...]] = {
    "local_prefill": (),  # gates a decode engine's generate(), which every engine has
    "reports_failure": ("failure",),
    "prefix_lookup": ("cached_prefix_tokens",),
    "handoff_before_prefill": ("begin_prefill",),
    "pushes_kv": ("reserve_remote", "release_remote"),
    "moves_kv": ("park", "parked", "export_parked", "resume_moved"),
    "serves_lora": ("load_lora", "unload_lora", "loras"),
    "local_prefill_own_batch": (),  # describes how generate() batches, gates no member
}
"""Capability flag -> the protocol members it gates."""


def _kind(fn) -> str:
    if inspect.iscoroutinefunction(fn):
        return "async"
    return "plain or async generator"


def class_problems(cls: type) -> list[str]:
    """How ``cls`` falls short of the protocol's declared members (empty: it conforms)."""
    problems = []
    if "info" not in inspect.get_annotations(cls):
        problems.append("info: not declared on the class (info: EngineInfo)")
    for name in contract.protocol_members():
        if name == "info":
            continue
        declared = getattr(contract.Engine, name)
        impl = getattr(cls, name, None)
        if impl is None or not callable(impl):
            problems.append(f"{name}: missing")
            continue
        if _kind(impl) != _kind(declared):
            problems.append(f"{name}: {_kind(impl)}, the protocol's is {_kind(declared)}")
        want = [p for p in inspect.signature(declared).parameters if p != "self"]
        got = inspect.signature(impl).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in got.values()):
            lacking = [p for p in want if p not in got]
            if lacking:
                problems.append(f"{name}: no parameter {', '.join(lacking)}")
    return problems


def ability_problems(engine) -> list[str]:
    """Flags of ``engine.info.capabilities`` that claim an ability its class does not
    implement (the member comes from a ``Without...`` class)."""
    caps = engine.info.capabilities
    if not isinstance(caps, contract.EngineCapabilities):
        return [f"capabilities: {type(caps).__name__}, not EngineCapabilities"]
    flags = {f for f in caps.__dataclass_fields__ if isinstance(getattr(caps, f), bool)}
    problems = [f"{f}: no protocol members listed for it" for f in flags - set(ABILITY_MEMBERS)]
    for flag, members in ABILITY_MEMBERS.items():
        if not getattr(caps, flag):
            continue
        for m in members:
            owner = next(k for k in type(engine).__mro__ if m in k.__dict__)
            if issubclass(owner, contract.WithoutAbility) and owner.__module__ == contract.__name__:
                problems.append(f"{flag} is set, and {m} comes from {owner.__name__}")
    return problems
