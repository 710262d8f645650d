"""Argument parsing of `dynamo bench run|sweep` (no server: the replay is replaced)."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from splitserve.cli import bench_cmd
from splitserve.cli.main import app

pytestmark = pytest.mark.unit


def _fake_result(cfg):
    d = {"n": 1, "mean": 5.0, "p50": 5.0, "p90": 5.0, "p99": 5.0}
    return {"config": {"rate_scale": cfg.rate_scale, "seed": cfg.seed},
            "workload": {"offered_rps": 2.0 * cfg.rate_scale},
            "summary": {"requests": 1, "outcomes": {"ok": 1}, "makespan_s": 1.0, "ttft_ms": d,
                        "tpot_ms": d, "e2e_ms": d, "request_throughput_rps": 1.0,
                        "output_token_throughput_tps": 3.0, "goodput_rps": 1.0,
                        "slo_attainment": 1.0},
            "requests": [{"index": 0, "outcome": "ok", "ttft_s": 0.005, "tpot_s": 0.005}]}


@pytest.fixture
def calls(monkeypatch):
    seen = []

    def fake(url, cfg, **kw):
        seen.append((url, cfg, kw))
        return _fake_result(cfg)

    monkeypatch.setattr(bench_cmd, "execute_run", fake)
    return seen


def test_build_config_parses_and_validates():
    cfg = bench_cmd.build_config(trace="t.jsonl", duration_s=30, rate_scale=2, token_scale=8,
                                 slo="ttft=500,tpot=40")
    assert cfg.slo == {"ttft_ms": 500.0, "tpot_ms": 40.0}
    assert (cfg.rate_scale, cfg.token_scale, cfg.duration_s) == (2, 8, 30)
    for kw in ({"slo": "latency=3"}, {"token_scale": 3}, {"rate_scale": 0},
               {"duration_s": -1}, {"max_requests": 0}, {"fmt": "parquet"}):
        with pytest.raises(typer.BadParameter):
            bench_cmd.build_config(**kw)


def test_run_writes_json(calls, tmp_path):
    out = tmp_path / "r.json"
    r = CliRunner().invoke(app, ["bench", "run", "--url", "http://127.0.0.1:9", "--trace",
                                 "x.jsonl", "--max-requests", "20", "--time-scale", "0.5",
                                 "--rate-scale", "3", "--token-scale", "16",
                                 "--slo", "ttft=800,tpot=60", "--out", str(out),
                                 "--deadline-s", "30", "--progress-s", "0"])
    assert r.exit_code == 0, r.output
    (url, cfg, kw), = calls
    assert url == "http://127.0.0.1:9" and cfg.max_requests == 20 and cfg.time_scale == 0.5
    assert cfg.rate_scale == 3 and cfg.slo == {"ttft_ms": 800.0, "tpot_ms": 60.0}
    assert kw["deadline_s"] == 30 and kw["progress_s"] == 0
    data = json.loads(out.read_text())
    assert data["summary"]["goodput_rps"] == 1.0 and data["command"].startswith("dynamo ")


def test_run_rejects_bad_slo(calls):
    r = CliRunner().invoke(app, ["bench", "run", "--url", "http://x", "--slo", "p99=3"])
    assert r.exit_code != 0 and not calls


def test_run_requires_url(calls):
    r = CliRunner().invoke(app, ["bench", "run"])
    assert r.exit_code != 0 and not calls


def test_sweep_seeds_and_points(calls, tmp_path, monkeypatch):
    monkeypatch.setattr(bench_cmd.time, "sleep", lambda s: None)
    out = tmp_path / "s.json"
    r = CliRunner().invoke(app, ["bench", "sweep", "--url", "http://x", "--rate-scales", "1,4",
                                 "--seed", "7", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert [(c.rate_scale, c.seed) for _, c, _ in calls] == [(1.0, 7), (4.0, 8)]
    data = json.loads(out.read_text())
    assert [p["rate_scale"] for p in data["points"]] == [1.0, 4.0]
    assert data["points"][1]["offered_rps"] == 8.0 and set(data["results"]) == {"x1", "x4"}


def test_sweep_same_prefixes_and_bad_scales(calls, monkeypatch):
    monkeypatch.setattr(bench_cmd.time, "sleep", lambda s: None)
    r = CliRunner().invoke(app, ["bench", "sweep", "--url", "http://x", "--rate-scales", "2,3",
                                 "--same-prefixes"])
    assert r.exit_code == 0, r.output
    assert [c.seed for _, c, _ in calls] == [0, 0]
    r = CliRunner().invoke(app, ["bench", "sweep", "--url", "http://x", "--rate-scales", "0"])
    assert r.exit_code != 0
