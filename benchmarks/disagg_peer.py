"""The disaggregated cases of ``heldout.py``: this project's disaggregated graph against
Dynamo's own disaggregation, on the same fleet of simulated engines.

- ``splitserve-disagg``: ``graphs.disagg_inproc:Frontend`` with
  ``configs/mocker_disagg_inproc.yaml``'s offload policy, N decode and M prefill replicas
  (no admission), the case's TPOT target as the offload policy's ``protect_tpot_ms``
  (``slo_sets``: as the aggregated default is given the case's SLO);
- ``splitserve-disagg-remote``: the same graph with every prefill forced remote, so
  each decode replica uses one engine as Dynamo's decode workers do (a decode replica of
  this graph fronts two simulated engines: a decode-mode mocker for remotely prefilled
  requests and an aggregated one for local prefills, because a decode-mode mocker does
  not simulate prefill compute: an ~7,000-token prompt sent to it without a prefill
  result answers in ~28 ms against ~180 ms on an aggregated mocker); the local engine
  then serves only fallbacks;
- ``dynamo-disagg``: Dynamo's frontend (``--router-mode kv``) over N
  ``dynamo.mocker --disaggregation-mode decode`` and M ``--disaggregation-mode prefill``
  workers (its frontend finds the prefill workers by their model type and routes each
  request's prefill there first).

Both fleets are Dynamo's mocker with the same geometry, speedup and KV transfer bandwidth
on the prefill side.  After a run, ``stages`` reads this project's workers' own metrics
(offload decisions, fallbacks, prefill-queue wait, compute, transfer, remote wait) so a
tail can be split into where it went.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from compare import Proc, WorkersRun, dynamo_env, dynamo_frontend

from splitserve.bench.graphrun import GraphRun, descendants, scrape

OURS_DISAGG = "splitserve-disagg"
OURS_REMOTE = "splitserve-disagg-remote"
DYNAMO_DISAGG = "dynamo-disagg"
DISAGG = [OURS_DISAGG, OURS_REMOTE, DYNAMO_DISAGG]
FORCED_REMOTE = "--DecodeWorker.disaggregated_router={enable: true, decider: forced, remote: true}"
KV_BANDWIDTH_GBS = 10.0


def slo_sets(slo: dict[str, float]) -> list[str]:
    """The case's SLO as this graph is told it: its TPOT target guards the answers a
    local prefill would stall (docs/policies.md, ``protect_tpot_ms``)."""
    return [f"--DecodeWorker.disaggregated_router.protect_tpot_ms={slo['tpot_ms']:g}"]


@contextlib.contextmanager
def ours(decode: int, prefill: int, geometry: dict[str, str], startup_timeout_s: float,
         extra: list[str] | tuple[str, ...] = ()):
    """This project's disaggregated graph; yields the GraphRun."""
    sets = [f"--DecodeWorker.replicas={decode}", f"--PrefillWorker.replicas={prefill}",
            f"--Frontend.router.block_size={geometry['block_size']}",
            f"--PrefillWorker.engine_args.kv_transfer_bandwidth={KV_BANDWIDTH_GBS}"]
    for role in ("DecodeWorker", "PrefillWorker"):
        sets += [f"--{role}.engine_args.{k}={v}" for k, v in geometry.items()]
    with GraphRun("graphs.disagg_inproc:Frontend", "configs/mocker_disagg_inproc.yaml",
                  [*sets, *extra], startup_timeout_s=startup_timeout_s) as g:
        yield g


