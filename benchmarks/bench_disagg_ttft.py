"""TTFT of a long prompt with local vs remote prefill (torch engine, real SmolLM2 model).

Brings ``graphs.disagg:Frontend`` (configs/disagg.yaml: one decode and one prefill CPU
worker, one torch thread each) up twice in one run, both at once: one instance with the
offload decider forced to remote prefill, one forced to local prefill.  It sends the same N
distinct prompts of about 2,000 tokens (distinct from the first KV block on, so no prefix
cache hits) to both as streaming chat requests with ``max_tokens`` 8 and temperature 0,
one request at a time, alternating between the two instances (remote/local, then
local/remote, ...) so both modes see the same background load, and measures on the client:

- TTFT: request sent → first chunk carrying content;
- total: request sent → end of stream.

Around every request it also reads the Prometheus metrics of the decode and prefill
workers (URLs from the supervisor's control endpoint) and records the per-request deltas
of ``splitserve_prefill_compute_seconds`` (prefill job submit → KV computed, on the
prefill worker), ``splitserve_prefill_transfer_seconds`` / ``_bytes_total`` (KV write
into the decode worker) and ``splitserve_disagg_remote_prefill_seconds`` (decode worker:
enqueue → KV arrival), so remote TTFT splits into compute, transfer and the rest
(queue, HTTP, routing, tokenisation, the first decode step).

    python benchmarks/bench_disagg_ttft.py --requests 5

The decode worker's ``remote_prefill_timeout_s`` is raised to 120 s (``--remote-timeout``):
at the config's 30 s a 2,000-token prefill on one busy core can time out and fall back to
a local prefill, which would mix the two modes.  The prefill queue's ``ack_wait_s`` is
raised above it (and ``max_age_s`` with it): the prefill worker does not extend a job's
ack deadline while computing, so a job longer than ``ack_wait_s`` (30 s) is redelivered
and computed a second time, on the same single core.

Writes ``benchmarks/results/disagg_ttft.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import inspect
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Self
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
CONFIG = "configs/disagg.yaml"

# Varied source text: stdlib modules' sources (code, prose docstrings, comments).
TEXT_MODULES = ["argparse", "difflib", "textwrap", "tarfile", "email.message", "http.client",
                "json.decoder", "logging", "pickle", "calendar", "zipfile", "csv",
                "fractions", "statistics", "shutil", "gettext", "smtplib", "ftplib"]

WORKER_METRICS = {
    "prefill_compute": "splitserve_prefill_compute_seconds",
    "prefill_transfer": "splitserve_prefill_transfer_seconds",
    "remote_wait": "splitserve_disagg_remote_prefill_seconds",
}


# ---- prompts -------------------------------------------------------------------------
def load_codec():
    from splitserve.contracts.kit.cache import model_cache_dir
    from splitserve.contracts.kit.model_dir import export_model_dir
    from splitserve.components.frontend.textcodec import TextCodec

    return TextCodec.from_dir(export_model_dir(model_cache_dir(MODEL)))


def build_prompts(codec, n: int, target: int, first: int = 0) -> list[dict]:
    """``n`` chats of ``target`` tokens (after the chat template), each from a different
    module's source, each with its own system message so even the first block differs."""
    import importlib

    prompts = []
    for i in range(first, first + n):
        mod = importlib.import_module(TEXT_MODULES[i % len(TEXT_MODULES)])
        src = inspect.getsource(mod)
        src_ids = codec.prompt_ids(src)
        system = f"Reviewer {i}: you summarise Python modules ({mod.__name__}) in one line."
        head = "Summarise what this Python module does.\n\n"
        k = target
        for _ in range(8):
            body = codec.decode(src_ids[:k])
            msgs = [{"role": "system", "content": system},
                    {"role": "user", "content": head + body}]
            n_tok = len(codec.chat_ids(msgs))
            if n_tok == target:
                break
            k += target - n_tok
        prompts.append({"source": mod.__name__, "messages": msgs, "prompt_tokens": n_tok})
    return prompts


