"""No client sees a worker leave on the disaggregated torch graph (real model on CPU).

Two decode workers and one prefill worker, every prompt prefilled remotely.  Four greedy
streams are answered once undisturbed, then again while the graph is hit, one fault
after the other: the decode worker serving streams SIGKILLed (the frontend resumes its
streams on the other decode worker with the prompt plus the tokens already sent, and that
worker has the prefill worker prefill them), the prefill worker SIGKILLed (its job is
redelivered or prefilled locally after the short remote-prefill timeout), a decode
worker scaled away with a drain shorter than the streams (with live KV moves on, it
parks what is left and hands it back: the frontend resumes it on the other decode
worker, which reads the parked KV over NIXL) and scaled back, and NATS SIGKILLed (the
supervisor restarts it).  Every client gets its whole answer, equal to the undisturbed
one (no token lost or repeated), with a normal finish; the longest pause a client saw
between two chunks (the time to resume) is printed.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.graphs import start_graph
from tests.e2e.helpers import kill_replica, metric, ready, scale, story
from tests.e2e.prompts import FORCED
from tests.integration.serve_helpers import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.deep, pytest.mark.timeout(600), pytest.mark.slow]

SUBJECTS = ("lighthouse keeper", "baker", "pilot", "gardener")
MAX_TOKENS = 160  # the streams outlast the faults (a decode worker's restart included)
stream = functools.partial(story, max_tokens=MAX_TOKENS)


def test_chaos_on_the_disaggregated_torch_graph_loses_no_stream(tmp_path):
    run, url = start_graph(tmp_path, "graphs.disagg:Frontend", "configs/disagg.yaml", FORCED,
                           "--DecodeWorker.replicas=2", "--DecodeWorker.drain_timeout_s=2",
                           "--DecodeWorker.kv_moves=true",
                           "--DecodeWorker.remote_prefill_timeout_s=5",
                           "--DecodeWorker.prefill_queue.ack_wait_s=2",
                           "--PrefillWorker.prefill_queue.ack_wait_s=2",
                           "--Router.policy=round_robin",
                           "--Common.restart.backoff_initial_s=0.1",
                           "--Common.infra.restart_delay_s=0.5", timeout_s=300)
    try:
        infra = json.loads((Path(run.info()["run_dir"]) / "infra" / "infra.json").read_text())
        run.seen_pids |= set(infra["pids"].values())
        with cf.ThreadPoolExecutor(len(SUBJECTS)) as pool:
            # undisturbed, batched the same way (the engine's greedy outputs do not
            # depend on the batch: tests/e2e/test_agg_torch.py)
            expected = [r[1] for r in pool.map(lambda s: stream(url, s), SUBJECTS)]
        assert all(len(t) > 100 for t in expected), expected
        with cf.ThreadPoolExecutor(len(SUBJECTS)) as pool:
            futs = [pool.submit(stream, url, s) for s in SUBJECTS]
            time.sleep(3.0)  # every stream has its first tokens
            busy = next(r for r in ready(run, "DecodeWorker") if r["metrics"] and metric(
                r["metrics"], "splitserve_worker_running_requests") >= 1)
            kill_replica(run, busy)
            time.sleep(2.0)
            kill_replica(run, ready(run, "PrefillWorker")[0])
            # the killed decode worker is back: the scale-down now removes a ready one,
            # the newest, which serves every stream (its drain hands them back)
            wait_until(lambda: len(ready(run, "DecodeWorker")) == 2, 90, interval_s=0.2,
                       what="the killed decode worker ready again")
            scale(run, "DecodeWorker", 1)
            time.sleep(5.0)  # its 2 s drain, then the hand-back
            scale(run, "DecodeWorker", 2)
            time.sleep(1.0)
            os.kill(infra["pids"]["nats"], signal.SIGKILL)
            results = [f.result(timeout=300) for f in futs]
        assert [(r[0], r[2]) for r in results] == [("length", MAX_TOKENS)] * len(SUBJECTS), \
            results
        assert [r[1] for r in results] == expected
        def moved(reason: str) -> float:
            return metric(f"{url}/metrics", "splitserve_frontend_migrations_total",
                          reason=reason)

        resumed, handed = moved("worker-failed-mid-stream"), moved("worker-drained")
        kv_moved = sum(metric(r["metrics"], "splitserve_worker_kv_moves_total",
                              outcome="moved") for r in ready(run, "DecodeWorker"))
        print(f"\nlongest pause a client saw (time to resume): "
              f"{max(r[3] for r in results):.2f} s; streams resumed after a kill: "
              f"{resumed:.0f}, handed back by a drain: {handed:.0f}, of them continued "
              f"from KV moved over NIXL: {kv_moved:.0f}")
        assert resumed >= 1 and handed >= 1 and kv_moved >= 1
        wait_until(lambda: len(ready(run, "DecodeWorker")) == 2
                   and len(ready(run, "PrefillWorker")) == 1, 180, interval_s=0.5,
                   what="two decode workers and the prefill worker ready again")
        assert run.stop() == 0, run.output()[-3000:]
    finally:
        run.kill_all()
