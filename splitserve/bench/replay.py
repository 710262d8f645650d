"""Replay a request trace against an OpenAI-compatible frontend, open loop, and measure it.

Traces:

- Mooncake JSONL (``{"timestamp": ms, "input_length", "output_length", "hash_ids"}``): one
  hash id per 512-token block of the prompt; equal ids are equal blocks (shared prefixes).
- Azure LLM inference CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``): prompts of the
  given lengths, no shared prefixes.

Prompts are built as **token ids** (sent as ``"prompt": [ids...]`` to ``/v1/completions``,
so no re-tokenisation changes the block structure).  Each trace block's tokens come from
a RNG seeded with ``(seed, hash id)`` over the tokenizer's vocabulary minus its special
tokens, so equal hash ids give equal token blocks and different ids different blocks.

Token scaling (the served model's context is far shorter than the trace's prompts): all
prompt lengths and the trace block size are divided by ``--token-scale`` (512-token
blocks become ``512 / scale``-token blocks, so the prefix structure is kept), output
lengths by ``--output-scale``, and every request is clipped to the context
(``prompt + max_tokens <= context``: the output is clipped to ``--max-output`` first,
then the prompt is cut at ``context - max_tokens``).  Results are for the scaled trace.

Time: a window of the trace is selected (``--start-s``, ``--duration-s``,
``--max-requests``), rebased to 0, and its arrival times are multiplied by
``--time-scale`` and divided by ``--rate-scale``.  Each request is sent at its (scaled)
timestamp whatever happens to earlier ones (open loop), as a streaming request.

Per request: TTFT (request sent -> first streamed chunk), TPOT (mean time per output
token after the first: (last token - first token) / (completion tokens - 1)), end-to-end
latency, outcome (``ok``, ``rejected`` = HTTP 503, ``error``).  Summary: p50/p90/p99,
request and token throughput over the makespan (first send -> last request done), and
goodput under SLOs (``--slo ttft=ms,tpot=ms``): requests per second that finished ok and
met both limits.  A request with one output token has no TPOT and meets the TPOT limit.

    dynamo bench run --url http://127.0.0.1:8000 \\
        --trace ../shared/traces/mooncake_fast25_conversation_trace.jsonl \\
        --duration-s 60 --token-scale 16 --output-scale 4 --slo ttft=1000,tpot=50 \\
        --out replay.json
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

DEFAULT_TRACE = "../shared/traces/mooncake_fast25_conversation_trace.jsonl"
TRACE_BLOCK_TOKENS = 512  # Mooncake: one hash id per 512 prompt tokens
# SmolLM2-135M-Instruct (the model every graph of this project serves)
DEFAULT_VOCAB_SIZE = 49152
DEFAULT_FIRST_REGULAR_ID = 17  # ids 0..16 are the tokenizer's added special tokens
DEFAULT_CONTEXT = 8192


# ---- traces ----------------------------------------------------------------------------
@dataclass
class TraceRequest:
    """One row of a trace: arrival time (s from the trace's start) and lengths in tokens."""

    t_s: float
    input_length: int
    output_length: int
    hash_ids: list[int] | None = None  # None: no prefix information (unique prompt)


def load_mooncake(path: str | Path) -> list[TraceRequest]:
    """Mooncake JSONL; timestamps (ms) become seconds from the first row."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                d = json.loads(line)
                rows.append(TraceRequest(float(d["timestamp"]) / 1e3, int(d["input_length"]),
                                         int(d["output_length"]),
                                         [int(h) for h in d["hash_ids"]]
                                         if d.get("hash_ids") is not None else None))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not a Mooncake trace row: {exc}") from None
    return _rebase(rows)


def _parse_azure_time(s: str) -> float:
    s = s.strip()
    date, _, frac = s.partition(".")
    base = datetime.strptime(date, "%Y-%m-%d %H:%M:%S").timestamp()
    return base + (float("0." + frac) if frac else 0.0)


def load_azure_csv(path: str | Path) -> list[TraceRequest]:
    """Azure LLM inference CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``)."""
    rows = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: missing columns {sorted(missing)}")
        for n, d in enumerate(reader, 2):
            try:
                rows.append(TraceRequest(_parse_azure_time(d["TIMESTAMP"]),
                                         int(d["ContextTokens"]), int(d["GeneratedTokens"])))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not an Azure trace row: {exc}") from None
    return _rebase(rows)


def _rebase(rows: list[TraceRequest]) -> list[TraceRequest]:
    rows.sort(key=lambda r: r.t_s)  # stable: rows with equal timestamps keep file order
    t0 = rows[0].t_s if rows else 0.0
    for r in rows:
        r.t_s -= t0
    return rows


def load_trace(path: str | Path, fmt: str = "auto") -> list[TraceRequest]:
    """``fmt``: ``mooncake``, ``azure`` or ``auto`` (by extension: .csv is Azure)."""
    if fmt == "auto":
        fmt = "azure" if str(path).lower().endswith(".csv") else "mooncake"
    if fmt == "mooncake":
        return load_mooncake(path)
    if fmt == "azure":
        return load_azure_csv(path)
    raise ValueError(f"unknown trace format {fmt!r}")


def select_window(rows: list[TraceRequest], start_s: float = 0.0,
                  duration_s: float | None = None,
                  max_requests: int | None = None) -> list[TraceRequest]:
    """Rows with ``start_s <= t < start_s + duration_s`` (first ``max_requests`` of them),
    as new rows rebased so the window starts at 0."""
    end = math.inf if duration_s is None else start_s + duration_s
    out = [TraceRequest(r.t_s - start_s, r.input_length, r.output_length,
                        None if r.hash_ids is None else list(r.hash_ids))
           for r in rows if start_s <= r.t_s < end]
    return out if max_requests is None else out[:max_requests]


def scale_times(rows: list[TraceRequest], time_scale: float = 1.0,
                rate_scale: float = 1.0) -> list[TraceRequest]:
    """New rows with arrival times x ``time_scale`` / ``rate_scale`` (rate_scale 2 = twice
    the request rate; time_scale 0.5 likewise)."""
    if time_scale <= 0 or rate_scale <= 0:
        raise ValueError("time_scale and rate_scale must be > 0")
    k = time_scale / rate_scale
    return [TraceRequest(r.t_s * k, r.input_length, r.output_length, r.hash_ids) for r in rows]


# ---- prompts ---------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenScaling:
    """How trace lengths map to served lengths (see the module docstring)."""

    token_scale: int = 16          # prompt lengths and the trace block size are divided by it
    output_scale: float = 1.0      # output lengths are divided by it
    context: int = DEFAULT_CONTEXT
    max_output: int | None = None  # clip outputs to this (after scaling)
    trace_block: int = TRACE_BLOCK_TOKENS

    def __post_init__(self) -> None:
        if self.token_scale < 1 or self.trace_block % self.token_scale:
            raise ValueError(f"token_scale must divide the trace block size {self.trace_block}"
                             f", got {self.token_scale}")
        if self.output_scale <= 0:
            raise ValueError("output_scale must be > 0")
        if self.context < 2:
            raise ValueError("context must be >= 2")

    @property
    def block_tokens(self) -> int:
        return self.trace_block // self.token_scale

    def lengths(self, input_length: int, output_length: int) -> tuple[int, int, bool]:
        """(prompt tokens, max_tokens, clipped) for one trace row."""
        want_out = max(1, math.ceil(output_length / self.output_scale))
        limit = self.context - 1 if self.max_output is None else min(self.max_output,
                                                                    self.context - 1)
        out = min(want_out, limit)
        want_prompt = max(1, math.ceil(input_length / self.token_scale))
        prompt = min(want_prompt, self.context - out)
        return prompt, out, (prompt, out) != (want_prompt, want_out)


class BlockTokens:
    """Deterministic token ids of a trace block from its hash id (cached)."""

    def __init__(self, block_tokens: int, seed: int = 0, vocab_size: int = DEFAULT_VOCAB_SIZE,
                 first_regular_id: int = DEFAULT_FIRST_REGULAR_ID) -> None:
        if not 0 <= first_regular_id < vocab_size:
            raise ValueError("need 0 <= first_regular_id < vocab_size")
        self.n, self.seed = block_tokens, seed
        self.lo, self.hi = first_regular_id, vocab_size - 1
        self._cache: dict[Any, list[int]] = {}

    def block(self, key: Any) -> list[int]:
        """Tokens of the block named ``key`` (a hash id, or any value with a stable repr)."""
        ids = self._cache.get(key)
        if ids is None:
            rng = random.Random(f"{self.seed}/{key!r}")  # str seeds hash deterministically
            ids = [rng.randint(self.lo, self.hi) for _ in range(self.n)]
            self._cache[key] = ids
        return ids

    def prompt(self, keys: list[Any], length: int) -> list[int]:
        """The concatenated blocks of ``keys``, cut to ``length`` tokens."""
        out: list[int] = []
        for k in keys:
            if len(out) >= length:
                break
            out.extend(self.block(k))
        if len(out) < length:
            raise ValueError(f"{len(keys)} blocks of {self.n} tokens cannot make {length}")
        return out[:length]


@dataclass
class PreparedRequest:
    index: int
    t_s: float
    prompt: list[int]
    max_tokens: int
    trace_input_length: int
    trace_output_length: int
    clipped: bool


def build_requests(rows: list[TraceRequest], scaling: TokenScaling, blocks: BlockTokens
                   ) -> list[PreparedRequest]:
    """Scaled prompts (token ids) and max_tokens for the rows.  Rows without hash ids get
    blocks of their own (keys ``("r", row index, block)``): no prefix is shared."""
    out = []
    for i, r in enumerate(rows):
        plen, mtok, clipped = scaling.lengths(r.input_length, r.output_length)
        n_blocks = math.ceil(plen / scaling.block_tokens)
        keys: list[Any] = (list(r.hash_ids) if r.hash_ids is not None
                           else [("r", i, b) for b in range(n_blocks)])
        if len(keys) < n_blocks:  # a malformed row: fewer ids than its length needs
            keys += [("r", i, b) for b in range(len(keys), n_blocks)]
        out.append(PreparedRequest(i, r.t_s, blocks.prompt(keys, plen), mtok, r.input_length,
                                   r.output_length, clipped))
    return out


def prefix_reuse(rows: list[TraceRequest]) -> float:
    """Fraction of trace blocks already seen earlier in ``rows`` (infinite cache)."""
    seen: set[int] = set()
    total = repeats = 0
    for r in rows:
        for h in r.hash_ids or ():
            total += 1
            repeats += h in seen
            seen.add(h)
    return repeats / total if total else 0.0


# ---- statistics ------------------------------------------------------------------------
def percentile(xs: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); q in [0, 100]."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def dist(xs: list[float]) -> dict[str, float | None]:
    """n, mean, p50/p90/p99 (same units as ``xs``)."""
    return {"n": len(xs), "mean": sum(xs) / len(xs) if xs else None,
            "p50": percentile(xs, 50), "p90": percentile(xs, 90), "p99": percentile(xs, 99)}


def parse_slo(text: str | None) -> dict[str, float]:
    """``"ttft=1000,tpot=50"`` (milliseconds) -> ``{"ttft_ms": 1000.0, "tpot_ms": 50.0}``."""
    out: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        k, sep, v = part.partition("=")
        k = k.strip().lower()
        if not sep or k not in ("ttft", "tpot", "e2e"):
            raise ValueError(f"bad SLO {part!r}: use ttft=MS,tpot=MS[,e2e=MS]")
        out[f"{k}_ms"] = float(v.removesuffix("ms"))
    return out


def meets_slo(rec: dict, slo: dict[str, float]) -> bool:
    """An ok request meeting every limit in ``slo``; no TPOT (one token) meets tpot."""
    if rec.get("outcome") != "ok":
        return False
    for key, field_ in (("ttft_ms", "ttft_s"), ("tpot_ms", "tpot_s"), ("e2e_ms", "e2e_s")):
        if key in slo:
            v = rec.get(field_)
            if v is None:
                if field_ == "tpot_s":
                    continue
                return False
            if v * 1e3 > slo[key]:
                return False
    return True


def summarize(records: list[dict], slo: dict[str, float], makespan_s: float) -> dict:
    """Latency distributions (ms) of ok requests, throughputs and goodput (per second of
    ``makespan_s``)."""
    ok = [r for r in records if r["outcome"] == "ok"]
    outcomes: dict[str, int] = {}
    for r in records:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1

    def ms(key: str) -> list[float]:
        return [r[key] * 1e3 for r in ok if r.get(key) is not None]

    good = sum(meets_slo(r, slo) for r in records)
    span = makespan_s if makespan_s > 0 else float("nan")
    out_tok = sum(r.get("output_tokens") or 0 for r in ok)
    in_tok = sum(r["prompt_tokens"] for r in ok)
    return {
        "requests": len(records), "outcomes": outcomes, "makespan_s": makespan_s,
        "ttft_ms": dist(ms("ttft_s")), "tpot_ms": dist(ms("tpot_s")), "e2e_ms": dist(ms("e2e_s")),
        "request_throughput_rps": len(ok) / span, "output_token_throughput_tps": out_tok / span,
        "input_token_throughput_tps": in_tok / span, "slo": slo, "slo_met": good,
        "slo_attainment": good / len(records) if records else None,
        "goodput_rps": good / span,
    }


# ---- the replay ------------------------------------------------------------------------
async def send_one(client, url: str, model: str, req: PreparedRequest, timeout_s: float,
                   extra_body: dict | None = None) -> dict:
    """One streaming /v1/completions request; timings from just before sending."""
    import aiohttp

    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0,
            **(extra_body or {})}
    rec: dict[str, Any] = {"index": req.index, "scheduled_s": req.t_s,
                           "prompt_tokens": len(req.prompt), "max_tokens": req.max_tokens,
                           "outcome": "error", "status": None, "ttft_s": None, "tpot_s": None,
                           "e2e_s": None, "output_tokens": None, "error": None}
    t0 = time.perf_counter()
    rec["sent_at"] = t0
    seen = _StreamSeen()
    try:
        async with client.post(f"{url}/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            rec["status"] = resp.status
            predicted = resp.headers.get(PREDICTED_TTFT_HEADER)
            if predicted is not None:
                rec["predicted_ttft_s"] = float(predicted) / 1000.0
            if resp.status != 200:
                text = (await resp.read())[:300].decode(errors="replace")
                rec["outcome"] = "rejected" if resp.status == 503 else "error"
                rec["error"] = f"HTTP {resp.status}: {text}"
                rec["e2e_s"] = time.perf_counter() - t0
                return rec
            rec["error"] = await seen.read(resp.content)
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
    rec["e2e_s"] = time.perf_counter() - t0
    rec["chunks"] = seen.chunks
    if seen.first is not None:
        rec["ttft_s"] = seen.first - t0
    n_out = seen.usage.get("completion_tokens") if seen.usage else None
    rec["output_tokens"] = n_out if n_out is not None else seen.chunks
    if seen.first is not None and seen.last is not None and rec["output_tokens"] > 1:
        rec["tpot_s"] = (seen.last - seen.first) / (rec["output_tokens"] - 1)
    if seen.finished and rec["error"] is None:
        rec["outcome"] = "ok"
    elif rec["error"] is None:
        rec["error"] = "stream ended without a finish reason"
    return rec


PREDICTED_TTFT_HEADER = "x-splitserve-predicted-ttft-ms"
"""Where this project's frontend answers admission's TTFT prediction (recorded as
``predicted_ttft_s`` beside the measured ``ttft_s``)."""


@dataclass
class _StreamSeen:
    """What a client saw of one SSE completion stream: chunk times, usage, finish."""

    first: float | None = None
    last: float | None = None
    chunks: int = 0
    usage: dict | None = None
    finished: bool = False

    async def read(self, lines) -> str | None:
        """Consume the stream's lines; returns the error a chunk carried, if any."""
        async for raw in lines:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return None
            chunk = json.loads(data)
            if "error" in chunk:
                return str(chunk["error"])[:300]
            if chunk.get("usage"):
                self.usage = chunk["usage"]
            choices = chunk.get("choices") or []
            if not choices:
                continue
            now = time.perf_counter()
            self.chunks += 1
            if self.first is None:
                self.first = now
            self.last = now
            if choices[0].get("finish_reason"):
                self.finished = True
        return None