# ---- the graph -----------------------------------------------------------------------
class Graph:
    """``dynamo serve`` as a subprocess in its own process group, in a scratch directory."""

    def __init__(self, overrides: list[str], timeout_s: float) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="disagg-bench-"))
        self.overrides = overrides
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Self:
        ready = self.tmp / "ready.json"
        env = {k: v for k, v in os.environ.items() if k not in ("ETCD_ENDPOINTS", "NATS_SERVER")}
        env["DYN_LOG"] = "error"
        self.log = open(self.tmp / "serve.log", "wb")  # closed in __exit__
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "splitserve.cli.main", "serve", "graphs.disagg:Frontend",
             "-f", CONFIG, *self.overrides, "--Frontend.port=0",
             "--Common.log_level=warning", "--no-status", "--ready-file", str(ready),
             "--state-dir", str(self.tmp / "state")],
            cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True)
        try:
            deadline = time.monotonic() + self.timeout_s
            while not ready.exists():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    tail = (self.tmp / "serve.log").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"graph did not come up:\n{tail}")
                time.sleep(0.2)
            rows = json.loads(ready.read_text())["rows"]
            self.url = next(r["endpoint"] for r in rows if r["component"] == "Frontend")
            info = json.loads(next((self.tmp / "state/supervisors").glob("*.json")).read_text())
            from splitserve.serve.control import supervisor_status

            status = supervisor_status(info, timeout_s=10)
            self.metrics = {r["component"]: r["metrics"] for r in status["replicas"]}
            self.configs = {c["name"]: c["config"] for c in status["plan"]["components"]}
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        # leftovers of a supervisor that died uncleanly
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, AttributeError):
            pass
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def fetch_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def scrape(url: str) -> dict[str, float]:
    """Flat ``name{labels}`` → value of one Prometheus endpoint (histogram buckets left out)."""
    from splitserve.contracts import prometheus

    with urllib.request.urlopen(url, timeout=10) as r:
        samples = prometheus.parse(r.read().decode())
    out = {}
    for name, series in samples.items():
        for key, value in series.items():
            if any(k == "le" for k, _ in key):
                continue
            labels = ",".join(f"{k}={v}" for k, v in key)
            out[f"{name}{{{labels}}}" if labels else name] = value
    return out


def scrape_all(metrics: dict[str, str]) -> dict[str, float]:
    out = {}
    for comp in ("DecodeWorker", "PrefillWorker"):
        for k, v in scrape(metrics[comp]).items():
            out[f"{comp}:{k}"] = v
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()
            if k.startswith(("DecodeWorker:splitserve_disagg", "DecodeWorker:splitserve_worker",
                             "PrefillWorker:splitserve_prefill")) and v - before.get(k, 0.0)}


# ---- the client ----------------------------------------------------------------------
def stream_chat(url: str, messages: list[dict], max_tokens: int, timeout_s: float) -> dict:
    """One streaming chat request; TTFT and total measured from just before sending."""
    u = urlparse(url)
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                       "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout_s)
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body,
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
        ttft, text, usage = None, [], None
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
        total = time.perf_counter() - t0
    finally:
        conn.close()
    return {"ttft_s": ttft, "total_s": total, "text": "".join(text), "usage": usage}


def med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def measure_one(name: str, g: Graph, p: dict, args) -> dict:
    """One measured request against graph ``g`` with the per-request metric deltas."""
    before = scrape_all(g.metrics)
    r = stream_chat(g.url, p["messages"], args.max_tokens, args.request_timeout)
    time.sleep(0.3)  # let the prefill worker's post-ack bookkeeping land
    d = delta(before, scrape_all(g.metrics))
    row = {"source": p["source"], "prompt_tokens": p["prompt_tokens"],
           "ttft_s": r["ttft_s"], "total_s": r["total_s"], "usage": r["usage"],
           "text": r["text"]}
    for key, metric in WORKER_METRICS.items():
        comp = "DecodeWorker" if key == "remote_wait" else "PrefillWorker"
        n = d.get(f"{comp}:{metric}_count", 0)
        row[f"{key}_s"] = d.get(f"{comp}:{metric}_sum") if n else None
    row["transfer_bytes"] = d.get("PrefillWorker:splitserve_prefill_transfer_bytes_total", 0.0)
    row["decisions"] = {k.split(":", 1)[1]: v for k, v in d.items()
                        if "disagg_decisions_total" in k or "fallbacks_total" in k}
    if row["remote_wait_s"] is not None and row["prefill_compute_s"] is not None:
        # enqueue -> KV arrival, less compute and transfer: queue pull, notification
        row["queue_other_s"] = (row["remote_wait_s"] - row["prefill_compute_s"]
                                - row["prefill_transfer_s"])
        # request sent -> enqueue, KV arrival -> first content chunk: HTTP, template and
        # tokenisation, routing, block allocation, first decode step, detokenisation
        row["outside_wait_s"] = row["ttft_s"] - row["remote_wait_s"]
    extra = ""
    if row["prefill_compute_s"] is not None:
        extra = (f" | compute {fmt(row['prefill_compute_s'])} transfer "
                 f"{fmt(row['prefill_transfer_s'])} wait {fmt(row['remote_wait_s'])}"
                 f" | {row['transfer_bytes'] / 1e6:.1f} MB")
    print(f"[{name}] {p['source']} {p['prompt_tokens']} tok: ttft {fmt(r['ttft_s'])} total "
          f"{fmt(r['total_s'])}{extra} | {row['decisions']}", flush=True)
    return row


