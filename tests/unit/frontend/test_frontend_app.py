"""The OpenAI HTTP app against a scripted backend: formats, errors, stops, timeouts."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.testclient import TestClient

from splitserve.components.frontend.app import FrontendState, build_app
from splitserve.components.frontend.errors import overloaded
from splitserve.components.frontend.textcodec import TextCodec

pytestmark = pytest.mark.unit

MODEL = "SmolLM2-135M-Instruct"


class ScriptedBackend:
    """Streams the tokens of ``reply`` one per chunk, then a finish reason."""

    def __init__(self, codec: TextCodec, reply: str = "The capital of France is Paris.",
                 finish: str = "eos", delay_s: float = 0.0, fail: Exception | None = None,
                 stall_after: int | None = None) -> None:
        self.ids = codec.prompt_ids(reply)
        self.finish, self.delay_s, self.fail, self.stall_after = finish, delay_s, fail, stall_after
        self.requests: list[dict] = []
        self.up = True

    def ready(self) -> bool:
        return self.up

    async def stream(self, call, meta, context):
        request = call.to_wire()  # what the worker would receive
        self.requests.append(request)
        if self.fail:
            raise self.fail
        n = min(len(self.ids), request["stop_conditions"]["max_tokens"])
        for i, t in enumerate(self.ids[:n]):
            if self.stall_after is not None and i >= self.stall_after:
                await asyncio.sleep(3600)
            await asyncio.sleep(self.delay_s)
            last = i == n - 1
            chunk = {"token_ids": [t]}
            if last:
                chunk["finish_reason"] = self.finish if n == len(self.ids) else "length"
                chunk["completion_usage"] = {"prompt_tokens": 5, "completion_tokens": n,
                                             "prompt_tokens_details": {"cached_tokens": 3}}
            yield chunk


@pytest.fixture(scope="module")
def codec(smollm2_dir) -> TextCodec:
    return TextCodec.from_dir(smollm2_dir)


def client_for(codec, **kw) -> tuple[TestClient, ScriptedBackend, FrontendState]:
    backend = ScriptedBackend(codec, **{k: v for k, v in kw.items()
                                         if k in ("reply", "finish", "delay_s", "fail",
                                                  "stall_after")})
    state = FrontendState(model_name=MODEL, codec=codec, backend=backend,
                          **{k: v for k, v in kw.items() if k in (
                              "max_inflight", "first_token_timeout_s", "inter_token_timeout_s")})
    return TestClient(build_app(state)), backend, state


def chat_body(**extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Capital of France?"}],
            **extra}


def test_chat_non_streaming(codec):
    c, backend, _ = client_for(codec)
    r = c.post("/v1/chat/completions", json=chat_body(max_tokens=50, temperature=0))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == "The capital of France is Paris."
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(backend.ids)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 3
    sent = backend.requests[0]
    assert sent["sampling_options"]["temperature"] == 0
    assert sent["token_ids"] == codec.chat_ids([{"role": "user", "content": "Capital of France?"}])


def test_chat_streaming_sse_and_usage(codec):
    c, backend, _ = client_for(codec)
    with c.stream("POST", "/v1/chat/completions",
                  json=chat_body(stream=True, stream_options={"include_usage": True})) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == "The capital of France is Paris."
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    finals = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
    assert finals[-1] == "stop" and all(f is None for f in finals[:-1])
    assert events[-1]["usage"]["completion_tokens"] == len(backend.ids)


def test_completion_and_length_finish(codec):
    c, _, _ = client_for(codec)
    r = c.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 3})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3


def test_stop_string_truncates_and_stops_worker(codec):
    c, _, _ = client_for(codec)
    r = c.post("/v1/chat/completions", json=chat_body(stop=["is Par"]))
    body = r.json()
    assert body["choices"][0]["message"]["content"] == "The capital of France "
    assert body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("payload, status, code, param", [
    (b"{not json", 400, "invalid_json", None),
    (b"[1, 2]", 400, "invalid_json", None),
    (chat_body(model="gpt-4"), 404, "model_not_found", "model"),
    (chat_body(messages=[]), 400, "invalid_value", "messages"),
    (chat_body(max_tokens=0), 400, "invalid_value", "max_tokens"),
    (chat_body(max_tokens=-5), 400, "invalid_value", "max_tokens"),
    (chat_body(max_tokens="10"), 400, "invalid_value", "max_tokens"),
    (chat_body(temperature="hot"), 400, "invalid_value", "temperature"),
    (chat_body(temperature=3.0), 400, "invalid_value", "temperature"),
    (chat_body(messages="hi"), 400, "invalid_value", "messages"),
    (chat_body(messages=[{"role": "wizard", "content": "x"}]), 400, "invalid_value",
     "messages.0.role"),
    (chat_body(stream="yes"), 400, "invalid_value", "stream"),
    (chat_body(max_tokens=100000), 400, "context_length_exceeded", "messages"),
    ({"messages": [{"role": "user", "content": "x"}]}, 400, "invalid_value", "model"),
])
def test_bad_input_is_400_openai_style(codec, payload, status, code, param):
    c, _, _ = client_for(codec)
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    r = c.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["param"] == param and err["message"]
    # the server keeps serving
    assert c.post("/v1/chat/completions", json=chat_body()).status_code == 200


def test_prompt_longer_than_context(codec):
    c, _, _ = client_for(codec)
    long = "word " * (codec.context_length + 10)
    r = c.post("/v1/completions", json={"model": MODEL, "prompt": long})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_overload_is_503_with_retry_after(codec):
    c, _, state = client_for(codec, max_inflight=1)
    state.inflight = 1  # one request already in flight
    r = c.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "server_overloaded"


def test_a_saturated_event_loop_refuses_new_requests(codec):
    from splitserve.components.frontend.loop_lag import LoopLag

    c, _, state = client_for(codec)
    state.loop_lag, state.max_loop_lag_s = LoopLag(), 1.0
    state.loop_lag.lag_s = 1.5
    r = c.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert "event loop runs 1500 ms behind" in r.json()["error"]["message"]
    state.loop_lag.lag_s = 0.5
    assert c.post("/v1/chat/completions", json=chat_body()).status_code == 200
    state.max_loop_lag_s, state.loop_lag.lag_s = 0.0, 5.0  # 0: never refuses for it
    assert c.post("/v1/chat/completions", json=chat_body()).status_code == 200


def test_backend_rejection_passes_through(codec):
    c, _, _ = client_for(codec, fail=overloaded("no worker", 2, "no_workers"))
    r = c.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 503 and r.headers["retry-after"] == "2"


def test_stalled_worker_times_out_instead_of_hanging(codec):
    c, _, _ = client_for(codec, stall_after=2, inter_token_timeout_s=0.3)
    r = c.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 504 and r.json()["error"]["code"] == "worker_timeout"
    with c.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as s:
        lines = [ln for ln in s.iter_lines() if ln]
    assert any('"worker_timeout"' in ln for ln in lines) and lines[-1] == "data: [DONE]"


def test_models_health_metrics(codec):
    c, backend, state = client_for(codec)
    assert c.get("/v1/models").json()["data"][0]["id"] == MODEL
    assert c.get("/live").status_code == 200
    assert c.get("/ready").status_code == 200
    backend.up = False
    assert c.get("/ready").status_code == 503
    c.post("/v1/chat/completions", json=chat_body())
    m = c.get("/metrics").text
    assert "splitserve_frontend_requests_total" in m and "splitserve_frontend_ttft_seconds" in m
    assert c.get("/nope").json()["error"]["code"] == "not_found"


@pytest.mark.parametrize(("wire", "openai"), [
    ("eos", "stop"), ("stop", "stop"), ("length", "length"),
    ("content_filter", "stop"),  # a reason outside the vocabulary: a normal end, as before
])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_each_worker_finish_reason_has_one_openai_answer(codec, wire, openai, stream, kind):
    c, _, _ = client_for(codec, finish=wire)
    path, body = (("/v1/chat/completions", chat_body(stream=stream)) if kind == "chat" else
                  ("/v1/completions", {"model": MODEL, "prompt": "Hello", "stream": stream}))
    if not stream:
        r = c.post(path, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == openai
        return
    with c.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln and ln != "data: [DONE]"]
    finals = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
    assert finals[-1] == openai and all(f is None for f in finals[:-1])


def test_the_openai_mapping_covers_the_whole_vocabulary():
    from splitserve.components.frontend.responses import openai_finish_reason
    from splitserve.contracts.wire import FinishReason

    assert {r: openai_finish_reason(r) for r in FinishReason} == {
        FinishReason.EOS: "stop", FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
        FinishReason.CANCELLED: "stop", FinishReason.ERROR: "stop"}


@pytest.mark.parametrize("wire", ["error", "cancelled"])
def test_a_failed_or_cancelled_worker_answer_is_an_http_error(codec, wire):
    c, _, _ = client_for(codec, finish=wire)
    r = c.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 502 and "worker error" in r.json()["error"]["message"]
