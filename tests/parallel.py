"""Running the suite on several pytest-xdist workers (``-n 3 --dist loadscope``) without
harming the tests that measure time.

Every test module is one of five kinds:

- ``exclusive`` (marked so): it asserts latencies and keeps more than one core busy, or
  its engines are pinned to cores (the admission burst, vLLM).  It runs while no other
  live module runs.
- ``quiet`` (marked so): it asserts latencies, or what it checks depends on the clock
  under load, and keeps less than one core busy (admission and overload on the
  simulated fleet, the planner's load step, the supervisor's bounds, the prefill
  queue's and coordinator's waits).  It runs beside at most one other quiet or model
  module, and no heavy or exclusive one.
- model: a unit module that runs the real model in this process (tests/unit's
  ``test_torch_*``).  Under xdist it runs on one torch thread, one model module at a
  time, so it never takes more than one core; it runs beside heavy and quiet modules.
- light: any other unit module (no processes, no model).  It runs beside anything.
- heavy: every other module (graphs, processes).  Heavy modules run beside each other
  and beside light and model ones.

A table shared by the workers of one run (``Gate``; the rules are ``admits``) enforces
that: a worker waits, polling, until its module may start.  A waiting exclusive module
goes before any new module and a waiting quiet one before new heavy ones.  The wait is
around a module's whole run, its module fixtures' setup and teardown included, and
outside the per-test timeout, so waiting is not counted as the test hanging.  Every
process a module other than an exclusive one starts gets ``OMP_NUM_THREADS=1``: several
models on two cores otherwise spend their time in OpenMP threads spinning for each
other.

``--dist loadscope`` keeps a module on one worker (its module-scoped graph starts once);
the scheduler below also keeps the vLLM modules together on one worker, one after the
other, so their package-scoped aggregated vLLM graph starts once.
``--no-loadscope-reorder`` keeps the order set here: quiet modules first, each followed
by a share of the model modules (which use the core a quiet module leaves), with a share
of the light ones among them (for the worker the gate leaves idle), then the exclusive
ones, each followed by a share of the rest of the light ones, then the heavy modules,
those marked ``slow`` first (so no long module starts last).  Without xdist none of
this changes anything but the order.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from splitserve.contracts.kit.procs import pid_alive

RUN_ID_ENV = "PYTEST_XDIST_TESTRUNUID"
TRACE_ENV = "SPLITSERVE_GATE_TRACE"
EXCLUSIVE, QUIET, MODEL, HEAVY, LIGHT = "exclusive", "quiet", "model", "heavy", "light"


# The share of the light modules run among the quiet and model ones (``ordered``).
LIGHT_AMONG_QUIET = 0.4

# Modules that share a package-scoped graph: one scheduling unit, run back to back.
SHARED_SCOPES = {"test_vllm_agg.py": "vllm", "test_vllm_disagg.py": "vllm",
                 "test_vllm_kv_routing.py": "vllm"}


def kind(item: pytest.Item) -> str:
    if item.get_closest_marker("exclusive") is not None:
        return EXCLUSIVE
    if item.get_closest_marker("quiet") is not None:
        return QUIET
    path = Path(str(item.path)).as_posix()
    if "/tests/unit/" in path:
        return MODEL if Path(path).name.startswith("test_torch_") else LIGHT
    return HEAVY


def module_key(item: pytest.Item) -> str:
    return str(item.path)


def shared_scope(path) -> str | None:
    """The shared scope a test module (by path or node id) belongs to, if any."""
    return SHARED_SCOPES.get(Path(str(path)).name)


def hold_key(item: pytest.Item) -> str:
    """What a worker holds its place in the table for: the module, or the whole shared
    scope it belongs to (the vLLM modules are one hold, so no other module starts between
    them and makes the next one wait for it to finish)."""
    return shared_scope(item.path) or module_key(item)


def _interleave(leads: list, followers: list, skip=lambda m: False) -> list:
    """Each lead followed by an equal share of the followers (none after a skipped
    lead), then the followers left over."""
    out: list = []
    share = -(-len(followers) // max(1, len(leads)))  # ceil
    taken = 0
    for lead in leads:
        out.append(lead)
        if not skip(lead):
            out.extend(followers[taken:taken + share])
            taken += share
    return out + followers[taken:]


def ordered(items: list[pytest.Item]) -> list[pytest.Item]:
    """Quiet modules with the model ones, exclusive modules with the light ones, then
    the heavy ones."""
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(module_key(item), []).append(item)
    by_kind: dict[str, list[list[pytest.Item]]] = {k: [] for k in
                                                   (EXCLUSIVE, QUIET, MODEL, HEAVY, LIGHT)}
    for module_items in modules.values():
        by_kind[kind(module_items[0])].append(module_items)

    def scope(m: list[pytest.Item]) -> str | None:
        return shared_scope(m[0].path)

    # modules of one shared scope follow each other, so the worker never leaves their
    # package in between (which would stop and restart its package-scoped graph)
    exclusive = sorted(by_kind[EXCLUSIVE], key=lambda m: scope(m) or "")
    # the long modules (marked slow) first, so none of them starts last
    def slow_first(ms: list[list[pytest.Item]]) -> list[list[pytest.Item]]:
        return sorted(ms, key=lambda m: m[0].get_closest_marker("slow") is None)

    # Light modules fill the workers the gate leaves idle: one while quiet and model
    # modules run (two at a time: about 205 s of a run on 2 cores), two while an
    # exclusive one runs (154 s), so 205 of 513 idle worker-seconds, 40%, are among the
    # quiet ones (python tests/gate_trace.py shows where a run's time went).
    light = by_kind[LIGHT]
    split = round(len(light) * LIGHT_AMONG_QUIET)
    head = (_interleave(_interleave(by_kind[QUIET], slow_first(by_kind[MODEL])),
                        light[:split])
            + _interleave(exclusive, light[split:], skip=lambda m: scope(m) is not None))
    return [item for module_items in head + slow_first(by_kind[HEAVY])
            for item in module_items]


def admits(how: str, holding: list[str], waiting: list[str]) -> bool:
    """Whether a module of kind ``how`` may start while modules of the kinds ``holding``
    run and modules of the kinds ``waiting`` wait to start.

    An exclusive module runs alone.  A quiet module runs beside at most one other quiet
    or model module (each of them keeps under a core busy) and no heavy one.  Only one
    model module runs at a time.  A waiting exclusive module goes before any new module
    and a waiting quiet one before new heavy ones, so neither waits for ever.
    """
    if how == LIGHT:
        return True
    if EXCLUSIVE in holding or (EXCLUSIVE in waiting and how != EXCLUSIVE):
        return False
    if how == EXCLUSIVE:
        return not holding
    if how == HEAVY:
        return QUIET not in holding and QUIET not in waiting
    if how == QUIET:
        return HEAVY not in holding and len(holding) <= 1
    # MODEL
    return MODEL not in holding and (QUIET not in holding or len(holding) <= 1)


def gate_dir(run_id: str) -> Path:
    """The run's shared folder for the table below; the controlling process removes it
    when the run ends (``pytest_unconfigure``)."""
    return Path(tempfile.gettempdir()) / f"splitserve-tests-{run_id}"


class Gate:
    """This worker's hold on the run's shared table of running modules.

    The table (a JSON file beside a lock file, in the temp folder, per run) maps each
    worker's process id to the kind it runs or waits to run.  A worker polls it until
    ``admits`` lets its module in; a worker that has died is dropped from it.
    """

    POLL_S = 0.2

    def __init__(self, run_id: str) -> None:
        base = gate_dir(run_id)
        base.mkdir(exist_ok=True)
        self.lock: IO = open(base / "lock", "a+")  # noqa: SIM115 - held all run
        self.table = base / "table.json"
        self.me = str(os.getpid())
        self.module: str | None = None
        self.omp_threads = os.environ.get("OMP_NUM_THREADS")
        self.entered: tuple[str, str, float, float] | None = None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, dict[str, str]]]:
        fcntl.flock(self.lock, fcntl.LOCK_EX)
        try:
            try:
                table = json.loads(self.table.read_text())
            except (FileNotFoundError, ValueError):
                table = {"holding": {}, "waiting": {}}
            for part in table.values():
                for pid in [p for p in part if p != self.me and not pid_alive(int(p))]:
                    del part[pid]
            yield table
            tmp = self.table.with_suffix(f".{self.me}")
            tmp.write_text(json.dumps(table))
            tmp.replace(self.table)
        finally:
            fcntl.flock(self.lock, fcntl.LOCK_UN)

    def _try(self, how: str) -> bool:
        with self._locked() as table:
            holding, waiting = table["holding"], table["waiting"]
            others = [k for p, k in waiting.items() if p != self.me]
            if admits(how, list(holding.values()), others):
                holding[self.me] = how
                waiting.pop(self.me, None)
                return True
            waiting[self.me] = how
            return False

    def enter(self, module: str, how: str) -> None:
        if self.module == module:
            return
        self.leave()
        asked = time.time()
        if how != LIGHT:
            while not self._try(how):
                time.sleep(self.POLL_S)
        self.entered = (module, how, asked, time.time())
        if how == MODEL:
            import torch  # only model modules get here, and they import it anyway

            torch.set_num_threads(1)
        # The processes a module starts (graphs, replicas) run torch on one thread, except
        # an exclusive module's (vLLM sizes its own): with several models on two cores,
        # OpenMP threads spin waiting for each other (the model modules took 217 CPU-s on
        # two threads each, 65 on one).
        if how == EXCLUSIVE:
            if self.omp_threads is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = self.omp_threads
        else:
            os.environ["OMP_NUM_THREADS"] = "1"
        self.module = module

    def leave(self) -> None:
        if self.module is not None:
            with self._locked() as table:
                table["holding"].pop(self.me, None)
            self.module = None
            self._trace()

    def _trace(self) -> None:
        """With ``SPLITSERVE_GATE_TRACE`` set to a file: one JSON line per module (its
        kind, when it asked to start, started and ended), to see where a run's wall time
        goes (``python tests/gate_trace.py FILE``)."""
        path = os.environ.get(TRACE_ENV)
        if not path or self.entered is None:
            return
        module, how, asked, started = self.entered
        line = json.dumps({"worker": self.me, "module": module, "kind": how,
                           "asked": asked, "started": started, "ended": time.time()})
        with open(path, "a") as f:
            f.write(line + "\n")
        self.entered = None

    def close(self) -> None:
        self.leave()
        self.lock.close()


_gate: Gate | None = None


def pytest_configure(config: pytest.Config) -> None:
    """In the controlling process of a parallel run: name the run's id here (xdist would
    draw one itself), so that the run's folder can be removed at its end."""
    if hasattr(config, "workerinput") or not config.pluginmanager.hasplugin("xdist"):
        return
    if getattr(config.option, "testrunuid", "unset") is None:
        config.option.testrunuid = uuid.uuid4().hex


def pytest_unconfigure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return
    run_id = getattr(config.option, "testrunuid", None)
    if run_id:
        shutil.rmtree(gate_dir(run_id), ignore_errors=True)


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
        _gate.enter(hold_key(item), kind(item))
    try:
        yield
    finally:
        if _gate is not None and (nextitem is None or hold_key(nextitem) != hold_key(item)):
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
            return shared_scope(module) or module

    return ModuleScopes(config, log)
