"""benchmarks/heldout.py's per-window timeline: refused, met and admitted-and-missed per
5 s of arrivals, and the measured TTFT against admission's prediction."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]


def _load():
    sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_heldout", REPO / "benchmarks" /
                                                  "heldout.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_each_window_counts_outcomes_and_sets_measured_against_predicted():
    heldout = _load()
    slo = {"ttft_ms": 1000.0, "tpot_ms": 50.0}
    records = [
        {"scheduled_s": 0.5, "outcome": "ok", "ttft_s": 0.2, "tpot_s": 0.02,
         "predicted_ttft_s": 0.1},
        {"scheduled_s": 1.0, "outcome": "ok", "ttft_s": 1.5, "tpot_s": 0.02,
         "predicted_ttft_s": 0.5},  # late: admitted and missed
        {"scheduled_s": 2.0, "outcome": "rejected", "ttft_s": None},
        {"scheduled_s": 3.0, "outcome": "ok", "ttft_s": 0.3, "tpot_s": 0.09},  # TPOT miss
        {"scheduled_s": 7.0, "outcome": "error", "ttft_s": None},  # never answered
    ]
    rows = heldout.timeline(records, slo)
    assert [r["from_s"] for r in rows] == [0.0, 5.0]
    first, second = rows
    assert (first["sent"], first["refused"], first["met"], first["admitted_missed"]) == \
        (4, 1, 1, 2)
    assert first["predicted_p50_s"] == 0.5  # of the two with a prediction
    assert first["measured_over_predicted_p50"] == 3.0
    assert (second["sent"], second["admitted_missed"], second["ttft_p50_s"]) == (1, 1, None)


def test_the_best_single_dynamo_configuration_is_the_best_on_average_over_cases():
    heldout = _load()
    points = [{"case": c, "config": cfg, "goodput_rps": g} for c, cfg, g in [
        ("burst", heldout.OURS, 10.0), ("burst", "dynamo-kv", 4.0),
        ("burst", "dynamo-kv-busy-0.7-0.5", 8.0),
        ("below", heldout.OURS, 10.0), ("below", "dynamo-kv", 10.0),
        ("below", "dynamo-kv-busy-0.7-0.5", 4.0)]]
    # kv: (0.5 + 1.0) / 2 = 0.75; busy: (1.0 + 0.4) / 2 = 0.7
    name, per_case = heldout.best_single(points)
    assert name == "dynamo-kv"
    assert per_case == {"burst": (10.0, 4.0), "below": (10.0, 10.0)}
    assert heldout.best_single([points[0]]) is None


def test_a_disaggregated_case_compares_the_default_graph_with_dynamos_disaggregation():
    heldout = _load()
    base = {"ttft_p99_ms": 1.0, "tpot_p99_ms": 1.0, "ttft_p50_ms": 1.0, "tpot_p50_ms": 1.0,
            "slo_attainment": 1.0, "ok": 1, "rejected": 0, "errors": 0}
    points = [{**base, "case": "disagg-below", "config": cfg, "goodput_rps": g} for cfg, g in [
        ("splitserve-disagg", 9.0), ("splitserve-disagg-remote", 12.0),
        ("dynamo-disagg", 10.0)]]
    _, rows = heldout.table(points)
    # the forced-remote variant is this project's too: never "Dynamo's best"
    assert rows == [{"case": "disagg-below", "ours": 9.0, "best": 10.0,
                     "best_config": "dynamo-disagg", "ratio": 0.9,
                     "admitted_missed_share": None, "client_admitted_missed_share": None,
                     "false_refusal_share": None}]
    # a disaggregated case runs only the disaggregated configurations
    assert heldout.CASES["disagg-below"].prefill_workers == 2


def test_a_case_row_shows_the_clients_misses_and_the_prediction_error_beside_the_table():
    heldout = _load()
    base = {"ttft_p99_ms": 1.0, "tpot_p99_ms": 1.0, "ttft_p50_ms": 1.0, "tpot_p50_ms": 1.0,
            "slo_attainment": 0.5, "rejected": 0, "errors": 0, "case": "burst"}
    error = {"ttft": {"p10": -0.25, "p50": 0.0, "p90": 0.5},
             "tpot": {"p10": -0.5, "p50": 0.25, "p90": 1.0}}
    points = [{**base, "config": heldout.OURS, "goodput_rps": 8.0, "ok": 40,
               "client_admitted_missed": 6, "prediction_error": error,
               "confusion": {"admitted-met": 38.0, "admitted-missed": 2.0}},
              {**base, "config": "dynamo-kv", "goodput_rps": 4.0, "ok": 50}]
    text, rows = heldout.table(points)
    assert rows[0]["admitted_missed_share"] == pytest.approx(0.05)
    assert rows[0]["client_admitted_missed_share"] == pytest.approx(0.15)
    assert "client: 6 of 40 missed (15.0%)" in text
    assert "log2 error p10/p50/p90 TTFT -0.25/+0/+0.5, TPOT -0.5/+0.25/+1" in text
    assert heldout.error_cells(None) == ""


def test_the_frontend_sampler_keeps_the_highest_reading_per_window():
    heldout = _load()
    sampler = heldout.Sampler(None)
    sampler.rows = [{"t_s": 0.5, "loop_lag_s": 0.01, "inflight": 3},
                    {"t_s": 4.5, "loop_lag_s": 0.2, "inflight": 1},
                    {"t_s": 5.5, "loop_lag_s": 0.0, "inflight": 9}]
    assert sampler.windows() == [
        {"from_s": 0.0, "max_loop_lag_s": 0.2, "max_inflight": 3},
        {"from_s": 5.0, "max_loop_lag_s": 0.0, "max_inflight": 9}]


def test_repeated_ours_set_keeps_every_override():
    args = _load().parser().parse_args([
        "--ours-set=--Frontend.router.qos.placement=slo",
        "--ours-set=--Frontend.router.qos.hold.enabled=false"])
    assert args.ours_set == ["--Frontend.router.qos.placement=slo",
                             "--Frontend.router.qos.hold.enabled=false"]
    assert _load().parser().parse_args([]).ours_set == []
