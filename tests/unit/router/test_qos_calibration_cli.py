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
        m.confusion.labels("default", outcome).inc(n)
    m.verdicts.labels("default", "rejected", "ttft-slo-risk").inc(2)
    m.verdicts.labels("default", "rejected", "tpot-slo-risk").inc(1)
    m.verdicts.labels("default", "shadow-rejected", "ttft-slo-risk").inc(2)
    for x in [0.0] * 8 + [0.8, 3.5]:
        m.error.labels("ttft").observe(x)
    m.error.labels("tpot").observe(-0.3)
    return generate_latest(registry).decode()


def test_summary_from_metrics_text():
    cal = qos_cmd.Calibration()
    cal.add(exported())
    cal.add(exported())  # two processes add up
    out = cal.summary()
    assert out["confusion"] == {"refused": 6, "admitted-met": 180, "admitted-missed": 10,
                                "would-refuse-met": 2, "would-refuse-missed": 2}
    assert out["refusals_by_reason"] == {"ttft-slo-risk": 4, "tpot-slo-risk": 2}
    assert out["would_refuse_by_reason"] == {"ttft-slo-risk": 4}
    assert out["missed_share_of_admitted"] == pytest.approx(12 / 194)
    assert out["false_share_of_would_refuse"] == pytest.approx(0.5)
    ttft = out["calibration"]["ttft"]
    assert (ttft["p50"], ttft["p90"]) == (0.1, 1.0)
    assert ttft["within_2x"] == pytest.approx(0.9)
    assert out["calibration"]["tpot"]["p50"] == -0.25


def test_command_prints_the_table(monkeypatch):
    monkeypatch.setattr(qos_cmd, "_fetch", lambda url, timeout_s=3.0: exported("shadow"))
    result = CliRunner().invoke(app, ["qos", "calibration", "--metrics", "http://x/metrics"])
    assert result.exit_code == 0, result.output
    assert "admitted-missed" in result.output and "would-refuse-met" in result.output
    result = CliRunner().invoke(app, ["qos", "calibration", "--metrics", "http://x/metrics",
                                      "--json"])
    assert json.loads(result.output)["confusion"]["refused"] == 3


def test_command_fails_when_nothing_can_be_read(monkeypatch):
    monkeypatch.setattr(qos_cmd, "_fetch", lambda url, timeout_s=3.0: None)
    result = CliRunner().invoke(app, ["qos", "calibration", "--metrics", "http://x/metrics"])
    assert result.exit_code == 1
