"""Where the suite's CPU goes: the CPU time of each test's whole process tree.

On two cores the suite is bound by CPU-seconds more than by any one test's duration, and
``--durations`` shows neither what a test costs its neighbours nor what a graph's
processes burn.  Opt in with ``-p tests.cpu_profile --cpu-profile DIR``: each test process
(each xdist worker) appends one JSON line per test to ``DIR/<worker>.jsonl`` with the test's
id, its start and end (wall clock) and the CPU-seconds that the test process and all its
descendants used meanwhile (setup and teardown included; processes that exited are
counted through their parent's children times).  Then::

    python -m tests.cpu_profile DIR          # modules by CPU, with wall time and worker
    python -m tests.cpu_profile DIR --timeline
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

_out = None


def tree_cpu(proc: psutil.Process) -> float:
    """CPU-seconds of a process and every descendant, living or reaped."""
    total = 0.0
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        procs = [proc]
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-profile", metavar="DIR", default=None,
                     help="append each test's process-tree CPU time to DIR/<worker>.jsonl")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None
                            ) -> Iterator[None]:
    global _out
    folder = item.config.getoption("--cpu-profile")
    if not folder:
        yield
        return
    if _out is None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        _out = open(Path(folder) / f"{worker}.jsonl", "a")  # noqa: SIM115 - all session
    me = psutil.Process()
    cpu0, t0 = tree_cpu(me), time.time()
    yield
    cpu1, t1 = tree_cpu(me), time.time()
    _out.write(json.dumps({"id": item.nodeid, "cpu": round(cpu1 - cpu0, 3),
                           "t0": t0, "t1": t1}) + "\n")
    _out.flush()


def _segments(folder: Path) -> list[dict]:
    """Consecutive tests of one module on one worker, merged."""
    segs: list[dict] = []
    for path in sorted(folder.glob("*.jsonl")):
        last = None
        for line in path.read_text().splitlines():
            row = json.loads(line)
            module = row["id"].split("::", 1)[0]
            if last is not None and last["module"] == module:
                last["t1"], last["cpu"] = row["t1"], last["cpu"] + row["cpu"]
            else:
                last = {"worker": path.stem, "module": module, "t0": row["t0"],
                        "t1": row["t1"], "cpu": row["cpu"]}
                segs.append(last)
    return segs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.cpu_profile")
    ap.add_argument("folder", type=Path)
    ap.add_argument("--timeline", action="store_true",
                    help="each worker's modules in the order they ran")
    ap.add_argument("--min-s", type=float, default=4.0,
                    help="hide modules under this many seconds and CPU-seconds")
    args = ap.parse_args(argv)
    segs = _segments(args.folder)
    if not segs:
        print(f"no profile in {args.folder}", file=sys.stderr)
        return 1
    start = min(s["t0"] for s in segs)
    end = max(s["t1"] for s in segs)
    total = sum(s["cpu"] for s in segs)
    print(f"{total / 60:.1f} CPU-min over {(end - start) / 60:.1f} min "
          f"({total / (end - start):.2f} cores busy on average)")
    shown = [s for s in segs if s["t1"] - s["t0"] >= args.min_s or s["cpu"] >= args.min_s]
    if args.timeline:
        for s in sorted(shown, key=lambda s: (s["worker"], s["t0"])):
            print(f"{s['worker']:>5} {s['t0'] - start:6.0f}-{s['t1'] - start:6.0f} s "
                  f"cpu {s['cpu']:6.1f}  {s['module']}")
    else:
        for s in sorted(shown, key=lambda s: -s["cpu"]):
            print(f"cpu {s['cpu']:6.1f}  wall {s['t1'] - s['t0']:6.1f}  {s['worker']:>5}  "
                  f"{s['module']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
