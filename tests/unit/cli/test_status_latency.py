"""`dynamo status --latency` reads latency by pool back from the processes' /metrics:
each pool's TTFT, ITL and prefill stages and each frontend model's TTFT and ITL, as
bucket quantiles summed over replicas."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from typer.testing import CliRunner

from splitserve.cli import status_cmd
from splitserve.cli.main import app
from splitserve.components.frontend.metrics import FrontendMetrics
from splitserve.components.worker.disagg_metrics import PrefillMetrics
from splitserve.components.worker.latency_metrics import TokenLatency

pytestmark = pytest.mark.unit

MODEL, POOLED = "first", "my-qwen"


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def decode_worker(pool: str, model: str, ttfts: list[float], gap: float) -> str:
    """A decode worker's /metrics after one request per TTFT, each with 3 more deltas
    ``gap`` apart."""
    registry, clock = CollectorRegistry(), Clock()
    latency = TokenLatency(registry, pool, model, now=clock)
    for ttft in ttfts:
        c = latency.clock()
        for step in (ttft, gap, gap, gap):
            clock.t += step
            c.tokens(1)
    return generate_latest(registry).decode()


def prefill_worker(pool: str, model: str, jobs: int) -> str:
    metrics = PrefillMetrics(CollectorRegistry(), pool, model)
    for _ in range(jobs):
        metrics.latency.picked_up(enqueued_at=10.0, now=10.015)
        metrics.computed(0.3)
        metrics.transferred(0.004, 1 << 20)
    return generate_latest(metrics.registry).decode()


def frontend() -> str:
    m = FrontendMetrics()
    for _ in range(9):
        m.ttft.labels(MODEL, MODEL).observe(0.4)
        m.itl.labels(MODEL, MODEL).observe(0.015)
    m.ttft.labels(MODEL, MODEL).observe(7.0)
    m.ttft.labels(POOLED, POOLED).observe(0.09)
    return generate_latest(m.registry).decode()


def graph() -> dict[str, str]:
    """/metrics URL -> text of a two-pool disaggregated graph."""
    return {
        "http://d0/metrics": decode_worker("DecodeWorker", MODEL, [0.15] * 9, 0.008),
        "http://d1/metrics": decode_worker("DecodeWorker", MODEL, [3.0], 0.008),
        "http://p0/metrics": prefill_worker("PrefillWorker", MODEL, 4),
        "http://q0/metrics": decode_worker("DecodeWorker@qwen", POOLED, [0.03], 0.0015),
        "http://q1/metrics": prefill_worker("PrefillWorker@qwen", POOLED, 1),
        "http://f/metrics": frontend(),
    }


def rows(summary: dict) -> dict[str, dict]:
    return {r["pool"]: r for r in summary["pools"]}


def test_quantiles_per_pool_and_model_summed_over_replicas():
    table = status_cmd.LatencyByPool()
    for text in graph().values():
        table.add(text)
    out = table.summary()
    assert "upper bound" in out["quantiles"]
    pools = rows(out)
    assert [(r["pool"], r["model"]) for r in out["pools"]] == [
        ("DecodeWorker", MODEL), ("DecodeWorker@qwen", POOLED), ("PrefillWorker", MODEL),
        ("PrefillWorker@qwen", POOLED)]
    decode = pools["DecodeWorker"]
    # 9 requests at 150 ms on one replica, 1 at 3 s on the other
    assert decode["ttft"] == {"count": 10, "p50": 0.2, "p95": 5.0, "p99": 5.0}
    assert decode["itl"] == {"count": 30, "p50": 0.01, "p95": 0.01, "p99": 0.01}
    assert decode["prefill_compute"] == {"count": 0, "p50": None, "p95": None, "p99": None}
    assert pools["DecodeWorker@qwen"]["ttft"]["p50"] == 0.05
    assert pools["DecodeWorker@qwen"]["itl"]["p99"] == 0.002
    prefill = pools["PrefillWorker"]
    assert prefill["prefill_queue_wait"] == {"count": 4, "p50": 0.02, "p95": 0.02,
                                             "p99": 0.02}
    assert prefill["prefill_compute"]["p50"] == 0.5
    assert prefill["kv_transfer"]["p99"] == 0.005
    assert prefill["ttft"]["count"] == 0
    assert pools["PrefillWorker@qwen"]["prefill_queue_wait"]["count"] == 1
    front = {r["model"]: r for r in out["frontend"]}
    assert front[MODEL]["ttft"] == {"count": 10, "p50": 0.5, "p95": 10.0, "p99": 10.0}
    assert front[MODEL]["itl"]["p50"] == 0.02
    assert front[POOLED]["ttft"]["p50"] == 0.1 and front[POOLED]["itl"]["count"] == 0


def test_a_quantile_beyond_the_last_bucket_reads_plus_inf():
    table = status_cmd.LatencyByPool()
    table.add(decode_worker("DecodeWorker", MODEL, [500.0], 0.001))
    assert rows(table.summary())["DecodeWorker"]["ttft"]["p50"] == "+Inf"


def serve_texts(monkeypatch, texts: dict[str, str | None]) -> None:
    monkeypatch.setattr(status_cmd, "fetch_text", lambda url, timeout_s=3.0: texts.get(url))


def test_command_prints_the_tables(monkeypatch):
    texts = graph()
    serve_texts(monkeypatch, texts)
    args = ["status", "--latency", *(a for url in texts for a in ("--metrics", url))]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "latency by pool" in out and "upper bound of the histogram bucket" in out
    lines = [line.split() for line in out.splitlines()]
    assert ["DecodeWorker", MODEL, "TTFT", "10", "200ms", "5s", "5s"] in lines
    assert ["ITL", "30", "10ms", "10ms", "10ms"] in lines
    assert ["PrefillWorker@qwen", POOLED, "prefill", "queue", "wait", "1", "20ms", "20ms",
            "20ms"] in lines
    assert ["prefill", "compute", "4", "500ms", "500ms", "500ms"] in lines
    assert ["KV", "transfer", "4", "5ms", "5ms", "5ms"] in lines
    assert "frontend, by model" in out
    assert [MODEL, "TTFT", "10", "500ms", "10s", "10s"] in lines
    assert [POOLED, "TTFT", "1", "100ms", "100ms", "100ms"] in lines


def test_a_pool_that_served_nothing_yet_is_listed(monkeypatch):
    serve_texts(monkeypatch, {"http://d/metrics": decode_worker("DecodeWorker", MODEL, [], 0)})
    result = CliRunner().invoke(app, ["status", "--latency", "--metrics", "http://d/metrics"])
    assert result.exit_code == 0, result.output
    assert ["DecodeWorker", MODEL, "-", "0", "-", "-", "-"] in [
        line.split() for line in result.output.splitlines()]


def test_command_json_and_unreadable_endpoints(monkeypatch):
    texts: dict[str, str | None] = {**graph(), "http://gone/metrics": None,
                                    "http://html/metrics": "<html>not metrics</html>"}
    serve_texts(monkeypatch, texts)
    args = ["status", "--json", *(a for url in texts for a in ("--metrics", url))]
    result = CliRunner().invoke(app, args)  # --metrics alone implies --latency
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert rows(out)["DecodeWorker"]["ttft"]["p95"] == 5.0
    unreadable = {u["url"]: u["error"] for u in out["unreadable"]}
    assert set(unreadable) == {"http://gone/metrics", "http://html/metrics"}
    assert unreadable["http://gone/metrics"] == "unreachable"
    assert len(out["sources"]) == len(texts)


def test_command_exits_1_when_nothing_can_be_read(monkeypatch, tmp_path):
    serve_texts(monkeypatch, {})
    result = CliRunner().invoke(app, ["status", "--latency", "--metrics", "http://gone/m"])
    assert result.exit_code == 1 and "could not read any /metrics" in result.output
    result = CliRunner().invoke(app, ["status", "--latency", "--state-dir", str(tmp_path)])
    assert result.exit_code == 1 and "no running graph found" in result.output


def test_where_each_replica_serves_its_metrics():
    assert status_cmd.replica_metrics_url(
        {"component": "DecodeWorker", "endpoint": "dynamo.decodeworker.generate",
         "metrics": "http://127.0.0.1:4321/metrics"}) == "http://127.0.0.1:4321/metrics"
    assert status_cmd.replica_metrics_url(
        {"component": "Frontend", "endpoint": "http://127.0.0.1:8000/", "metrics": ""}
    ) == "http://127.0.0.1:8000/metrics"
    assert status_cmd.replica_metrics_url(
        {"component": "Worker", "endpoint": "dynamo.worker.generate", "metrics": ""}) is None
