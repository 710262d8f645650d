"""A worker shell's own CPU per streamed token, alone: no engine, no Dynamo runtime.

The aggregated shell's ``stream_chunks`` (components/worker/agg.py: the stop race with
the request's context, the wire chunk, the finish counter, the TTFT/ITL clock) is run in
this process over a fake engine stream that yields one-token deltas as fast as they are
read (each after one event-loop turn, as an engine's stream does), with a request
context like Dynamo's that is never stopped.  Measured: the process's CPU time per token
over ``--tokens`` tokens per request and ``--requests`` requests, ``--rounds`` times,
and the same fake stream read bare, so the shell's own share is the difference.
Deterministic enough to compare two trees on one machine (run it in each).

    python benchmarks/bench_worker_stream.py --tokens 350 --requests 200 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from prometheus_client import CollectorRegistry  # noqa: E402

from splitserve.components.worker.agg import stream_chunks  # noqa: E402
from splitserve.components.worker.latency_metrics import TokenLatency  # noqa: E402
from splitserve.contracts.engine import TokenDelta  # noqa: E402
from splitserve.contracts.kit.worker_metrics import WorkerMetrics  # noqa: E402
from splitserve.contracts.wire import FinishReason  # noqa: E402


class Context:
    """The part of Dynamo's request context a shell reads: a stop that never comes."""

    def __init__(self) -> None:
        self._stopped = asyncio.get_running_loop().create_future()

    def async_killed_or_stopped(self):
        return asyncio.shield(self._stopped)


async def engine(tokens: int):
    for i in range(tokens - 1):
        await asyncio.sleep(0)
        yield TokenDelta((i,))
    await asyncio.sleep(0)
    yield TokenDelta((0,), finished=True, finish_reason=FinishReason.LENGTH,
                     prompt_tokens=16)


async def one_round(tokens: int, requests: int, shell: bool, metrics: WorkerMetrics,
                    latency: TokenLatency) -> float:
    """CPU-µs per token over ``requests`` requests read one after another."""
    t0 = time.process_time()
    for _ in range(requests):
        if shell:
            async for _c in stream_chunks(engine(tokens), metrics, Context(),
                                          clock=latency.clock(first_token=True)):
                pass
        else:
            async for _d in engine(tokens):
                pass
    return (time.process_time() - t0) / (tokens * requests) * 1e6


async def measure(args) -> dict:
    metrics = WorkerMetrics()
    latency = TokenLatency(CollectorRegistry(), "bench", "bench")
    await one_round(args.tokens, 10, True, metrics, latency)  # warm-up
    shell, bare = [], []
    for _ in range(args.rounds):
        shell.append(await one_round(args.tokens, args.requests, True, metrics, latency))
        bare.append(await one_round(args.tokens, args.requests, False, metrics, latency))
    return {"tokens": args.tokens, "requests": args.requests, "rounds": args.rounds,
            "shell_us_per_token": [round(x, 2) for x in shell],
            "bare_us_per_token": [round(x, 2) for x in bare],
            "shell_median": round(statistics.median(shell), 2),
            "bare_median": round(statistics.median(bare), 2),
            "shell_own_median": round(statistics.median(shell) - statistics.median(bare), 2)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=350)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", help="write the result as JSON here")
    args = p.parse_args(argv)
    try:
        import uvloop

        result = uvloop.run(measure(args))
    except ImportError:  # pragma: no cover - uvloop is a dependency
        result = asyncio.run(measure(args))
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