def graph_overrides(remote: bool, args) -> list[str]:
    policy = f"{{enable: true, decider: forced, remote: {'true' if remote else 'false'}}}"
    return [f"--DecodeWorker.disaggregated_router={policy}",
            f"--DecodeWorker.remote_prefill_timeout_s={args.remote_timeout}",
            # a job that outlives ack_wait_s is redelivered and computed twice (the prefill
            # worker does not send in_progress); keep both sides' queue settings equal
            *(f"--{c}.prefill_queue.{k}={v}" for c in ("DecodeWorker", "PrefillWorker")
              for k, v in (("ack_wait_s", args.remote_timeout + 30),
                           ("max_age_s", args.remote_timeout * 2 + 60)))]


KEYS = ["ttft_s", "total_s", "prefill_compute_s", "prefill_transfer_s", "remote_wait_s",
        "queue_other_s", "outside_wait_s", "transfer_bytes"]


def run_both(prompts: list[dict], warmups: list[dict], args) -> list[dict]:
    """Both graphs up at once; requests alternate between them (R L, L R, R L, ...) so
    both modes see the same background load.  Only one request runs at a time."""
    modes = {"remote": {"mode": "remote", "remote": True, "requests": []},
             "local": {"mode": "local", "remote": False, "requests": []}}
    with contextlib.ExitStack() as stack:
        graphs = {}
        for name in ("remote", "local"):
            t_up = time.perf_counter()
            graphs[name] = stack.enter_context(
                Graph(graph_overrides(name == "remote", args), args.startup_timeout))
            modes[name]["startup_s"] = time.perf_counter() - t_up
            modes[name]["configs"] = {c: graphs[name].configs[c]
                                      for c in ("DecodeWorker", "PrefillWorker")}
        for name in ("remote", "local"):
            for w in warmups:
                stream_chat(graphs[name].url, w["messages"], args.max_tokens,
                            args.request_timeout)
        for i, p in enumerate(prompts):
            order = ("remote", "local") if i % 2 == 0 else ("local", "remote")
            for name in order:
                modes[name]["requests"].append(measure_one(name, graphs[name], p, args))
    for m in modes.values():
        m["median"] = {k: med([r.get(k) for r in m["requests"]]) for k in KEYS}
    return [modes["remote"], modes["local"]]


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f} ms"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=5, help="measured prompts per mode")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured prompts per mode first")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--remote-timeout", type=float, default=120, help="the decode worker's "
                   "remote_prefill_timeout_s (config: 30 s, close to a 2,000-token prefill "
                   "on one loaded core, so a slow job would fall back to local prefill)")
    p.add_argument("--startup-timeout", type=float, default=240)
    p.add_argument("--request-timeout", type=float, default=120)
    p.add_argument("--out", default=str(REPO / "benchmarks/results/disagg_ttft.json"))
    args = p.parse_args()

    codec = load_codec()
    warm = build_prompts(codec, args.warmup, args.prompt_tokens, first=args.requests)
    prompts = build_prompts(codec, args.requests, args.prompt_tokens)
    assert len({tuple(codec.chat_ids(x["messages"])[:16]) for x in prompts}) == len(prompts)
    print(f"prompt tokens: {[x['prompt_tokens'] for x in prompts]}; context length "
          f"{codec.context_length}", flush=True)
    modes = run_both(prompts, warm, args)
    by = {m["mode"]: m["median"] for m in modes}
    comparison = {}
    if "remote" in by and "local" in by:
        r, l_ = by["remote"], by["local"]
        pairs = [a["ttft_s"] / b["ttft_s"] for a, b in
                 zip(modes[0]["requests"], modes[1]["requests"], strict=True)]
        comparison = {
            "ttft_remote_over_local": r["ttft_s"] / l_["ttft_s"],
            "ttft_remote_over_local_per_prompt": pairs,
            "ttft_remote_over_local_median_of_pairs": med(pairs),
            "ttft_added_ms": (r["ttft_s"] - l_["ttft_s"]) * 1e3,
            "remote_ttft_breakdown_ms": {
                "prefill_compute": r["prefill_compute_s"] * 1e3,
                "kv_transfer": r["prefill_transfer_s"] * 1e3,
                "queue_and_other_in_remote_wait": r["queue_other_s"] * 1e3,
                "outside_remote_wait": r["outside_wait_s"] * 1e3,
            },
            "kv_transfer_MBps": r["transfer_bytes"] / r["prefill_transfer_s"] / 1e6,
        }
        print(json.dumps(comparison, indent=2))
    payload = {"benchmark": "disagg_ttft", "graph": "graphs.disagg:Frontend", "config": CONFIG,
               "settings": vars(args), "context_length": codec.context_length,
               "machine": {"cpus": os.cpu_count()}, "modes": modes, "comparison": comparison,
               "command": "python " + " ".join(sys.argv)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