async def fetch_model(client, url: str) -> str:
    async with client.get(f"{url}/v1/models") as r:
        r.raise_for_status()
        return (await r.json())["data"][0]["id"]


def _unserved(req: PreparedRequest, error: str) -> dict:
    """The record of a request that got no reply (refused by the client, cancelled)."""
    return {"index": req.index, "scheduled_s": req.t_s, "prompt_tokens": len(req.prompt),
            "max_tokens": req.max_tokens, "outcome": "error", "error": error}


async def _finish_by(tasks: list[asyncio.Task], timeout_s: float | None) -> int:
    """Wait for ``tasks`` up to ``timeout_s``; cancel the rest and return how many."""
    if not tasks:
        return 0
    _done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return len(pending)


async def _report_progress(start: float, every_s: float, tag: str, records: list[dict],
                           state: dict[str, int], total: int) -> None:
    """Print the replay's progress every ``every_s`` until cancelled."""
    while True:
        await asyncio.sleep(every_s)
        ok = sum(r["outcome"] == "ok" for r in records)
        rej = sum(r["outcome"] == "rejected" for r in records)
        print(f"{tag}t={time.perf_counter() - start:6.1f}s sent {state['sent']}/{total} "
              f"in flight {state['inflight']} ok {ok} rejected {rej} "
              f"error {len(records) - ok - rej}", flush=True)


