"""Plot data preparation (and that the PNGs are written) of splitserve.bench.plots."""

from __future__ import annotations

import pytest

from splitserve.bench import plots, sweep

pytestmark = pytest.mark.unit


def _res(ttfts, tpots, outcomes=None):
    reqs = []
    for i, (a, b) in enumerate(zip(ttfts, tpots, strict=True)):
        reqs.append({"index": i, "outcome": (outcomes or ["ok"] * len(ttfts))[i],
                     "ttft_s": a, "tpot_s": b})
    return {"requests": reqs}


def test_cdf():
    xs, ys = plots.cdf([3.0, 1.0, 2.0, None])
    assert xs == [1.0, 2.0, 3.0] and ys == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert plots.cdf([]) == ([], [])


def test_latency_samples_only_ok_and_ms():
    r = _res([0.1, 0.2, 0.3], [0.01, None, 0.02], ["ok", "ok", "error"])
    s = plots.latency_samples(r)
    assert s["ttft_ms"] == pytest.approx([100.0, 200.0])
    assert s["tpot_ms"] == pytest.approx([10.0])


def _pt(config, rs, offered, goodput, p99):
    return {"config": config, "rate_scale": rs, "offered_rps": offered, "goodput_rps": goodput,
            "ttft_p99_ms": p99}


def test_sweep_series_ordered_and_skips_unknown_load():
    pts = [_pt("a", 4, 40.0, 10.0, 900.0), _pt("a", 1, 10.0, 9.5, 100.0),
           _pt("a", 2, None, 1.0, 1.0), _pt("b", 1, 10.0, 9.0, 120.0)]
    s = plots.sweep_series(pts)
    assert s["a"]["offered_rps"] == [10.0, 40.0]
    assert s["a"]["goodput_rps"] == [9.5, 10.0] and s["a"]["ttft_p99_ms"] == [100.0, 900.0]
    assert s["b"]["rate_scale"] == [1]


def test_pngs_written(tmp_path):
    pytest.importorskip("matplotlib")
    res = {"a": _res([0.1, 0.2], [0.01, 0.02]), "empty": {"requests": []}}
    p = plots.plot_latency_cdfs(res, tmp_path / "sub" / "cdf.png", title="t",
                                slo={"ttft_ms": 150.0, "tpot_ms": 15.0})
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pts = [_pt("a", 1, 10.0, 9.0, 100.0), _pt("a", 2, 20.0, None, None)]
    q = plots.plot_sweep(pts, tmp_path / "sweep.png", slo={"ttft_ms": 500.0})
    assert q.stat().st_size > 1000
    assert sweep.by_config(pts)["a"][0]["rate_scale"] == 1
