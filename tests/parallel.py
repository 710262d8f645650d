"""Running the suite on several pytest-xdist workers (``-n 3 --dist loadscope``) without
harming the tests that measure time.

Every test module is one of three kinds:

- ``exclusive`` (marked so): it asserts latencies, or what it checks depends on the
  clock under load (admission, overload, the planner's load step, vLLM's engines pinned
  to cores).  It runs while no other live module runs.
- light: a unit module that neither starts processes nor runs the model (everything
  under tests/unit except the torch engine's modules).  It runs beside anything.
- heavy: every other module (graphs, processes, the model).  Heavy modules run beside
  each other and beside light ones.

A readers-writer lock shared by the workers of one run enforces that: heavy modules hold
it shared, exclusive ones exclusively, light ones not at all; a turnstile in front of it
lets a waiting exclusive module in before new heavy ones.  The lock is taken around a
module's whole run, its module fixtures' setup and teardown included, and outside the
per-test timeout, so waiting for it is not counted as the test hanging.

``--dist loadscope`` keeps a module on one worker (its module-scoped graph starts once);
the scheduler below also keeps the vLLM modules together on one worker, one after the
other, so their package-scoped aggregated vLLM graph starts once.
``--no-loadscope-reorder`` keeps the order set here: exclusive modules first, each
followed by a share of the light ones so the other workers have something to run while
it holds the lock, then the heavy modules, those marked ``slow`` first (so no long
module starts last).  Without xdist none of this changes anything but the order.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

RUN_ID_ENV = "PYTEST_XDIST_TESTRUNUID"
EXCLUSIVE, HEAVY, LIGHT = "exclusive", "heavy", "light"


# Modules that share a package-scoped graph: one scheduling unit, run back to back.
SHARED_SCOPES = {"test_vllm_agg.py": "vllm", "test_vllm_disagg.py": "vllm",
                 "test_vllm_kv_routing.py": "vllm"}


def kind(item: pytest.Item) -> str:
    if item.get_closest_marker("exclusive") is not None:
        return EXCLUSIVE
    path = Path(str(item.path)).as_posix()
    if "/tests/unit/" in path and not Path(path).name.startswith("test_torch_"):
        return LIGHT
    return HEAVY


def module_key(item: pytest.Item) -> str:
    return str(item.path)


def ordered(items: list[pytest.Item]) -> list[pytest.Item]:
    """Exclusive modules first, light modules spread between them, then heavy ones."""
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(module_key(item), []).append(item)
    by_kind: dict[str, list[list[pytest.Item]]] = {EXCLUSIVE: [], HEAVY: [], LIGHT: []}
    for module_items in modules.values():
        by_kind[kind(module_items[0])].append(module_items)
    exclusive, light = by_kind[EXCLUSIVE], by_kind[LIGHT]
    # modules of one shared scope follow each other, so the worker never leaves their
    # package in between (which would stop and restart its package-scoped graph)
    exclusive.sort(key=lambda m: SHARED_SCOPES.get(Path(str(m[0].path)).name, ""))
    head: list[list[pytest.Item]] = []
    share = -(-len(light) // max(1, len(exclusive)))  # ceil
    for i, module_items in enumerate(exclusive):
        head.append(module_items)
        if SHARED_SCOPES.get(Path(str(module_items[0].path)).name) is None:
            head.extend(light[i * share:(i + 1) * share])
    used = {id(m) for m in head}
    head.extend(m for m in light if id(m) not in used)
    # the long heavy modules (marked slow) first, so none of them starts last
    heavy = sorted(by_kind[HEAVY], key=lambda m: m[0].get_closest_marker("slow") is None)
    return [item for module_items in head + heavy for item in module_items]


class Gate:
    """This worker's hold on the run's lock, per module."""

    def __init__(self, run_id: str) -> None:
        base = Path(tempfile.gettempdir()) / f"splitserve-tests-{run_id}"
        base.mkdir(exist_ok=True)
        self.turnstile: IO = open(base / "turnstile", "a+")  # noqa: SIM115 - held all run
        self.room: IO = open(base / "room", "a+")  # noqa: SIM115
        self.module: str | None = None

    def enter(self, module: str, how: str) -> None:
        if self.module == module:
            return
        self.leave()
        if how != LIGHT:
            fcntl.flock(self.turnstile, fcntl.LOCK_EX)
            try:
                fcntl.flock(self.room, fcntl.LOCK_EX if how == EXCLUSIVE else fcntl.LOCK_SH)
            finally:
                fcntl.flock(self.turnstile, fcntl.LOCK_UN)
        self.module = module

    def leave(self) -> None:
        if self.module is not None:
            fcntl.flock(self.room, fcntl.LOCK_UN)
            self.module = None


_gate: Gate | None = None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items[:] = ordered(items)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None
                            ) -> Iterator[None]:
    """Outside pytest-timeout's wrapper: the lock is taken before the test's clock starts
    and let go after the module's last teardown."""
    global _gate
    run_id = os.environ.get(RUN_ID_ENV)
    if run_id and _gate is None:
        _gate = Gate(run_id)
    if _gate is not None:
        _gate.enter(module_key(item), kind(item))
    try:
        yield
    finally:
        if _gate is not None and (nextitem is None or module_key(nextitem) != module_key(item)):
            with contextlib.suppress(OSError):
                _gate.leave()


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadscope`` with the shared scopes above (xdist calls this in the
    controlling process)."""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScopes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return SHARED_SCOPES.get(Path(module).name, module)

    return ModuleScopes(config, log)