async def replay(url: str, requests: list[PreparedRequest], *, model: str | None = None,
                 timeout_s: float = 300.0, progress_s: float = 5.0, label: str = "",
                 max_inflight: int = 2048, extra_body: dict | None = None,
                 deadline_s: float | None = None) -> tuple[list[dict], float]:
    """Send every request at its ``t_s`` (open loop); returns (records, makespan_s).

    ``max_inflight`` bounds client-side concurrency (a request that would exceed it is
    counted as an error ``client-overload`` rather than delayed, which would close the
    loop).  ``deadline_s`` bounds the whole replay: requests still running then are
    cancelled and recorded as errors.
    """
    import aiohttp

    url = url.rstrip("/")
    conn = aiohttp.TCPConnector(limit=0)
    records: list[dict] = []
    state = {"sent": 0, "inflight": 0}
    tag = f"[{label}] " if label else ""

    async with aiohttp.ClientSession(connector=conn) as client:
        if model is None:
            try:
                model = await fetch_model(client, url)
            except (aiohttp.ClientError, OSError, KeyError, IndexError, ValueError) as exc:
                raise SystemExit(f"cannot read the served model from {url}/v1/models: "
                                 f"{exc}") from None

        async def run(req: PreparedRequest) -> None:
            try:
                records.append(await send_one(client, url, model, req, timeout_s, extra_body))
            finally:
                state["inflight"] -= 1

        start = time.perf_counter()
        reporter = asyncio.create_task(_report_progress(
            start, progress_s, tag, records, state, len(requests))) if progress_s > 0 else None
        tasks = []
        try:
            for req in requests:
                delay = start + req.t_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                state["sent"] += 1
                if state["inflight"] >= max_inflight:
                    records.append({**_unserved(req, "client-overload"),
                                    "sent_at": time.perf_counter()})
                    continue
                state["inflight"] += 1  # counted here: the task may not have started yet
                tasks.append(asyncio.create_task(run(req)))
            remaining = None if deadline_s is None else max(
                0.0, start + deadline_s - time.perf_counter())
            cancelled = await _finish_by(tasks, remaining)
            if cancelled:
                print(f"{tag}deadline: cancelled {cancelled} requests", flush=True)
        finally:
            if reporter is not None:
                reporter.cancel()
        end = time.perf_counter()
    done_idx = {r["index"] for r in records}
    records += [_unserved(req, "cancelled at deadline") for req in requests
                if req.index not in done_idx]
    records.sort(key=lambda r: r["index"])
    for r in records:
        if "sent_at" in r:
            r["sent_s"] = r.pop("sent_at") - start  # relative; lateness = sent_s - scheduled_s
    return records, end - start


