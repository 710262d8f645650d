"""The rules that let test modules share the machine under xdist (tests/parallel.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.parallel import EXCLUSIVE, HEAVY, LIGHT, MODEL, QUIET, Gate, admits

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
