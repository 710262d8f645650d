"""A worker reports "ready" only once discovery lists its instance."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.components.worker.readiness import report_ready_when_registered

pytestmark = pytest.mark.unit


class Endpoint:
    """A served endpoint whose registration shows up in discovery after ``after`` polls."""

    def __init__(self, after: int) -> None:
        self.polls, self.after = 0, after

    async def client(self):
        return self

    def instance_ids(self):
        self.polls += 1
        return [7] if self.polls > self.after else []


def test_ready_is_reported_after_registration_not_before():
    reports: list = []
    ep = Endpoint(after=5)

    def report(state, **fields):
        reports.append((state, ep.polls, fields))

    assert asyncio.run(report_ready_when_registered(report, ep, 7, poll_s=0.001,
                                                   endpoint="ns.w.generate"))
    assert reports == [("ready", 6, {"endpoint": "ns.w.generate"})]


def test_no_ready_report_when_the_instance_never_appears():
    reports: list = []
    ok = asyncio.run(report_ready_when_registered(lambda *a, **k: reports.append(a),
                                                  Endpoint(after=10**9), 7, timeout_s=0.05,
                                                  poll_s=0.001))
    assert not ok and reports == []
