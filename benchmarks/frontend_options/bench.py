"""Frontend options: Dynamo's Rust HTTP service vs a Starlette/uvicorn app.

Both servers do the same thing per request: ask a stand-in router (a Python coroutine)
for a worker, then run an echo "engine" that yields four chunks, and answer a
non-streaming OpenAI chat completion.  Only the HTTP layer differs:

* ``dynamo``: ``EntrypointArgs(EngineType.Dynamic, chat_engine_factory=...)`` +
  ``make_engine`` + ``run_input("http", ...)``.  A placeholder model is registered on
  an in-process endpoint (in-memory discovery, ``skip_model_assets=True``) so that the
  frontend calls our factory, which returns a ``PythonAsyncEngine`` over our generator.
  This path lets us bind 127.0.0.1 (``HttpService`` has no host argument).
* ``starlette``: a minimal Starlette app on uvicorn.

Usage (everything binds 127.0.0.1; every process started here is stopped on exit)::

    python benchmarks/frontend_options/bench.py probe
    python benchmarks/frontend_options/bench.py bench --rounds 3 --seq 500 --rate 100 --duration 10

``serve-dynamo`` / ``serve-starlette`` run one server in the foreground (used internally).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

HOST = "127.0.0.1"
MODEL = "echo"
TOKENS = ["Hello", ",", " world", "!"]


# --------------------------------------------------------------------------- shared logic


class StandInRouter:
    """What the project's router does in the request path: pick a worker per request."""

    def __init__(self, workers: int = 4) -> None:
        self._next = itertools.cycle(range(workers))
        self.decisions = 0

    async def pick(self, request: dict[str, Any]) -> int:
        self.decisions += 1
        return next(self._next)


class BadRequest(Exception):
    pass


class Overloaded(Exception):
    pass


def check(request: dict[str, Any]) -> str:
    """Project-level validation / admission; returns the last user text."""
    msgs = request.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list")
    text = msgs[-1].get("content")
    if text == "bad":
        raise BadRequest("content 'bad' is rejected by validation")
    if text == "busy":
        raise Overloaded("all workers are saturated")
    return text if isinstance(text, str) else ""


async def echo_chunks(request: dict[str, Any], worker: int):
    created = int(time.time())
    for i, tok in enumerate(TOKENS):
        delta: dict[str, Any] = {"content": tok}
        if i == 0:
            delta["role"] = "assistant"
        yield {"id": "chatcmpl-echo", "object": "chat.completion.chunk", "created": created,
               "model": request.get("model", MODEL),
               "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
    yield {"id": "chatcmpl-echo", "object": "chat.completion.chunk", "created": created,
           "model": request.get("model", MODEL),
           "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}


# --------------------------------------------------------------------------- dynamo server


async def serve_dynamo(port: int) -> None:
    from dynamo._core import DistributedRuntime
    from dynamo.llm import (
        EngineType,
        EntrypointArgs,
        FrontendResponse,
        FrontendRoute,
        HttpError,
        ModelInput,
        ModelType,
        PythonAsyncEngine,
        WorkerType,
        make_engine,
        register_model,
        run_input,
    )

    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, "mem", "tcp")
    router = StandInRouter()

    # Placeholder worker endpoint: only exists so discovery announces the model and the
    # frontend calls chat_engine_factory. Our engine never sends anything to it.
    async def placeholder(request, context=None):
        yield {}

    endpoint = runtime.endpoint("splitserve.frontendbench.generate")
    serving = asyncio.ensure_future(endpoint.serve_endpoint(placeholder))
    endpoint.metrics.register_prometheus_expfmt_callback(
        lambda: ("# TYPE splitserve_router_decisions_total counter\n"
                 f"splitserve_router_decisions_total {router.decisions}\n"))
    await asyncio.sleep(0.2)
    await register_model(ModelInput.Tokens, ModelType.Chat, endpoint, MODEL, MODEL,
                         worker_type=WorkerType.Aggregated, skip_model_assets=True)

    async def factory(instance_id, card, routed_engine):
        async def generate(request, context=None):
            # request: the OpenAI chat request as a dict (not tokenised).
            try:
                check(request)
            except BadRequest as e:
                raise HttpError(400, str(e)) from None
            except Overloaded as e:
                raise HttpError(503, str(e)) from None
            worker = await router.pick(request)
            async for chunk in echo_chunks(request, worker):
                yield chunk

        return PythonAsyncEngine(generate, loop)

    def state(ctx):
        if not ctx.has_any_ready_model():
            return FrontendResponse(503, {"ready": False})
        return {"ready": True, "models": ctx.model_display_names()}

    args = EntrypointArgs(EngineType.Dynamic, http_host=HOST, http_port=port,
                          chat_engine_factory=factory, namespace="splitserve")
    engine = await make_engine(runtime, args)
    try:
        await run_input(runtime, "http", engine, [FrontendRoute("GET", "/splitserve/state", state)])
    finally:
        serving.cancel()


# --------------------------------------------------------------------------- starlette server


def build_starlette_app():
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    registry = CollectorRegistry()
    decisions = Counter("splitserve_router_decisions", "Router decisions", registry=registry)
    router = StandInRouter()

    def error(status: int, message: str, etype: str, headers: dict | None = None):
        return JSONResponse({"error": {"message": message, "type": etype, "param": None,
                                       "code": None}}, status_code=status, headers=headers)

    async def chat(request: Request):
        try:
            body = await request.json()
        except ValueError:
            return error(400, "request body is not valid JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return error(400, "request body must be a JSON object", "invalid_request_error")
        if body.get("model") != MODEL:
            return error(404, f"model '{body.get('model')}' does not exist", "model_not_found")
        try:
            check(body)
        except BadRequest as e:
            return error(400, str(e), "invalid_request_error")
        except Overloaded as e:
            return error(503, str(e), "overloaded", headers={"Retry-After": "1"})
        worker = await router.pick(body)
        decisions.inc()
        text, finish, created = [], None, 0
        async for chunk in echo_chunks(body, worker):
            c = chunk["choices"][0]
            text.append(c["delta"].get("content", ""))
            finish = c["finish_reason"] or finish
            created = chunk["created"]
        return JSONResponse({"id": "chatcmpl-echo", "object": "chat.completion", "created": created,
                             "model": MODEL, "choices": [{"index": 0, "finish_reason": finish,
                             "message": {"role": "assistant", "content": "".join(text)}}]})

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model",
                                                         "created": 0, "owned_by": "splitserve"}]})

    async def health(request: Request):
        return JSONResponse({"status": "healthy"})

    async def metrics(request: Request):
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/models", models), Route("/health", health),
                             Route("/metrics", metrics)])


