"""Sweep aggregation of splitserve.bench.sweep: points, peaks, saturation, ratio tables."""

from __future__ import annotations

import math

import pytest

from splitserve.bench import sweep as sw

pytestmark = pytest.mark.unit


def _result(goodput, ttft_p99, offered=10.0, ok=10, rejected=0, requests=10, attainment=1.0):
    d = {"n": ok, "mean": 1.0, "p50": 1.0, "p90": 1.0, "p99": ttft_p99}
    return {"workload": {"offered_rps": offered},
            "summary": {"requests": requests, "outcomes": {"ok": ok, "rejected": rejected},
                        "makespan_s": 2.0, "ttft_ms": d, "tpot_ms": d, "e2e_ms": d,
                        "request_throughput_rps": ok / 2, "output_token_throughput_tps": 5.0,
                        "goodput_rps": goodput, "slo_attainment": attainment}}


def _pt(config, rs, goodput, ttft_p99, attainment=1.0):
    return sw.point_from_result(_result(goodput, ttft_p99, offered=rs * 3,
                                        attainment=attainment), config, rs)


def test_parse_rate_scales():
    assert sw.parse_rate_scales("2, 4,8,") == [2.0, 4.0, 8.0]
    for bad in ("", "0", "-1", "x", "inf"):
        with pytest.raises(ValueError):
            sw.parse_rate_scales(bad)


def test_point_from_result_fields():
    p = sw.point_from_result(_result(3.0, 120.0, ok=8, rejected=1, requests=10), "a", 2.0)
    assert set(sw.POINT_FIELDS) <= set(p)
    assert (p["ok"], p["rejected"], p["errors"]) == (8, 1, 1)
    assert p["goodput_rps"] == 3.0 and p["ttft_p99_ms"] == 120.0 and p["offered_rps"] == 10.0
    nan = sw.point_from_result(_result(float("nan"), None), "a", 1.0)
    assert nan["goodput_rps"] is None and nan["ttft_p99_ms"] is None


def test_by_config_sorted_and_peak_and_saturation():
    pts = [_pt("a", 4, 9.0, 300, 0.8), _pt("a", 1, 3.0, 100), _pt("a", 2, 6.0, 150, 0.95),
           _pt("b", 1, 2.0, 90)]
    g = sw.by_config(pts)
    assert [p["rate_scale"] for p in g["a"]] == [1, 2, 4]
    assert sw.peak_goodput(g["a"])["rate_scale"] == 4
    assert sw.saturation_point(g["a"])["rate_scale"] == 4
    assert sw.saturation_point(g["b"]) is None
    assert sw.peak_goodput([]) is None


def test_ratio_table_against_best_other():
    pts = [_pt("ours", 1, 6.0, 100), _pt("x", 1, 4.0, 80), _pt("y", 1, 5.0, 200),
           _pt("ours", 2, 0.0, 900), _pt("x", 2, 0.0, 50)]
    t = sw.ratio_table(pts, ["ours"], ["x", "y"])
    assert len(t) == 2
    r1, r2 = t
    assert r1["best_other_goodput"] == "y" and r1["goodput_ratio"] == pytest.approx(6 / 5)
    assert r1["best_other_ttft"] == "x" and r1["ttft_p99_ratio"] == pytest.approx(100 / 80)
    assert r2["goodput_ratio"] is None  # 0 / 0
    assert r2["best_other_ttft"] == "x" and r2["ttft_p99_ratio"] == pytest.approx(18.0)


def test_ratio_inf_and_peak_ratio():
    pts = [_pt("ours", 1, 2.0, 10), _pt("x", 1, 0.0, 10), _pt("x", 2, 1.0, 10)]
    assert math.isinf(sw.ratio_table(pts, ["ours"], ["x"])[0]["goodput_ratio"])
    pk = sw.peak_ratio(pts, "ours", ["x", "missing"])
    assert pk["best_other"] == "x" and pk["best_other_at_rate_scale"] == 2
    assert pk["ratio"] == pytest.approx(2.0)


def test_markdown_tables_render():
    pts = [_pt("ours", 1, 6.0, 100), _pt("x", 1, 4.0, None)]
    md = sw.markdown_points(pts)
    assert md.count("\n") == 3 and "| ours | 1 |" in md
    rt = sw.markdown_ratios(sw.ratio_table(pts, ["ours"], ["x"]))
    assert "1.50" in rt and "| - |" in rt  # no other TTFT p99 -> no ratio
    assert sw.fmt(None) == "-" and sw.fmt(math.inf) == "inf"
