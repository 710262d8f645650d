"""The goodput sweep's load plan (multiples of capacity -> rate scales and windows) and
its goal table."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

_SPEC = importlib.util.spec_from_file_location(
    "sweep_plan", Path(__file__).resolve().parents[3] / "benchmarks" / "sweep_plan.py")
sp = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("sweep_plan", sp)  # dataclasses look their module up
_SPEC.loader.exec_module(sp)


def test_each_point_offers_its_multiple_of_capacity_for_its_window():
    arrivals = [i * 0.5 + (0.2 if i % 3 == 0 else 0.0) for i in range(20000)]  # ~2 req/s
    plan = sp.plan_loads(arrivals, capacity_rps=40, multiples=[0.5, 1, 2, 3], window_s=15,
                         sustained_s=60, sustained_from=2)
    assert [pt.window_s for pt in plan] == [15, 15, 60, 60]
    for pt in plan:
        assert pt.target_rps == pytest.approx(40 * pt.multiple)
        got = sp.offered_rps(arrivals, pt.duration_trace_s, pt.rate_scale)
        assert got == pytest.approx(pt.target_rps, rel=0.02)
        assert pt.duration_trace_s / pt.rate_scale == pytest.approx(pt.window_s)


def test_a_trace_too_short_to_sustain_a_load_is_refused():
    with pytest.raises(ValueError, match="needs"):
        sp.plan_loads([float(i) for i in range(100)], 40, [3], 15, 60, 2)


def test_bad_multiples_are_refused():
    assert sp.parse_multiples("0.5, 1,3") == [0.5, 1.0, 3.0]
    with pytest.raises(ValueError):
        sp.parse_multiples("1,0")


def point(config, m, goodput, ttft, tpot):
    return {"config": config, "capacity_multiple": m, "goodput_rps": goodput,
            "ttft_p99_ms": ttft, "tpot_p99_ms": tpot}


def test_goals_compare_with_the_reference_at_each_load():
    pts = [point("ours", 0.5, 20, 300, 30), point("ref", 0.5, 20, 200, 30),
           point("ours", 2, 45, 900, 40), point("ref", 2, 20, 500, 300),
           point("ours", 3, 30, 900, 40), point("ref", 3, 5, 500, 300)]
    rows = sp.goals(pts, "ours", "ref", saturated=2, below=1)
    by = {(r["multiple"], r["what"]): r for r in rows}
    assert by[(0.5, "goodput")]["met"] is True
    assert by[(0.5, "TTFT p99")]["met"] is False  # 1.5x Dynamo's
    assert by[(0.5, "TPOT p99")]["met"] is True
    assert by[(2, "goodput")]["ratio"] == pytest.approx(2.25) and by[(2, "goodput")]["met"]
    assert not any(r["multiple"] == 3 for r in rows)
    assert "**no**" in sp.markdown_goals(rows, "ours", "ref")