def serve_starlette(port: int) -> None:
    import uvicorn
    uvicorn.run(build_starlette_app(), host=HOST, port=port, log_level="warning",
                access_log=False)


# --------------------------------------------------------------------------- process control


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> Server:
        env = dict(os.environ)
        env.setdefault("DYN_LOG", "warn")          # Dynamo logs every request at INFO
        env.setdefault("DYN_TCP_RPC_HOST", HOST)   # request plane on loopback
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), f"serve-{self.kind}", "--port", str(self.port)],
            env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        return self

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        import aiohttp
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.kind} exited: {self.proc.stderr.read().decode()[-2000:]}")
                try:
                    async with s.get(f"{self.url}/v1/models") as r:
                        if r.status == 200 and MODEL in json.dumps(await r.json()):
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.2)
        raise TimeoutError(f"{self.kind} not ready on port {self.port}")

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def cpu_seconds(self) -> float:
        import psutil
        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user + t.system

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


# --------------------------------------------------------------------------- load generation


def body(text: str = "hi", model: str = MODEL) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 8}


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


async def sequential(url: str, n: int) -> dict:
    import aiohttp
    lat = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
        for _ in range(20):  # warm-up
            async with s.post(f"{url}/v1/chat/completions", json=body()) as r:
                await r.read()
        for _ in range(n):
            t = time.perf_counter()
            async with s.post(f"{url}/v1/chat/completions", json=body()) as r:
                await r.read()
                assert r.status == 200, r.status
            lat.append((time.perf_counter() - t) * 1e3)
    return {"p50": pct(lat, 50), "p99": pct(lat, 99)}


async def open_loop(url: str, rate: float, duration: float) -> dict:
    """Poisson-free fixed-interval arrivals; latency is measured from the scheduled time."""
    import aiohttp
    n = int(rate * duration)
    lat: list[float] = []
    errors = 0

    async def one(s, when: float):
        nonlocal errors
        await asyncio.sleep(max(0.0, when - time.perf_counter()))
        try:
            async with s.post(f"{url}/v1/chat/completions", json=body()) as r:
                await r.read()
                if r.status != 200:
                    errors += 1
                    return
        except aiohttp.ClientError:
            errors += 1
            return
        lat.append((time.perf_counter() - when) * 1e3)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as s:
        t0 = time.perf_counter() + 0.2
        start = time.perf_counter()
        await asyncio.gather(*(one(s, t0 + i / rate) for i in range(n)))
        wall = time.perf_counter() - start
    return {"p50": pct(lat, 50), "p99": pct(lat, 99), "ok": len(lat), "errors": errors,
            "achieved_rps": len(lat) / wall}


async def closed_loop(url: str, concurrency: int, duration: float) -> dict:
    import aiohttp
    done = 0
    stop = time.perf_counter() + duration

    async def worker(s):
        nonlocal done
        while time.perf_counter() < stop:
            async with s.post(f"{url}/v1/chat/completions", json=body()) as r:
                await r.read()
            done += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
    return {"rps": done / duration}


