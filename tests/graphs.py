"""Bringing whole graphs up with ``dynamo serve`` for the live tests, and the pool that
shares them.

``start_graph`` starts one graph on a free port for a test that changes or breaks it (a
kill, an outage, a scale-down): that test owns it and stops it.  ``GraphPool`` (the
session fixture ``graph_pool``) starts a graph once per test process for every test that
only sends it requests, keyed by (graph, config, overrides), and stops each at the end of
the session, where it must exit cleanly.  A pooled graph that has exited is an error, not
a silent restart: a test that broke a shared graph must own its graph instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.integration.serve_helpers import REPO, ServeRun


def start_graph(tmp_path: Path, graph: str, config: str, *overrides: str,
                timeout_s: float = 180) -> tuple[ServeRun, str]:
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


# The README's main graph: graphs.agg with configs/agg.yaml, no overrides.
AGG_TORCH = ("graphs.agg:Frontend", "configs/agg.yaml")
# agg_router with two mocker workers (sglang type) at high speedup.
MOCKER_FLEET = ("graphs.agg_router:Frontend", "configs/mocker_agg_router.yaml",
                "--Worker.replicas=2", "--Worker.engine_args.speedup_ratio=50")
# The same fleet with routing in the frontend process (the default deployment).
MOCKER_FLEET_INPROC = ("graphs.agg:Frontend", "configs/mocker_agg_inproc.yaml",
                       "--Worker.replicas=2", "--Worker.engine_args.speedup_ratio=50")

Key = tuple[str, str, tuple[str, ...]]


class GraphPool:
    """Graphs shared by the tests that do not change them, one per (graph, config,
    overrides), started on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.runs: dict[Key, tuple[ServeRun, str]] = {}
        self.started = 0  # names each graph's folder: never reused after a stop

    def get(self, graph: str, config: str, *overrides: str, timeout_s: float = 180
            ) -> tuple[ServeRun, str]:
        key = (graph, config, tuple(overrides))
        if key not in self.runs:
            # A folder of its own: a graph started in a stopped one's folder shares its
            # state dir, and `dynamo route explain --state-dir` could read the old run.
            tmp = self.root / f"graph-{self.started}"
            self.started += 1
            self.runs[key] = start_graph(tmp, graph, config, *overrides, timeout_s=timeout_s)
        run, url = self.runs[key]
        code = run.proc.poll()
        assert code is None, (f"the shared graph {key} exited ({code}): a test that breaks "
                              f"a graph must start its own\n{run.output()[-3000:]}")
        return run, url

    def stop(self, key: Key, timeout_s: float = 40) -> None:
        """Stop one pooled graph now (it must exit cleanly)."""
        run, _ = self.runs.pop(key)
        assert run.stop(timeout_s=timeout_s) == 0, run.output()[-3000:]

    def close(self) -> None:
        """Stop every pooled graph; each must exit cleanly (all are stopped first)."""
        failures = []
        for key in list(self.runs):
            try:
                self.stop(key, timeout_s=90)
            except BaseException as exc:  # noqa: BLE001 - stop the rest, then report
                failures.append(f"{key}: {exc}")
        assert not failures, "\n".join(failures)
