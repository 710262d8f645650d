"""Live graphs for the security tests (bounded, loopback only, every process killed)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import start_graph


@pytest.fixture(scope="module")
def agg_graph(tmp_path_factory):
    """graphs.agg with the real SmolLM2 CPU worker; short read deadlines so slow-client
    cases finish quickly.  Yields the frontend's base URL."""
    run, url = start_graph(tmp_path_factory.mktemp("agg-security"), "graphs.agg:Frontend",
                           "configs/agg.yaml", "--Frontend.header_timeout_s=2",
                           "--Frontend.body_timeout_s=2")
    yield url
    assert run.stop() == 0, run.output()[-3000:]