# --------------------------------------------------------------------------- commands


async def cmd_probe() -> None:
    import aiohttp
    servers = [Server("dynamo").start(), Server("starlette").start()]
    try:
        await asyncio.gather(*(s.wait_ready() for s in servers))
        cases = [("ok", body()), ("bad input", body("bad")), ("overload", body("busy")),
                 ("unknown model", body(model="nope")),
                 ("malformed", {"model": MODEL, "messages": "not-a-list"})]
        async with aiohttp.ClientSession() as sess:
            for srv in servers:
                print(f"===== {srv.kind}")
                for name, b in cases:
                    async with sess.post(f"{srv.url}/v1/chat/completions", json=b) as r:
                        text = (await r.text())[:200]
                        print(f"{name:14s} {r.status} Retry-After={r.headers.get('Retry-After')} {text}")
                for path in ["/v1/models", "/health", "/live", "/splitserve/state"]:
                    async with sess.get(f"{srv.url}{path}") as r:
                        print(f"GET {path:18s} {r.status} {(await r.text())[:160]}")
                async with sess.get(f"{srv.url}/metrics") as r:
                    text = await r.text()
                    own = [ln for ln in text.splitlines() if "splitserve_" in ln and not ln.startswith("#")]
                    print(f"GET /metrics        {r.status} {len(text.splitlines())} lines; "
                          f"own metric lines: {own}")
    finally:
        for s in servers:
            s.stop()


async def cmd_bench(a) -> None:
    servers = {k: Server(k).start() for k in ("dynamo", "starlette")}
    results: dict[str, dict[str, list]] = {k: {} for k in servers}

    def add(kind, key, value):
        results[kind].setdefault(key, []).append(value)

    try:
        await asyncio.gather(*(s.wait_ready() for s in servers.values()))
        for rnd in range(a.rounds):
            order = list(servers) if rnd % 2 == 0 else list(reversed(list(servers)))
            for kind in order:
                srv = servers[kind]
                seq = await sequential(srv.url, a.seq)
                cpu0 = srv.cpu_seconds()
                ol = await open_loop(srv.url, a.rate, a.duration)
                cpu_ms = (srv.cpu_seconds() - cpu0) * 1e3 / max(1, ol["ok"] + ol["errors"])
                cl = await closed_loop(srv.url, a.concurrency, a.closed_duration)
                for key, value in (("seq_p50", seq["p50"]), ("seq_p99", seq["p99"]),
                                   ("rate_p50", ol["p50"]), ("rate_p99", ol["p99"]),
                                   ("rate_errors", ol["errors"]),
                                   ("rate_achieved", ol["achieved_rps"]),
                                   ("cpu_ms_per_req", cpu_ms), ("closed_rps", cl["rps"])):
                    add(kind, key, value)
                print(f"round {rnd} {kind:9s} seq p50={seq['p50']:.3f} p99={seq['p99']:.3f} ms | "
                      f"{a.rate:.0f} rps p50={ol['p50']:.3f} p99={ol['p99']:.3f} ms "
                      f"errors={ol['errors']} achieved={ol['achieved_rps']:.1f} | "
                      f"server cpu {cpu_ms:.3f} ms/req | c={a.concurrency} {cl['rps']:.0f} rps",
                      flush=True)
    finally:
        for s in servers.values():
            s.stop()

    print(f"\nmedians over {a.rounds} rounds (latency in ms)")
    keys = ["seq_p50", "seq_p99", "rate_p50", "rate_p99", "rate_errors", "cpu_ms_per_req", "closed_rps"]
    print(f"{'':10s}" + "".join(f"{k:>15s}" for k in keys))
    for kind, r in results.items():
        print(f"{kind:10s}" + "".join(f"{statistics.median(r[k]):15.3f}" for k in keys))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("serve-dynamo", "serve-starlette"):
        sub.add_parser(name).add_argument("--port", type=int, required=True)
    sub.add_parser("probe")
    b = sub.add_parser("bench")
    b.add_argument("--rounds", type=int, default=3)
    b.add_argument("--seq", type=int, default=500)
    b.add_argument("--rate", type=float, default=100.0)
    b.add_argument("--duration", type=float, default=10.0)
    b.add_argument("--concurrency", type=int, default=16)
    b.add_argument("--closed-duration", type=float, default=3.0)
    a = p.parse_args()
    if a.cmd == "serve-dynamo":
        asyncio.run(serve_dynamo(a.port))
    elif a.cmd == "serve-starlette":
        serve_starlette(a.port)
    elif a.cmd == "probe":
        asyncio.run(cmd_probe())
    else:
        asyncio.run(cmd_bench(a))


if __name__ == "__main__":
    main()
