"""Live graphs for the security tests (bounded, loopback only, every process killed)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def agg_graph(graph_pool):
    """graphs.agg with the real SmolLM2 CPU worker; short read deadlines so slow-client
    cases finish quickly.  Yields the frontend's base URL."""
    _, url = graph_pool.get("graphs.agg:Frontend", "configs/agg.yaml",
                            "--Frontend.header_timeout_s=2", "--Frontend.body_timeout_s=2")
    return url
