"""`dynamo qos calibration` reads the gate's metrics back: the confusion table, the
refusals by reason and the calibration quantiles."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from typer.testing import CliRunner

from splitserve.cli import qos_cmd
from splitserve.cli.main import app
from splitserve.components.router.qos import QosConfig
from splitserve.components.router.qos_gate import QosGate

pytestmark = pytest.mark.unit


def exported(mode: str = "enforce") -> str:
    """A gate's /metrics after a known history."""
    registry = CollectorRegistry()
    gate = QosGate(QosConfig.model_validate({"mode": mode}), registry)
    m = gate.metrics
    for outcome, n in (("refused", 3), ("admitted-met", 90), ("admitted-missed", 5),
                       ("would-refuse-met", 1), ("would-refuse-missed", 1)):
        m.confusion.labels("default", outcome, "a").inc(n)
    m.confusion.labels("high", "admitted-met", "b").inc(4)
    m.verdicts.labels("default", "rejected", "ttft-slo-risk").inc(2)
    m.verdicts.labels("default", "rejected", "tpot-slo-risk").inc(1)
    m.verdicts.labels("default", "shadow-rejected", "ttft-slo-risk").inc(2)
    m.held.labels("default", "tpot-slo-risk", "placed").inc(6)
    for x in [0.0] * 8 + [0.8, 3.5]:
        m.error.labels("ttft", "default", "a").observe(x)
    m.error.labels("tpot", "default", "a").observe(-0.3)
    m.error.labels("ttft", "high", "b").observe(2.5)
    m.stall.labels("a", "charged").set(0.029)
    m.stall.labels("a", "measured").set(0.037)
    return generate_latest(registry).decode()


def test_summary_from_metrics_text():
    cal = qos_cmd.Calibration()
    cal.add(exported())
    cal.add(exported())  # two processes add up
    out = cal.summary()
    assert out["confusion"] == {"refused": 6, "admitted-met": 188, "admitted-missed": 10,
                                "would-refuse-met": 2, "would-refuse-missed": 2}
    assert out["refusals_by_reason"] == {"ttft-slo-risk": 4, "tpot-slo-risk": 2}
    assert out["would_refuse_by_reason"] == {"ttft-slo-risk": 4}
    assert out["held_by_outcome"] == {"placed": 12}
    assert out["missed_share_of_admitted"] == pytest.approx(12 / 202)
    assert out["false_share_of_would_refuse"] == pytest.approx(0.5)
    ttft = out["calibration"]["ttft"]
    assert (ttft["p50"], ttft["p90"]) == (0.1, 3.0)  # 4 of 22 beyond 2x, 2 of them 2.5
    assert ttft["within_2x"] == pytest.approx(18 / 22)
    assert out["calibration"]["tpot"]["p50"] == -0.25
    assert out["stall_ms_per_token"] == {"a": {"charged": 0.029, "measured": 0.037}}


def test_per_class_and_per_worker():
    texts = [exported(), exported()]
    by_worker = qos_cmd.grouped(texts, "worker")
    assert set(by_worker) == {"a", "b"}
    assert by_worker["b"]["confusion"]["admitted-met"] == 8
    assert by_worker["b"]["calibration"]["ttft"]["p50"] == 3.0  # its one error, 2.5
    assert by_worker["a"]["confusion"]["refused"] == 6
    by_class = qos_cmd.grouped(texts, "class")
    assert by_class["high"]["calibration"]["ttft"]["within_2x"] == 0.0
    assert by_class["default"]["calibration"]["ttft"]["within_2x"] == pytest.approx(0.9)


def test_command_prints_the_table(monkeypatch):
    monkeypatch.setattr(qos_cmd, "_fetch", lambda url, timeout_s=3.0: exported("shadow"))
    result = CliRunner().invoke(app, ["qos", "calibration", "--metrics", "http://x/metrics"])
    assert result.exit_code == 0, result.output
    assert "admitted-missed" in result.output and "would-refuse-met" in result.output
    assert "prompt stall" in result.output and "1.28" in result.output  # 0.037 / 0.029
    result = CliRunner().invoke(app, ["qos", "calibration", "--metrics", "http://x/metrics",
                                      "--json"])
    assert json.loads(result.output)["confusion"]["refused"] == 3
    result = CliRunner().invoke(app, ["qos", "calibration", "--metrics", "http://x/metrics",
                                      "--by", "worker"])
    assert result.exit_code == 0 and "per worker" in result.output, result.output
    result = CliRunner().invoke(app, ["qos", "calibration", "--metrics", "http://x/metrics",
                                      "--by", "pool"])
    assert result.exit_code == 2 and "--by 'pool'" in result.output


def test_command_fails_when_nothing_can_be_read(monkeypatch):
    monkeypatch.setattr(qos_cmd, "_fetch", lambda url, timeout_s=3.0: None)
    result = CliRunner().invoke(app, ["qos", "calibration", "--metrics", "http://x/metrics"])
    assert result.exit_code == 1


def test_every_model_pools_router_is_read_and_grouped_by_model(monkeypatch):
    """A graph with several models admits in its Router and in each pool's Router@<pool>
    (and, routing in process, in its frontend for the first model): all are read, and
    --by model sums each model's processes."""
    replicas = [
        {"component": "Router", "model": "base", "metrics": "http://r0/metrics"},
        {"component": "Router@llama", "model": "llama", "metrics": "http://r1/metrics"},
        {"component": "Frontend", "model": "base, llama", "metrics": "http://f/metrics"},
        {"component": "Worker@llama", "model": "llama", "metrics": "http://w/metrics"},
    ]
    monkeypatch.setattr(qos_cmd, "local_supervisors", lambda root: [{"pid": 1}])
    monkeypatch.setattr(qos_cmd, "supervisor_status", lambda info: {"replicas": replicas})
    monkeypatch.setattr(qos_cmd, "replica_metrics_url", lambda rep: rep["metrics"])
    assert qos_cmd.local_metrics_sources(None) == [
        ("http://r0/metrics", "base"), ("http://r1/metrics", "llama"),
        ("http://f/metrics", "base")]
    read: list[str] = []

    def fetch(url, timeout_s=3.0):
        read.append(url)
        return exported()

    monkeypatch.setattr(qos_cmd, "_fetch", fetch)
    result = CliRunner().invoke(app, ["qos", "calibration", "--by", "model", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert read == ["http://r0/metrics", "http://r1/metrics", "http://f/metrics"]
    assert out["confusion"]["admitted-met"] == 3 * 94
    assert out["by_model"]["base"]["confusion"]["admitted-met"] == 2 * 94
    assert out["by_model"]["llama"]["confusion"]["admitted-met"] == 94
    result = CliRunner().invoke(app, ["qos", "calibration", "--by", "model"])
    assert result.exit_code == 0 and "per model" in result.output, result.output
    result = CliRunner().invoke(app, ["qos", "calibration", "--by", "model", "--metrics",
                                      "http://x/metrics"])
    assert result.exit_code == 2 and "--by model reads the local graphs" in result.output
