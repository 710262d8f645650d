"""Run `dynamo serve` as a real subprocess in tests and clean up every process by pid:
the one runner the benchmarks use too (``splitserve.bench.graphrun``)."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

from splitserve.bench.graphrun import ServeProcess, descendants, dynamo_cmd

__all__ = ["REPO", "ServeRun", "descendants", "dynamo_cmd", "http_get_json", "http_post_json",
           "wait_until"]

REPO = Path(__file__).resolve().parents[2]
"""The repository root: the tests' relative config paths (``configs/agg.yaml``) point
from it, whatever directory pytest was started in."""


class ServeRun(ServeProcess):
    """A ``dynamo serve`` subprocess started in the repository root.  Its output (the
    supervisor's and every replica's, prefixed) goes to ``log_path`` under the test's
    folder, never to the terminal; a failed test's report ends with its tail
    (``tests/conftest.py``)."""

    started: list[ServeRun] = []  # every run this test process started, in order

    def __init__(self, tmp: Path, graph: str, *args: str, env: dict | None = None,
                 cwd: Path | None = REPO) -> None:
        super().__init__(tmp, graph, *_test_args(graph, args), env=env, cwd=cwd)
        ServeRun.started.append(self)


PRELOAD_OFF = "--Frontend.preload_parsers=false"


def _test_args(graph: str, args: tuple[str, ...]) -> tuple[str, ...]:
    """``args``, and this project's frontends started without importing vLLM's tool-call
    parsers before ready (seconds of CPU per start, tens of seconds per end-to-end test
    on 2 cores).  A test that sends tools has them imported by its first such request,
    as every frontend did before the preload; a test that names ``preload_parsers``
    keeps what it names (tests/e2e/test_real_clients.py keeps the default)."""
    ours = graph.startswith(("graphs.", "splitserve.graphs.")) and graph.endswith(":Frontend")
    if ours and not any("preload_parsers" in a for a in args):
        return (*args, PRELOAD_OFF)
    return args


def http_get_json(url: str, timeout_s: float = 10, token: str | None = None
                  ) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def http_post_json(url: str, body: dict, timeout_s: float = 10, token: str | None = None
                   ) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers,
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def wait_until(pred, timeout_s: float, interval_s: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
