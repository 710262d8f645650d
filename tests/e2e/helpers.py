"""Helpers the e2e modules share: Prometheus samples, one streamed request, the CLI, a
percentile.  Test modules import from here, never from each other."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import aiohttp
import httpx
import openai

from splitserve.contracts import prometheus
from splitserve.contracts.prometheus import Labels, Samples
from tests.e2e.prompts import MODEL
from tests.integration.serve_helpers import REPO, descendants, http_post_json


def scrape(source: str) -> Samples:
    """Every sample of a Prometheus text exposition, by sample name then labels.

    ``source`` is a ``/metrics`` URL (fetched) or the text itself; the reading is
    ``splitserve.contracts.prometheus.parse`` (names as written: a counter's
    ``foo_total``, a histogram's ``foo_bucket`` with its ``le``, ``foo_sum``, ``foo_count``)."""
    if source.startswith(("http://", "https://")):
        response = httpx.get(source, timeout=10)
        # A failing exporter answers with a plain-text page the parser would misread.
        assert response.status_code == 200, (source, response.status_code, response.text[:300])
        source = response.text
    return prometheus.parse(source)


def metric(source: str, name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels`` (0 if none)."""
    return prometheus.value(scrape(source), name, **labels)


def by_label(source: str, name: str, label: str) -> dict[str, float]:
    """The samples named ``name`` summed by the value of one of their labels."""
    return prometheus.by_label(scrape(source), name, label)


def fleet(run, component: str, name: str) -> dict[Labels, float]:
    """The samples named ``name`` summed by labels over every replica of ``component``
    that serves metrics."""
    out: dict[Labels, float] = {}
    for rep in run.replicas(component):
        if rep["metrics"]:
            for key, value in scrape(rep["metrics"]).get(name, {}).items():
                out[key] = out.get(key, 0.0) + value
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


def build_client_models(*roots: type) -> None:
    """Build the openai client's response models (and the models nested in them) in the
    calling thread.  pydantic builds a model's schema on first use; the client reads
    each nested model's schema while parsing a chunk, and threads streaming at once for
    the first time can race on that build (``PydanticUserError: ... BaseModel cannot be
    instantiated directly``, seen once in a chaos test's threads)."""
    import typing

    import pydantic

    seen: set[type] = set()
    todo = list(roots)
    while todo:
        cls = todo.pop()
        if cls in seen or not (isinstance(cls, type) and issubclass(cls, pydantic.BaseModel)):
            continue
        seen.add(cls)
        cls.model_rebuild()
        _ = cls.__pydantic_core_schema__
        for field in cls.model_fields.values():
            stack = [field.annotation]
            while stack:
                t = stack.pop()
                stack.extend(typing.get_args(t))
                if isinstance(t, type):
                    todo.append(t)


build_client_models(openai.types.chat.ChatCompletionChunk, openai.types.chat.ChatCompletion)


def story(url: str, subject: str, max_tokens: int) -> tuple[str | None, str, int, float]:
    """A greedy streamed story about ``subject``: (finish reason, text, completion tokens,
    longest pause between chunks in s)."""
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                       timeout=180) as c:
        parts: list[str] = []
        last, gap, finish, tokens = time.monotonic(), 0.0, None, 0
        for ch in c.chat.completions.create(
                model=MODEL, temperature=0, max_tokens=max_tokens, stream=True,
                stream_options={"include_usage": True},
                messages=[{"role": "user", "content": f"Write a story about a {subject}."}]):
            now = time.monotonic()
            gap, last = max(gap, now - last), now
            if ch.choices and ch.choices[0].delta.content:
                parts.append(ch.choices[0].delta.content)
            if ch.choices and ch.choices[0].finish_reason:
                finish = ch.choices[0].finish_reason
            if ch.usage:
                tokens = ch.usage.completion_tokens
    return finish, "".join(parts), tokens, gap


def scale(run, component: str, n: int) -> None:
    """Set ``component``'s replicas through the run's control API."""
    code, body = http_post_json(run.control() + f"/v1/components/{component}/replicas",
                                {"replicas": n}, token=run.token())
    assert code == 200, body


def kill_replica(run, rep: dict) -> None:
    """SIGKILL a replica and its engine processes (children first)."""
    for pid in [*descendants(rep["pid"]), rep["pid"]]:
        run.seen_pids.add(pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def ready(run, component: str) -> list[dict]:
    """``component``'s replicas that are ready now."""
    return [r for r in run.replicas(component) if r["state"] == "ready"]
