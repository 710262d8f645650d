"""The rules that let test modules share the machine under xdist (tests/parallel.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.gate_trace import load, summary
from tests.parallel import (EXCLUSIVE, HEAVY, LIGHT, MODEL, QUIET, TRACE_ENV, Gate, admits,
                            kind, ordered)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("how", "holding", "waiting", "ok"), [
    (LIGHT, [EXCLUSIVE], [], True),
    (EXCLUSIVE, [], [], True),
    (EXCLUSIVE, [HEAVY], [], False),
    (EXCLUSIVE, [MODEL], [], False),
    (HEAVY, [HEAVY, HEAVY], [], True),
    (HEAVY, [MODEL], [], True),
    (HEAVY, [QUIET], [], False),
    (HEAVY, [HEAVY], [QUIET], False),  # a waiting quiet module goes first
    (HEAVY, [HEAVY], [EXCLUSIVE], False),
    (QUIET, [], [], True),
    (QUIET, [QUIET], [], True),
    (QUIET, [MODEL], [], True),
    (QUIET, [QUIET, MODEL], [], False),  # never three modules on two cores
    (QUIET, [HEAVY], [], False),
    (QUIET, [], [EXCLUSIVE], False),
    (MODEL, [HEAVY, HEAVY], [], True),
    (MODEL, [QUIET], [], True),
    (MODEL, [QUIET, QUIET], [], False),
    (MODEL, [MODEL], [], False),
    (MODEL, [HEAVY], [EXCLUSIVE], False),
])
def test_admission_rules(how, holding, waiting, ok):
    assert admits(how, holding, waiting) is ok


def test_gate_holds_and_frees_and_drops_dead_workers(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # what the gate changes, restored after
    monkeypatch.delenv(TRACE_ENV, raising=False)  # not into a traced run's own file
    gate = Gate("t")
    gate.enter("a.py", EXCLUSIVE)
    assert os.environ["OMP_NUM_THREADS"] == "4"  # an exclusive module's processes size their own
    with gate._locked() as table:
        assert table["holding"] == {str(os.getpid()): EXCLUSIVE}
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout.strip()
        table["holding"][gone] = HEAVY  # a worker that died holding a module
    gate.leave()
    with gate._locked() as table:
        assert table == {"holding": {}, "waiting": {}}
    gate.enter("b.py", HEAVY)
    with gate._locked() as table:
        assert table["holding"] == {str(os.getpid()): HEAVY}
    assert os.environ["OMP_NUM_THREADS"] == "1"
    gate.close()


def test_gate_trace_records_each_module_and_sums_waits(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))
    trace = tmp_path / "gate.jsonl"
    monkeypatch.setenv(TRACE_ENV, str(trace))
    gate = Gate("t")
    gate.enter("/r/tests/e2e/test_a.py", QUIET)
    gate.enter("/r/tests/unit/test_b.py", LIGHT)  # entering the next leaves the first
    gate.close()
    rows = load(str(trace))
    assert [(r["module"], r["kind"]) for r in rows] == [
        ("/r/tests/e2e/test_a.py", QUIET), ("/r/tests/unit/test_b.py", LIGHT)]
    assert all(r["asked"] <= r["started"] <= r["ended"] for r in rows)
    text = summary(rows)
    assert "2 modules" in text and "e2e/test_a.py" in text and "unit/test_b.py" in text


class _Item:
    def __init__(self, path: str, marker: str | None = None) -> None:
        self.path, self.marker = path, marker

    def get_closest_marker(self, name: str):
        return object() if name == self.marker else None


def test_order_puts_light_modules_among_quiet_and_exclusive_ones_before_heavy():
    items = ([_Item(f"/r/tests/e2e/test_q{i}.py", "quiet") for i in range(3)]
             + [_Item(f"/r/tests/unit/engines/test_torch_{i}.py") for i in range(2)]
             + [_Item(f"/r/tests/e2e/test_x{i}.py", "exclusive") for i in range(2)]
             + [_Item(f"/r/tests/unit/test_l{i}.py") for i in range(10)]
             + [_Item(f"/r/tests/e2e/test_h{i}.py") for i in range(3)])
    kinds = [kind(i) for i in ordered(items)]
    first_x, first_h = kinds.index(EXCLUSIVE), kinds.index(HEAVY)
    assert set(kinds[first_h:]) == {HEAVY}  # heavy modules last
    assert kinds[0] == QUIET and set(kinds[:first_x]) == {QUIET, MODEL, LIGHT}
    assert kinds[:first_x].count(LIGHT) == 4  # 40% of them among the quiet ones
    assert kinds[first_x:first_h].count(LIGHT) == 6
