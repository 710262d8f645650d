"""benchmarks/predictor_replay.py: a traced run's predictor inputs, replayed offline
through a fresh predictor, give back the predictions the run made."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from components.router.qos.predictor import LatencyPredictor

from .loader import load_benchmark

pytestmark = pytest.mark.unit


def _load():
    return load_benchmark("predictor_replay")


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
    results = [({"tpot_budget_ms": 50.0, "max_tokens": 40 if i % 2 else 300}, c)
               for i, c in enumerate(live)]
    out = replay.summary(results, ttft_ms=150.0)
    for kind in ("ttft", "tpot"):
        s = out[kind]
        assert s["samples"] > 0 and s["p10"] <= s["p50"] <= s["p90"]
        assert 0.0 <= s["within_2x"] <= 1.0
        assert s["predicted_within_missed"] + s["predicted_over_met"] <= s["judged"]
    # TPOT errors also by answer length, in the order of the bounds
    groups = out["tpot"]["p50_by_answer_length"]
    assert list(groups) == ["<=64", ">256"]
    assert sum(g["samples"] for g in groups.values()) == out["tpot"]["samples"]
    assert "p50_by_answer_length" not in out["ttft"]
    assert [replay.length_group(n) for n in (1, 16, 17, 256, 257)] == \
        ["<=16", "<=16", "<=64", "<=256", ">256"]


def test_a_trace_without_placements_is_refused_by_name(tmp_path, capsys):
    replay = _load()
    old = tmp_path / "old.jsonl"
    old.write_text(json.dumps({"event": "first_token", "request": "a", "at": 1.0}) + "\n")
    assert replay.main([str(old)]) == 2
    assert "no placements recorded" in capsys.readouterr().err


def test_verdicts_judge_each_placement_as_the_enforcing_default(tmp_path):
    replay = _load()
    trace = tmp_path / "run.jsonl"
    _live_run(trace)
    rows = replay.read(str(trace))
    # A TTFT target no request can meet: the first wave is judged blind (no fits yet:
    # admitted), the second on the fits the first taught: refused behind a queue, and
    # admitted only where its own prefill alone is over the target (never refused for
    # its own length).
    results = replay.replay(rows, LatencyPredictor(), ttft_ms=1.0)
    verdicts = {p["request"]: (p["verdict"], p["admitted"]) for p, _ in results}
    assert {verdicts[f"r0-{i}"] for i in range(6)} == {("no-estimate", True)}
    second = {verdicts[f"r1-{i}"] for i in range(6)}
    assert ("ttft-slo-risk", False) in second
    assert second <= {("ttft-slo-risk", False), ("within-slo", True)}
    refused = sum(1 for v, _ in verdicts.values() if v == "ttft-slo-risk")
    out = replay.verdicts(results, ttft_ms=1.0)
    assert out["reasons"]["no-estimate"] == {"n": 6, "met": 0, "max_tokens_p50_missed": 40}
    assert out["reasons"]["ttft-slo-risk"] == {"n": refused, "met": 0,
                                               "max_tokens_p50_missed": 40}
    assert (out["admitted"], out["admitted_missed"]) == (12 - refused, 12 - refused)
    assert (out["refused_or_held"], out["of_which_met"], out["false_share"]) == \
        (refused, 0, 0.0)
    # A target every request meets: nothing refused for TTFT, and nothing it admitted
    # missed it.
    results = replay.replay(rows, LatencyPredictor(), ttft_ms=1e6)
    out = replay.verdicts(results, ttft_ms=1e6)
    assert "ttft-slo-risk" not in out["reasons"]
    assert sum(c["n"] for c in out["reasons"].values()) == 12
    assert all(c["met"] <= c["n"] for c in out["reasons"].values())
    assert all(c["max_tokens_p50_met"] == 40 for c in out["reasons"].values() if c["met"])
    # Without a target the placements carry no verdict.
    assert all("verdict" not in p for p, _ in replay.replay(rows, LatencyPredictor()))


def test_the_verdicts_command_takes_qos_fields_and_needs_a_ttft_target(tmp_path, capsys):
    replay = _load()
    trace = tmp_path / "run.jsonl"
    _live_run(trace)
    out = tmp_path / "out.json"
    qos = '{"hold": {"running_headroom": 0.1}}'
    assert replay.main([str(trace), "--ttft-ms", "150", "--verdicts", "--qos", qos,
                        "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["qos"] == {"hold": {"running_headroom": 0.1}}
    assert sum(c["n"] for c in written["report"][str(trace)]["verdicts"]["reasons"]
               .values()) == 12
    assert "verdicts:" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        replay.main([str(trace), "--verdicts"])
    assert "--verdicts needs --ttft-ms" in capsys.readouterr().err
    with pytest.raises(ValueError):  # a qos field that does not exist is refused by name
        replay.enforcing(150.0, 50.0, {"hold": {"headroom": 0.1}})