# ---- putting it together ---------------------------------------------------------------
@dataclass
class ReplayConfig:
    trace: str = DEFAULT_TRACE
    format: str = "auto"
    start_s: float = 0.0
    duration_s: float | None = None
    max_requests: int | None = None
    time_scale: float = 1.0
    rate_scale: float = 1.0
    token_scale: int = 16
    output_scale: float = 1.0
    max_output: int | None = None
    context: int = DEFAULT_CONTEXT
    seed: int = 0
    vocab_size: int = DEFAULT_VOCAB_SIZE
    first_regular_id: int = DEFAULT_FIRST_REGULAR_ID
    slo: dict[str, float] = field(default_factory=dict)
    timeout_s: float = 300.0
    model: str | None = None


def resolve_trace(path: str) -> Path:
    """The trace file ``path`` names; a relative path is read from the working directory,
    like the graph's config.  Raises FileNotFoundError naming it when it is missing."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"trace {path!r} not found (a relative path is read from "
                                f"the working directory, {Path.cwd()})")
    return p


def prepare(cfg: ReplayConfig) -> tuple[list[PreparedRequest], dict]:
    """Load, window, scale; returns the requests and a description of the workload."""
    rows = load_trace(resolve_trace(cfg.trace), cfg.format)
    window = select_window(rows, cfg.start_s, cfg.duration_s, cfg.max_requests)
    if not window:
        raise SystemExit(f"no requests in the window start {cfg.start_s}s duration "
                         f"{cfg.duration_s}s of {cfg.trace}")
    timed = scale_times(window, cfg.time_scale, cfg.rate_scale)
    scaling = TokenScaling(cfg.token_scale, cfg.output_scale, cfg.context, cfg.max_output)
    blocks = BlockTokens(scaling.block_tokens, cfg.seed, cfg.vocab_size, cfg.first_regular_id)
    reqs = build_requests(timed, scaling, blocks)
    span = timed[-1].t_s if timed else 0.0
    workload = {
        "trace": cfg.trace, "window_requests": len(window),
        "window_trace_s": [cfg.start_s, cfg.start_s + (window[-1].t_s if window else 0.0)],
        "replay_span_s": span,
        "offered_rps": len(reqs) / span if span > 0 else None,
        "trace_input_tokens": dist([float(r.input_length) for r in window]),
        "trace_output_tokens": dist([float(r.output_length) for r in window]),
        "prompt_tokens": dist([float(len(r.prompt)) for r in reqs]),
        "max_tokens": dist([float(r.max_tokens) for r in reqs]),
        "clipped_requests": sum(r.clipped for r in reqs),
        "block_tokens": scaling.block_tokens,
        "prefix_block_reuse": prefix_reuse(window),
    }
    return reqs, workload


def fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}" if x >= 10 else f"{x:.1f}"


def print_summary(s: dict, label: str = "") -> None:
    tag = f"[{label}] " if label else ""
    print(f"{tag}{s['requests']} requests {s['outcomes']} in {s['makespan_s']:.1f}s")
    for k in ("ttft_ms", "tpot_ms", "e2e_ms"):
        d = s[k]
        print(f"{tag}  {k[:-3]:5s} p50 {fmt_ms(d['p50'])} p90 {fmt_ms(d['p90'])} "
              f"p99 {fmt_ms(d['p99'])} ms (n={d['n']})")
    print(f"{tag}  throughput {s['request_throughput_rps']:.2f} req/s, "
          f"{s['output_token_throughput_tps']:.0f} output tok/s, "
          f"{s['input_token_throughput_tps']:.0f} prompt tok/s")
    if s["slo"]:
        print(f"{tag}  goodput {s['goodput_rps']:.2f} req/s under {s['slo']} "
              f"({s['slo_met']}/{s['requests']} met)", flush=True)


def add_replay_args(p: argparse.ArgumentParser) -> None:
    """Workload options shared by this CLI and the benchmarks built on it."""
    p.add_argument("--trace", default=DEFAULT_TRACE,
                   help="Mooncake JSONL or Azure CSV (default: %(default)s, relative to the "
                        "repository root)")
    p.add_argument("--format", choices=["auto", "mooncake", "azure"], default="auto")
    p.add_argument("--start-s", type=float, default=0.0, help="window start in trace seconds")
    p.add_argument("--duration-s", type=float, default=None, help="window length (trace s)")
    p.add_argument("--max-requests", type=int, default=None, help="at most this many")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply arrival times (0.5 = twice as fast)")
    p.add_argument("--rate-scale", type=float, default=1.0,
                   help="multiply the request rate (divides arrival times)")
    p.add_argument("--token-scale", type=int, default=16,
                   help="divide prompt lengths and the 512-token block by this")
    p.add_argument("--output-scale", type=float, default=1.0, help="divide output lengths")
    p.add_argument("--max-output", type=int, default=None, help="clip max_tokens to this")
    p.add_argument("--context", type=int, default=DEFAULT_CONTEXT,
                   help="served context: prompt + max_tokens is clipped to it")
    p.add_argument("--seed", type=int, default=0, help="seed of the block token RNG")
    p.add_argument("--slo", default="ttft=2000,tpot=100", help="ttft=MS,tpot=MS[,e2e=MS]")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--model", default=None, help="model name (default: from /v1/models)")


def config_from_args(args: argparse.Namespace) -> ReplayConfig:
    return ReplayConfig(trace=args.trace, format=args.format, start_s=args.start_s,
                        duration_s=args.duration_s, max_requests=args.max_requests,
                        time_scale=args.time_scale, rate_scale=args.rate_scale,
                        token_scale=args.token_scale, output_scale=args.output_scale,
                        max_output=args.max_output, context=args.context, seed=args.seed,
                        slo=parse_slo(args.slo), timeout_s=args.request_timeout,
                        model=args.model)


def run_replay(url: str, cfg: ReplayConfig, label: str = "", progress_s: float = 5.0,
               deadline_s: float | None = None, reqs: list[PreparedRequest] | None = None,
               workload: dict | None = None) -> dict:
    """Prepare (unless given), replay, summarise; returns the JSON-ready result."""
    if reqs is None:
        reqs, workload = prepare(cfg)
    records, makespan = asyncio.run(replay(url, reqs, model=cfg.model,
                                           timeout_s=cfg.timeout_s, label=label,
                                           progress_s=progress_s, deadline_s=deadline_s))
    summary = summarize(records, cfg.slo, makespan)
    lateness = [r["sent_s"] - r["scheduled_s"] for r in records if "sent_s" in r]
    summary["send_lateness_ms"] = dist([x * 1e3 for x in lateness])
    return {"config": asdict(cfg), "workload": workload, "summary": summary,
            "requests": records}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="frontend base URL, e.g. http://127.0.0.1:8000")
    add_replay_args(p)
    p.add_argument("--progress-s", type=float, default=5.0)
    p.add_argument("--deadline-s", type=float, default=None,
                   help="cancel what still runs this long after the start")
    p.add_argument("--out", default=None, help="write the result JSON here")
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    reqs, workload = prepare(cfg)
    print(f"{len(reqs)} requests over {workload['replay_span_s']:.1f}s; prompt tokens p50 "
          f"{workload['prompt_tokens']['p50']:.0f} p99 {workload['prompt_tokens']['p99']:.0f}"
          f"; {workload['clipped_requests']} clipped to the context", flush=True)
    res = run_replay(args.url, cfg, progress_s=args.progress_s, deadline_s=args.deadline_s,
                     reqs=reqs, workload=workload)
    res["command"] = "python " + " ".join(
        sys.argv if argv is None else ["benchmarks/trace_replay.py", *argv])
    print_summary(res["summary"])
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
