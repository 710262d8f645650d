"""benchmarks/heldout_readings.py with several frontend processes: the admission counters
of every process's own /metrics, summed (the API port's answers from one of them)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, start_http_server

pytestmark = pytest.mark.unit

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import heldout_readings  # noqa: E402


def _process(met: int, missed: int, refused: int, servers: list) -> str:
    reg = CollectorRegistry()
    c = Counter("splitserve_qos_confusion_total", "", ["outcome"], registry=reg)
    c.labels("admitted-met").inc(met)
    c.labels("admitted-missed").inc(missed)
    c.labels("refused").inc(refused)
    server, _ = start_http_server(0, addr="127.0.0.1", registry=reg)
    servers.append(server)
    return f"http://127.0.0.1:{server.server_port}/metrics"


def test_the_confusion_table_sums_every_frontend_process():
    servers: list = []
    try:
        one, two = _process(10, 1, 5, servers), _process(7, 2, 0, servers)
        assert heldout_readings.confusion(one) == {
            "admitted-met": 10, "admitted-missed": 1, "refused": 5}
        assert heldout_readings.confusion([one, two]) == {
            "admitted-met": 17, "admitted-missed": 3, "refused": 5}
        assert heldout_readings.confusion(None) is None
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
