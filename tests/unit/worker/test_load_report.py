"""A failed load report is counted and logged once per kind, never swallowed silently."""

from __future__ import annotations

import logging

import pytest

from splitserve.components.worker.loadreport import ReportFailures
from splitserve.contracts.kit.worker_metrics import WorkerMetrics

pytestmark = pytest.mark.unit


def test_failures_are_counted_and_each_kind_logged_once(caplog):
    metrics = WorkerMetrics()
    failed = ReportFailures(metrics.load_report_failures)
    with caplog.at_level(logging.WARNING, logger="splitserve.worker"):
        for _ in range(5):
            failed(ConnectionError("nats: connection closed"))
        failed(ValueError("engine stats unavailable"))
    count = metrics.registry.get_sample_value(
        "splitserve_worker_load_report_failures_total")
    assert count == 6
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2
    assert "nats: connection closed" in logged[0] and "engine stats" in logged[1]
