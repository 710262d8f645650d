"""The suite's CPU profile (tests/cpu_profile.py): recording and the summary."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest

from tests.cpu_profile import main, tree_cpu

pytestmark = pytest.mark.unit


def test_tree_cpu_counts_a_child_that_has_exited():
    me = psutil.Process()
    before = tree_cpu(me)
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)
    assert tree_cpu(me) - before > 0.05  # the child's CPU, reaped into this process's


def test_summary_merges_a_modules_tests_and_sorts_by_cpu(tmp_path, capsys):
    rows = [("a.py::t1", 1.0, 0, 2), ("a.py::t2", 2.0, 2, 5), ("b.py::t", 9.0, 5, 6)]
    (tmp_path / "gw0.jsonl").write_text("".join(
        json.dumps({"id": i, "cpu": c, "t0": 100 + a, "t1": 100 + b}) + "\n"
        for i, c, a, b in rows))
    assert main([str(tmp_path), "--min-s", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("0.2 CPU-min over 0.1 min (2.00 cores busy")
    assert "b.py" in out[1] and "a.py" in out[2] and "cpu    3.0  wall    5.0" in out[2]
    assert main([str(tmp_path / "none")]) == 1
