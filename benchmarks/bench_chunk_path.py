"""This frontend's own CPU per streamed chunk, alone: no HTTP server, no Dynamo client.

The frontend's app (``build_app``, the packaged model's tokenizer and chat template) is
called as an ASGI application in this process, over a backend that yields ``--tokens``
one-token chunks as fast as they are read; each request streams a chat answer, with a
tool in it (``--tools``: tool_choice auto, so the model's tool-call parser reads every
chunk) or without.  What is measured is the process's CPU time per request and per
chunk, over ``--requests`` requests after a warm-up, ``--rounds`` times: the parsing and
preparation, the per-chunk layers (deadline, detokeniser, parser, metrics, SSE
encoding) and Starlette's streaming response; with ``--backend in_process`` also the
in-process routing service's placement and release and the backend's stream layers
(stall deadline, migration), over a fake Dynamo client, which the end-to-end benchmark
(``bench_frontend_cost.py``) measures only together with the HTTP server, Dynamo's
client and a machine shared with the workers.  Deterministic enough to compare two
trees on one machine.  ``--prompt-ids N`` sends streamed ``/v1/completions`` of N
random token ids instead (the held-out replays' requests), for the per-request cost of a
long prompt: parsing, checking and placing it.

    python benchmarks/bench_chunk_path.py --tokens 350 --tools --out FILE.json
    python benchmarks/bench_chunk_path.py --backend in_process --prompt-ids 8000 --tokens 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from splitserve.components.frontend.app import FrontendState, build_app  # noqa: E402
from splitserve.components.frontend.textcodec import TextCodec  # noqa: E402
from splitserve.components.worker.registry import request_params_of  # noqa: E402
from splitserve.contracts.model_files import PACKAGED_MODEL, model_dir  # noqa: E402
from splitserve.contracts.wire import output_chunk  # noqa: E402

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


class Backend:
    """Yields the request's ``max_tokens`` one-token chunks, cycling over ``ids``."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def ready(self) -> bool:
        return True

    async def stream(self, call, meta, context):
        req = call.to_wire()
        n = req["stop_conditions"]["max_tokens"]
        for i in range(n):
            last = i == n - 1
            await asyncio.sleep(0)  # a chunk arrives from elsewhere: the loop turns
            yield output_chunk([self.ids[i % len(self.ids)]], "length" if last else None,
                               prompt_tokens=len(req["token_ids"]) if last else None,
                               completion_tokens=n if last else None)


class Item:
    """A response item as Dynamo's client yields it (its payload behind ``data()``)."""

    __slots__ = ("_data",)

    def __init__(self, data: dict) -> None:
        self._data = data

    def data(self) -> dict:
        return self._data


class Workers:
    """Dynamo's worker client as the in-process routing service and backend read it:
    ``--workers`` instance ids, and each stream ``max_tokens`` one-token items."""

    def __init__(self, n: int, ids: list[int]) -> None:
        self.n, self.ids = n, ids

    def instance_ids(self) -> list[int]:
        return list(range(1, self.n + 1))

    async def direct(self, request, worker_id, context=None):
        return self._stream(request["stop_conditions"]["max_tokens"],
                            len(request["token_ids"]))

    async def _stream(self, n: int, prompt: int):
        for i in range(n):
            last = i == n - 1
            await asyncio.sleep(0)
            yield Item(output_chunk([self.ids[i % len(self.ids)]],
                                    "length" if last else None,
                                    prompt_tokens=prompt if last else None,
                                    completion_tokens=n if last else None))


def in_process_backend(ids: list[int], workers: int):
    """The frontend's in-process routing (``Frontend.routing: in_process``, the README's
    and the held-out benchmark's) over ``Workers``: placement, the backend's stream
    layers and the release, as a served request goes through them."""
    from splitserve.components.frontend.backend import BackendMetrics
    from splitserve.components.frontend.inproc import InProcessBackend
    from splitserve.components.router.service import RouterService
    from splitserve.components.router.service_config import (
        RouterComponentConfig,
        load_policy,
    )

    client = Workers(workers, ids)
    cfg = RouterComponentConfig.model_validate({"policy": "kv_aware",
                                                "use_kv_events": False})
    svc = RouterService(cfg, load_policy(cfg), client, worker_endpoint="bench.worker.generate")
    return InProcessBackend(svc, client, metrics=BackendMetrics())


