"""benchmarks/predictor_replay.py: a traced run's predictor inputs, replayed offline
through a fresh predictor, give back the predictions the run made."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from components.router.qos.predictor import LatencyPredictor

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]


def _load():
    spec = importlib.util.spec_from_file_location("bench_predictor_replay",
                                                  REPO / "benchmarks" / "predictor_replay.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _live_run(trace_to: Path) -> list:
    """A predictor driven as the gate drives it (predict, place, first token, progress,
    release) over two waves of requests on two workers, tracing to ``trace_to``; returns
    the calibrations it gave."""
    rows = []
    live = LatencyPredictor()
    live.trace = rows.append
    cals = []
    now = 100.0
    for wave in range(2):
        rids = []
        for i in range(6):
            rid, worker = f"r{wave}-{i}", f"{i % 2:x}"
            est = live.predict(worker, 200 + 100 * i, now, output_tokens=40,
                               class_name="default", context_tokens=400 + 100 * i)
            live.place(rid, worker, est, now, class_name="default", max_tokens=40,
                       tpot_budget_ms=50.0)
            rids.append(rid)
            now += 0.05
        for j, rid in enumerate(rids):
            live.first_token(rid, now + 0.1 * j)
        now += 0.7
        for rid in rids:
            live.decode_progress(rid, 16, now)
        now += 1.0
        for j, rid in enumerate(rids):
            cals.append(live.finish(rid, now, ok=True, ttft_s=0.1 + 0.1 * j,
                                    duration_s=1.9 + 0.05 * j, output_tokens=40))
        now += 5.0
    trace_to.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [c for c in cals if c is not None]


def test_a_replay_gives_back_the_runs_predictions(tmp_path):
    replay = _load()
    trace = tmp_path / "run.jsonl"
    live = _live_run(trace)
    rows = replay.read(str(trace))
    assert {r["event"] for r in rows} == {"place", "first_token", "progress", "release"}
    again = [cal for _, cal in replay.replay(rows, LatencyPredictor())]
    assert len(again) == len(live) == 12
    assert [(c.predicted_ttft_ms, c.predicted_tpot_ms, c.measured_tpot_ms) for c in again] \
        == [(c.predicted_ttft_ms, c.predicted_tpot_ms, c.measured_tpot_ms) for c in live]
    # The second wave was judged on fits the first taught.
    assert any(c.ttft_observed and c.tpot_observed for c in again)


def test_the_summary_counts_errors_and_both_kinds_of_misjudgement(tmp_path):
    replay = _load()
    live = _live_run(tmp_path / "run.jsonl")
    results = [({"tpot_budget_ms": 50.0}, c) for c in live]
    out = replay.summary(results, ttft_ms=150.0)
    for kind in ("ttft", "tpot"):
        s = out[kind]
        assert s["samples"] > 0 and s["p10"] <= s["p50"] <= s["p90"]
        assert 0.0 <= s["within_2x"] <= 1.0
        assert s["predicted_within_missed"] + s["predicted_over_met"] <= s["judged"]


def test_a_trace_without_placements_is_refused_by_name(tmp_path, capsys):
    replay = _load()
    old = tmp_path / "old.jsonl"
    old.write_text(json.dumps({"event": "first_token", "request": "a", "at": 1.0}) + "\n")
    assert replay.main([str(old)]) == 2
    assert "no placements recorded" in capsys.readouterr().err
