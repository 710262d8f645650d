"""`dynamo bench run` end to end: ~20 requests of the Mooncake trace (or a synthetic one if
the shared trace is absent) against a small mocker graph; the JSON has the summary fields
and a PNG is written."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest


pytestmark = [pytest.mark.e2e, pytest.mark.deep]

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "../shared/traces/mooncake_fast25_conversation_trace.jsonl"


def _wait_serving(url: str, timeout_s: float = 30) -> None:
    """Until 3 requests in a row succeed (the frontend may not have discovered every worker
    the moment the graph reports ready)."""
    import httpx

    body = {"model": "SmolLM2-135M-Instruct", "prompt": [100, 200, 300], "max_tokens": 2}
    streak, deadline = 0, time.monotonic() + timeout_s
    while streak < 3:
        assert time.monotonic() < deadline, "graph not serving"
        try:
            ok = httpx.post(f"{url}/v1/completions", json=body, timeout=10).status_code == 200
        except httpx.HTTPError:
            ok = False
        streak = streak + 1 if ok else 0
        if not ok:
            time.sleep(0.5)


@pytest.mark.timeout(90)
def test_bench_run_smoke(tmp_path, mocker_graph):
    trace = TRACE
    if not trace.exists():
        trace = tmp_path / "synthetic.jsonl"
        trace.write_text("".join(json.dumps(
            {"timestamp": 100 * i, "input_length": 512 * (2 + i % 3), "output_length": 64,
             "hash_ids": [0, 1 + i % 2, *range(100 + 10 * i, 100 + 10 * i + i % 3)]}) + "\n"
            for i in range(20)))
    _, url = mocker_graph
    _wait_serving(url)
    out, plots = tmp_path / "bench.json", tmp_path / "plots"
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "splitserve.cli.main", "bench", "run", "--url", url,
         "--trace", str(trace), "--max-requests", "20", "--time-scale", "0.1",
         "--token-scale", "16", "--output-scale", "16", "--slo", "ttft=5000,tpot=1000",
         "--request-timeout", "20", "--deadline-s", "30", "--progress-s", "1",
         "--out", str(out), "--plots", str(plots)],
        check=False, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert time.monotonic() - t0 < 60
    data = json.loads(out.read_text())
    s = data["summary"]
    assert s["requests"] == len(data["requests"]) == 20
    assert s["outcomes"].get("ok") == 20, [r.get("error") for r in data["requests"]]
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert {"n", "mean", "p50", "p90", "p99"} <= set(s[key])
    assert s["ttft_ms"]["p99"] > 0 and s["goodput_rps"] > 0 and s["slo_met"] <= 20
    assert {"workload", "config", "command"} <= set(data)
    assert data["workload"]["window_requests"] == 20
    png = plots / "latency_cdf.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "requests over" in proc.stdout and "goodput" in proc.stdout
