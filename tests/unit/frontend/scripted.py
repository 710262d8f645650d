"""A backend that answers every request with one scripted text, a token per chunk, and an
app around it: the frontend's tool, reasoning and Responses paths without a worker."""

from __future__ import annotations

import asyncio
import json

from starlette.testclient import TestClient

from splitserve.components.frontend.app import FrontendState, build_app
from splitserve.components.worker.registry import request_params_of
from splitserve.contracts.wire import output_chunk

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}}]


class ScriptedBackend:
    """Streams ``reply``'s tokens; records the worker requests."""

    def __init__(self, codec, reply: str) -> None:
        self.ids = codec.prompt_ids(reply)
        self.requests: list[dict] = []

    def ready(self) -> bool:
        return True

    async def stream(self, call, meta, context):
        request = call.to_wire()  # what the worker would receive
        self.requests.append(request)
        n = min(len(self.ids), request["stop_conditions"]["max_tokens"])
        for i, t in enumerate(self.ids[:n]):
            await asyncio.sleep(0)
            last = i == n - 1
            yield output_chunk([t], ("eos" if n == len(self.ids) else "length") if last
                               else None, prompt_tokens=len(request["token_ids"]) if last
                               else None, completion_tokens=n if last else None)


def scripted(codec, reply: str, engines=("torch",), tool_call_parser: str | None = "hermes",
             reasoning_parser: str | None = None) -> tuple[TestClient, ScriptedBackend]:
    backend = ScriptedBackend(codec, reply)
    state = FrontendState(model_name=MODEL, codec=codec, backend=backend,
                          engines=request_params_of(engines),
                          tool_call_parser=tool_call_parser,
                          reasoning_parser=reasoning_parser)
    return TestClient(build_app(state)), backend


def sse_events(c: TestClient, path: str, body: dict) -> list[dict]:
    """The data of every event of a streamed answer (``[DONE]`` left out)."""
    with c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    return [json.loads(ln[6:]) for ln in lines if ln != "data: [DONE]"]