async def one(app, body: bytes, path: str = "/v1/chat/completions") -> tuple[int, int]:
    """One streamed request to ``path`` through the ASGI app; returns its status and the
    body parts sent."""
    parts, status = 0, 0
    msgs = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if msgs:
            return msgs.pop()
        await asyncio.Event().wait()  # the client stays connected

    async def send(m):
        nonlocal parts, status
        parts += m["type"] == "http.response.body"
        status = m.get("status", status)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": b"",
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    await app(scope, receive, send)
    return status, parts


WARMUP = 10
"""Requests sent before measuring (each must stream, or nothing is measured)."""


def request_bodies(args, vocab: int) -> tuple[str, list[bytes]]:
    """The endpoint and the request bodies: one chat body, or (``--prompt-ids N``)
    streamed completions of N random token ids each, a different prompt per request
    (warm-up and every round)."""
    if args.prompt_ids:
        rng = random.Random(0)
        return "/v1/completions", [json.dumps({
            "model": PACKAGED_MODEL, "max_tokens": args.tokens, "stream": True,
            "prompt": [rng.randrange(vocab) for _ in range(args.prompt_ids)]}).encode()
            for _ in range(WARMUP + args.rounds * args.requests)]
    body = {"model": PACKAGED_MODEL, "max_tokens": args.tokens, "stream": True,
            "messages": [{"role": "user", "content": "What is the weather? " * 20}]}
    if args.tools:
        body["tools"] = [TOOL]
    return "/v1/chat/completions", [json.dumps(body).encode()]


async def measure(args) -> dict:
    codec = TextCodec.from_dir(model_dir(PACKAGED_MODEL))
    ids = codec.prompt_ids("The weather in Paris is mild today, with a light wind from "
                           "the west and clouds that clear by the evening. ")
    backend = in_process_backend(ids, args.workers) if args.backend == "in_process" \
        else Backend(ids)
    state = FrontendState(model_name=PACKAGED_MODEL, codec=codec, backend=backend,
                          engines=request_params_of(("torch",)),
                          tool_call_parser="hermes" if args.tools else None)
    app = build_app(state)
    path, bodies = request_bodies(args, codec.vocab_size)
    for i in range(WARMUP):
        status, parts = await one(app, bodies[i % len(bodies)], path)
        if status != 200 or parts < args.tokens:
            raise SystemExit(f"the app answered {status} with {parts} body parts, not a "
                             f"stream of {args.tokens} chunks: nothing to measure")
    rounds = []
    for r in range(args.rounds):
        t0 = time.process_time()
        for i in range(args.requests):
            await one(app, bodies[(WARMUP + r * args.requests + i) % len(bodies)], path)
        cpu = time.process_time() - t0
        rounds.append({"cpu_ms_per_request": round(cpu * 1000 / args.requests, 3),
                       "cpu_us_per_chunk": round(cpu * 1e6 / args.requests / args.tokens, 2)})
    return {"tokens": args.tokens, "tools": args.tools, "backend": args.backend,
            "prompt_ids": args.prompt_ids,
            "requests": args.requests,
            "rounds": rounds,
            "median_cpu_us_per_chunk": statistics.median(r["cpu_us_per_chunk"]
                                                         for r in rounds),
            "median_cpu_ms_per_request": statistics.median(r["cpu_ms_per_request"]
                                                           for r in rounds)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=350, help="chunks per answer")
    p.add_argument("--tools", action="store_true", help="a tool in every request (auto)")
    p.add_argument("--prompt-ids", type=int, default=0, help="streamed /v1/completions "
                   "with prompts of this many random token ids instead of chat")
    p.add_argument("--requests", type=int, default=60, help="requests per round")
    p.add_argument("--backend", choices=("bare", "in_process"), default="bare",
                   help="bare: chunks straight into the request's stream; in_process: "
                   "through the in-process routing service and the backend's layers, "
                   "from a fake Dynamo client")
    p.add_argument("--workers", type=int, default=4, help="workers (in_process)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="write the result here (JSON)")
    args = p.parse_args(argv)
    import uvloop

    report = uvloop.run(measure(args))
    report["command"] = "python benchmarks/bench_chunk_path.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    print(json.dumps(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