def _prefill_argv(workers: WorkersRun) -> list[str]:
    """``python -m dynamo.mocker`` for one prefill worker: a decode worker's own command
    line (read from /proc: the same model directory, geometry and planes) in prefill
    mode, under its own component, with the KV transfer bandwidth."""
    argv: list[str] = []
    for r in workers.replicas("Worker"):
        for pid in descendants(r["pid"]):
            with contextlib.suppress(OSError):
                line = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
                if "dynamo.mocker" in line:
                    argv = line
    if not argv:
        raise RuntimeError("no decode mocker found to copy the prefill workers' flags from")
    swap = {"--disaggregation-mode": "prefill",
            "--endpoint": argv[argv.index("--endpoint") + 1].replace(".worker.", ".prefill.")}
    out = [swap.get(argv[i - 1], a) if i else a for i, a in enumerate(argv)]
    return [*out, "--kv-transfer-bandwidth", str(KV_BANDWIDTH_GBS)]


@contextlib.contextmanager
def dynamo(decode: int, prefill: int, geometry: dict[str, str], startup_timeout_s: float,
           log_name: str = "frontend-disagg.log"):
    """Dynamo's disaggregation: yields (frontend Proc, URL)."""
    sets = [f"--Worker.replicas={decode}", "--Worker.engine_args.disaggregation_mode=decode",
            *(f"--Worker.engine_args.{k}={v}" for k, v in geometry.items())]
    with WorkersRun("graphs.agg_router:Worker", "configs/mocker_agg_router.yaml", sets,
                    startup_timeout_s=startup_timeout_s) as w:
        argv = _prefill_argv(w)
        procs = [Proc(argv, dynamo_env(w), w.tmp / f"prefill-{i}.log")
                 for i in range(prefill)]
        fe = None
        try:
            fe, url = dynamo_frontend(w, "kv", (), log_name)
            yield fe, url, procs
        finally:
            for p in [*procs, *([fe] if fe else [])]:
                p.stop()


def prefill_alive(procs: list[Proc]) -> None:
    for p in procs:
        if not p.alive():
            raise RuntimeError(f"a prefill mocker exited:\n{p.tail()}")


STAGES = {
    "splitserve_pool_prefill_queue_wait_seconds": "queue_wait",
    "splitserve_pool_prefill_compute_seconds": "compute",
    "splitserve_pool_kv_transfer_seconds": "transfer",
    "splitserve_disagg_remote_prefill_seconds": "remote_wait",
    "splitserve_pool_ttft_seconds": "worker_ttft",
}


def stages(g: GraphRun) -> dict:
    """Our workers' own view of where the time went: per stage the count and mean
    (seconds, summed over replicas), the offload decisions and fallbacks by reason."""
    sums: dict[str, list[float]] = {}
    counters: dict[str, float] = {}
    for row in g.status()["replicas"]:
        if not row.get("metrics"):
            continue
        with contextlib.suppress(OSError):
            fams = scrape(row["metrics"])
            for fam, label in STAGES.items():
                for part, i in (("_sum", 0), ("_count", 1)):
                    for labels, v in fams.get(fam + part, {}).items():
                        pool = dict(labels).get("pool", row["component"])
                        key = f"{label}@{pool}"
                        sums.setdefault(key, [0.0, 0.0])[i] += v
            for fam, keys in (("splitserve_disagg_decisions_total", ("where", "reason")),
                              ("splitserve_disagg_fallbacks_total", ("reason",)),
                              ("splitserve_disagg_prefill_affinity_total", ("reason",)),
                              ("splitserve_prefill_jobs_taken_total", ("queue",)),
                              ("splitserve_prefill_prompt_tokens_total", ("kind",))):
                for labels, v in fams.get(fam, {}).items():
                    d = dict(labels)
                    k = fam.split("_")[2] + ":" + "/".join(d.get(x, "") for x in keys)
                    counters[k] = counters.get(k, 0.0) + v
    means = {k: {"count": int(c), "mean_ms": round(1000 * s / c, 1) if c else None}
             for k, (s, c) in sorted(sums.items())}
    return {"stages": means, "counters": counters}


if __name__ == "__main__":  # pragma: no cover - run through heldout.py
    sys.exit("run: python benchmarks/heldout.py --cases disagg-below")
