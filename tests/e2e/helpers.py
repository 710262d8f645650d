"""Helpers the e2e modules share: metrics lines, one streamed request, the CLI, a
percentile.  Test modules import from here, never from each other."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import aiohttp
import httpx

from tests.e2e.prompts import MODEL
from tests.integration.serve_helpers import REPO


def metric_lines(metrics_url: str, name: str) -> dict[str, float]:
    """Samples of the metric lines starting with ``name`` at ``metrics_url``."""
    out = {}
    for line in httpx.get(metrics_url).text.splitlines():
        if line.startswith(name):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def dynamo(run, *args: str) -> subprocess.CompletedProcess:
    """`dynamo ARGS --state-dir` against the run's graph (not this process's servers)."""
    env = {k: v for k, v in os.environ.items() if k not in ("ETCD_ENDPOINTS", "NATS_SERVER")}
    return subprocess.run([sys.executable, "-m", "splitserve.cli.main", *args, "--state-dir",
                           str(run.state)], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env=env)


async def one(session: aiohttp.ClientSession, url: str, i: int, max_tokens: int = 48,
              headers: dict[str, str] | None = None) -> dict:
    """One streamed chat request: status, time to first content, total time."""
    body = {"model": MODEL, "max_tokens": max_tokens, "stream": True,
            "messages": [{"role": "user", "content": f"Request {i}: tell me about ships. " * 6}]}
    t0 = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body,
                                headers=headers) as r:
            if r.status != 200:
                payload = await r.json()
                return {"status": r.status, "t": time.perf_counter() - t0,
                        "retry_after": r.headers.get("Retry-After"),
                        "code": payload["error"]["code"]}
            ttft = None
            async for raw in r.content:
                if raw.startswith(b"data:") and ttft is None and b'"content"' in raw:
                    ttft = time.perf_counter() - t0
            return {"status": 200, "ttft": ttft, "t": time.perf_counter() - t0, "i": i}
    except Exception as exc:  # noqa: BLE001 - a lost or hung request is what we look for
        return {"status": None, "error": repr(exc), "t": time.perf_counter() - t0}


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]
