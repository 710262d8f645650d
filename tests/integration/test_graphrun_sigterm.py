"""A benchmark stopped with SIGTERM stops the graph it started (``splitserve.bench.graphrun``):
every replica and the supervisor are gone, not left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from splitserve.contracts.kit.procs import pid_alive

pytestmark = [pytest.mark.integration, pytest.mark.quiet]

SCRIPT = textwrap.dedent("""
    import sys, time
    from splitserve.bench.graphrun import GraphRun

    class Run(GraphRun):
        serves_http = False

    with Run("tests.fixtures.echo_graph:EchoFront", sys.argv[1], startup_timeout_s=90) as g:
        print("PIDS", g.serve.proc.pid, *sorted(g.seen_pids), flush=True)
        time.sleep(300)
""")


def test_sigterm_stops_the_graph(tmp_path):
    cfg = tmp_path / "echo.yaml"
    cfg.write_text("EchoWorker:\n  replicas: 2\n")
    bench = subprocess.Popen([sys.executable, "-c", SCRIPT, str(cfg)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, cwd=os.getcwd())
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        for line in bench.stdout:
            if line.startswith("PIDS"):
                pids = [int(p) for p in line.split()[1:]]
                break
            assert time.monotonic() < deadline, "the graph did not start"
        assert len(pids) >= 3, pids  # the supervisor and its replicas at least
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=90) == 128 + signal.SIGTERM
        left = [p for p in pids if pid_alive(p)]
        assert left == [], f"still running after the benchmark's SIGTERM: {left}"
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        bench.stdout.close()
        for p in pids:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)
