"""Live KV moves on the aggregated torch graph (real model on CPU, NIXL between replicas).

Two workers with ``kv_moves``; four greedy streams are answered once undisturbed, then
again while one worker is scaled away with a drain shorter than the streams.  At its
drain deadline that worker parks its streams' KV; the frontend continues them on the
other worker, which reads the KV over NIXL instead of recomputing the prompt and the
tokens so far.  Every client gets its whole answer, equal to the undisturbed one (no
token lost or repeated); the remaining worker counts its moves (none recomputed) and
the longest pause a client saw (the time to resume) is printed.
"""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest

from tests.graphs import start_graph
from tests.e2e.helpers import metric, ready, scale, story
from tests.integration.serve_helpers import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.deep, pytest.mark.timeout(400), pytest.mark.slow]

SUBJECTS = ("lighthouse keeper", "baker", "pilot", "gardener")
MAX_TOKENS = 120


def test_a_scaled_down_workers_streams_continue_from_their_moved_kv(tmp_path):
    run, url = start_graph(tmp_path, "graphs.agg:Frontend", "configs/agg.yaml",
                           "--Worker.replicas=2", "--Worker.kv_moves=true",
                           "--Worker.drain_timeout_s=1")
    try:
        with cf.ThreadPoolExecutor(len(SUBJECTS)) as pool:
            expected = list(pool.map(lambda s: story(url, s, MAX_TOKENS), SUBJECTS))
        assert all(r[2] == MAX_TOKENS for r in expected), expected
        with cf.ThreadPoolExecutor(len(SUBJECTS)) as pool:
            futs = [pool.submit(story, url, s, MAX_TOKENS) for s in SUBJECTS]
            time.sleep(3.0)  # every stream has its first tokens
            scale(run, "Worker", 1)
            results = [f.result(timeout=300) for f in futs]
        assert [(r[0], r[2]) for r in results] == [("length", MAX_TOKENS)] * len(SUBJECTS), \
            results
        assert [r[1] for r in results] == [r[1] for r in expected]
        wait_until(lambda: len(run.replicas("Worker")) == 1, 60, interval_s=0.5,
                   what="the scaled-down worker gone")
        (left,) = ready(run, "Worker")
        moved = metric(left["metrics"], "splitserve_worker_kv_moves_total", outcome="moved")
        recomputed = metric(left["metrics"], "splitserve_worker_kv_moves_total",
                            outcome="recomputed")
        handed = metric(f"{url}/metrics", "splitserve_frontend_migrations_total",
                        reason="worker-drained")
        print(f"\nstreams handed back by the drain: {handed:.0f}, continued from moved KV: "
              f"{moved:.0f}, recomputed: {recomputed:.0f}; longest pause a client saw "
              f"(time to resume): {max(r[3] for r in results):.2f} s "
              f"(undisturbed: {max(r[3] for r in expected):.2f} s)")
        assert handed >= 1 and moved == handed and recomputed == 0
        assert run.stop() == 0, run.output()[-3000:]
    finally:
        run.kill_all()
