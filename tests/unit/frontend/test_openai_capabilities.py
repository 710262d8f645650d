"""The OpenAI surface against a scripted backend: parameters refused by engine name from
the capability table, the wire mapping of sampling fields, ``n`` fan-out, echo and
log-probabilities in OpenAI's shapes."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.testclient import TestClient

from splitserve.components.frontend.app import FrontendState, build_app
from splitserve.components.frontend.capabilities import (
    CAPABILITIES,
    ENGINE,
    capabilities,
    graph_engines,
)
from splitserve.components.worker.registry import request_params_of
from splitserve.contracts.engine import ENGINE_PARAMS
from splitserve.contracts.wire import TokenLogprobs, WorkerRequest, output_chunk
from splitserve.components.engines.torch_cpu.adapter import torch_request
from splitserve.components.worker.wire import params_from_wire

pytestmark = pytest.mark.unit

MODEL = "SmolLM2-135M-Instruct"


class LogprobBackend:
    """Streams ``reply``'s tokens one per chunk with made-up log-probabilities
    (-0.1 * position), prompt log-probabilities on the first chunk when asked."""

    def __init__(self, codec, reply: str = "Paris is nice.") -> None:
        self.ids = codec.prompt_ids(reply)
        self.requests: list[dict] = []

    def ready(self) -> bool:
        return True

    async def stream(self, call, meta, context):
        request = call.to_wire()  # what the worker would receive
        self.requests.append(request)
        wreq = WorkerRequest.model_validate(request)
        top_n, prompt_n = wreq.output_options.logprobs, wreq.output_options.prompt_logprobs
        n = min(len(self.ids), wreq.stop_conditions.max_tokens)
        for i, t in enumerate(self.ids[:n]):
            await asyncio.sleep(0)
            lps = prompt = None
            if top_n is not None:
                lps = TokenLogprobs(logprobs=[-0.1 * i],
                                    top=[[(t, -0.1 * i), (7, -3.0)][:top_n]])
            if prompt_n is not None and i == 0:
                k = len(wreq.token_ids) - 1
                prompt = TokenLogprobs(logprobs=[-1.0] * k, top=[[(7, -0.5)][:prompt_n]] * k)
            last = i == n - 1
            yield output_chunk([t], ("eos" if n == len(self.ids) else "length") if last else None,
                               prompt_tokens=len(wreq.token_ids) if last else None,
                               completion_tokens=n if last else None,
                               logprobs=lps, prompt_logprobs=prompt)


def client(codec, engines=("torch",)) -> tuple[TestClient, LogprobBackend]:
    backend = LogprobBackend(codec)
    state = FrontendState(model_name=MODEL, codec=codec, backend=backend,
                          engines=request_params_of(engines))
    return TestClient(build_app(state)), backend


def chat(**extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20,
            **extra}


def comp(**extra):
    return {"model": MODEL, "prompt": "The capital", "max_tokens": 20, **extra}


def sse(c, path, body) -> list[dict]:
    with c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


HONOURED_BY_TORCH = [
    ("chat", "presence_penalty", 0.5), ("chat", "frequency_penalty", -1.0),
    ("chat", "repetition_penalty", 1.2), ("chat", "logit_bias", {"5": -100}),
    ("chat", "top_k", 5), ("chat", "min_p", 0.1), ("chat", "min_tokens", 2),
    ("chat", "seed", 3), ("chat", "logprobs", True), ("completion", "logprobs", 2),
]


@pytest.mark.parametrize("kind, name, value", HONOURED_BY_TORCH)
def test_parameters_the_mocker_cannot_honour_are_refused_naming_it(codec, kind, name, value):
    c, backend = client(codec, engines=("mocker",))
    path, body = (("/v1/chat/completions", chat(**{name: value})) if kind == "chat"
                  else ("/v1/completions", comp(**{name: value})))
    r = c.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == name and err["code"] == "unsupported_parameter"
    assert "mocker" in err["message"] and name in err["message"]
    assert backend.requests == []
    # the same request is served by the torch engine
    c, _ = client(codec, engines=("torch",))
    assert c.post(path, json=body).status_code == 200


def test_a_mixed_graph_refuses_what_one_engine_lacks(codec):
    c, _ = client(codec, engines=("torch", "trtllm"))
    r = c.post("/v1/chat/completions", json=chat(logit_bias={"3": 1}))
    assert r.status_code == 400 and "trtllm" in r.json()["error"]["message"]


def test_no_op_values_pass_on_every_engine(codec):
    c, _ = client(codec, engines=("mocker",))
    body = chat(n=1, presence_penalty=0, frequency_penalty=0.0, logit_bias={}, logprobs=False,
                top_k=-1, min_p=0, min_tokens=0, repetition_penalty=1)
    assert c.post("/v1/chat/completions", json=body).status_code == 200


@pytest.mark.parametrize("name, value, default", [
    ("store", True, False), ("verbosity", "low", "medium"),
    ("service_tier", "flex", "auto"), ("service_tier", "priority", "default"),
])
def test_what_no_engine_here_can_honour_is_refused_and_its_default_passes(
        codec, name, value, default):
    """Storing completions, the answer's verbosity and a service tier: nothing here keeps
    or applies them, so only their defaults (or leaving them out) are served."""
    c, backend = client(codec, engines=("torch",))
    r = c.post("/v1/chat/completions", json=chat(**{name: value}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == name and err["code"] == "unsupported_parameter"
    assert backend.requests == []
    assert c.post("/v1/chat/completions", json=chat(**{name: default})).status_code == 200


@pytest.mark.parametrize("body, param", [
    (chat(top_logprobs=2), "top_logprobs"), (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (chat(n=0), "n"), (chat(presence_penalty=2.5), "presence_penalty"),
    (chat(logit_bias={"x": 1}), "logit_bias"), (chat(logit_bias={"5": 101}), "logit_bias"),
    (chat(logit_bias={"999999": 1}), "logit_bias"), (chat(min_tokens=-1), "min_tokens"),
    (chat(logit_bias={"\u00b2": 1}), "logit_bias"),
])
def test_invalid_values_are_400_naming_the_parameter(codec, body, param):
    c, _ = client(codec)
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == param


def test_the_rows_engines_serve_are_the_parameters_engines_declare():
    for cap in CAPABILITIES:
        assert cap.endpoints and cap.served_by in ("frontend", "engine", "nobody")
    assert {c.param for c in CAPABILITIES if c.served_by == ENGINE} == set(ENGINE_PARAMS)
    assert {c.param for c in capabilities("completion")} >= {"echo", "logprobs", "n"}
    params = {c.param for c in CAPABILITIES}
    for name, declared in request_params_of(["torch", "vllm", "sglang", "trtllm",
                                             "mocker"]).items():
        assert set(declared.notes) <= params, name  # a note for a row of the table


def test_wire_carries_sampling_to_the_engines(codec):
    c, backend = client(codec)
    body = chat(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.1,
                logit_bias={"17": -100}, top_k=4, min_p=0.05, min_tokens=3, seed=11,
                max_completion_tokens=9, logprobs=True, top_logprobs=2, temperature=0.5)
    assert c.post("/v1/chat/completions", json=body).status_code == 200
    wreq = WorkerRequest.model_validate(backend.requests[0])
    assert wreq.stop_conditions.max_tokens == 9 and wreq.stop_conditions.min_tokens == 3
    p = params_from_wire(wreq)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, 0.25, 1.1)
    assert (p.top_k, p.min_p, p.min_tokens, p.seed) == (4, 0.05, 3, 11)
    assert p.logit_bias == ((17, -100.0),) and p.logprobs == 2 and p.prompt_logprobs is None
    req = torch_request("r1", params_from_wire(wreq))
    assert (req.presence_penalty, req.frequency_penalty, req.repetition_penalty,
            req.top_k, req.min_p, req.min_tokens, req.logprobs) == (0.5, 0.25, 1.1, 4, 0.05,
                                                                   3, 2)
    assert req.logit_bias == ((17, -100.0),) and req.temperature == 0.5


def test_prefill_jobs_carry_the_sampling_but_not_logprobs_or_a_schema():
    from splitserve.components.worker.coordinator import job_carries

    base = {"token_ids": [1, 2], "stop_conditions": {"max_tokens": 4, "min_tokens": 2},
            "sampling_options": {"temperature": 0.7, "seed": 1}}
    assert job_carries(params_from_wire(WorkerRequest.model_validate(base)))
    for extra in ({"sampling_options": {"logit_bias": {"3": -100}}},
                  {"sampling_options": {"presence_penalty": 0.5, "top_k": 5}}):
        wreq = WorkerRequest.model_validate({**base, **extra})
        assert job_carries(params_from_wire(wreq))  # the job carries them since R5
    for extra in ({"output_options": {"logprobs": 0}},
                  {"output_options": {"prompt_logprobs": 1}},
                  {"sampling_options": {"guided_decoding": {"json": {"type": "object"}}}}):
        wreq = WorkerRequest.model_validate({**base, **extra})
        assert not job_carries(params_from_wire(wreq))


def test_an_old_request_maps_to_neutral_sampling():
    wreq = WorkerRequest.model_validate({"token_ids": [1, 2], "stop_conditions":
                                         {"max_tokens": 4}})
    p = params_from_wire(wreq)
    assert p.neutral_sampling() and p.logprobs is None and p.min_tokens == 0


def test_n_fans_out_with_distinct_seeds_and_merges(codec):
    c, backend = client(codec)
    r = c.post("/v1/chat/completions", json=chat(n=3, seed=5))
    body = r.json()
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2]
    assert all(ch["message"]["content"] == "Paris is nice." for ch in body["choices"])
    seeds = sorted(q["sampling_options"]["seed"] for q in backend.requests)
    assert seeds == [5, 6, 7]
    ids = {q["extra_args"]["splitserve"]["request_id"] for q in backend.requests}
    assert len(ids) == 3
    assert body["usage"]["completion_tokens"] == 3 * len(backend.ids)
    assert body["usage"]["prompt_tokens"] == len(backend.requests[0]["token_ids"])


def test_n_streams_every_choice_and_usage(codec):
    c, backend = client(codec)
    events = sse(c, "/v1/completions", comp(n=2, stream_options={"include_usage": True}))
    by_index: dict[int, str] = {0: "", 1: ""}
    finishes = {}
    for e in events[:-1]:
        (ch,) = e["choices"]
        by_index[ch["index"]] += ch["text"]
        if ch["finish_reason"]:
            finishes[ch["index"]] = ch["finish_reason"]
    assert by_index == {0: "Paris is nice.", 1: "Paris is nice."}
    assert finishes == {0: "stop", 1: "stop"}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 2 * len(
        backend.ids)


def test_chat_logprobs_shape(codec):
    c, backend = client(codec)
    body = c.post("/v1/chat/completions", json=chat(logprobs=True, top_logprobs=2)).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == len(backend.ids)
    first = content[0]
    assert set(first) == {"token", "logprob", "bytes", "top_logprobs"}
    assert first["token"] == codec.decode([backend.ids[0]])
    assert first["bytes"] == list(first["token"].encode())
    assert content[1]["logprob"] == pytest.approx(-0.1)
    assert [t["logprob"] for t in first["top_logprobs"]] == [0.0, -3.0]
    assert "".join(e["token"] for e in content) == "Paris is nice."
    assert backend.requests[0]["output_options"] == {"logprobs": 2}


def test_chat_logprobs_streamed(codec):
    c, backend = client(codec)
    events = sse(c, "/v1/chat/completions", chat(logprobs=True))
    entries = [x for e in events for x in (e["choices"][0]["logprobs"] or {}).get("content")
               or []]
    assert len(entries) == len(backend.ids)
    assert all(x["top_logprobs"] == [] for x in entries)


def test_completion_logprobs_and_echo(codec):
    c, backend = client(codec)
    body = c.post("/v1/completions", json=comp(logprobs=1, echo=True)).json()
    ch = body["choices"][0]
    assert ch["text"] == "The capital" + "Paris is nice."
    lp = ch["logprobs"]
    n_prompt = len(backend.requests[0]["token_ids"])
    assert len(lp["tokens"]) == n_prompt + len(backend.ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1] == -1.0
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    assert "".join(lp["tokens"]) == ch["text"]
    assert backend.requests[0]["output_options"] == {"logprobs": 1, "prompt_logprobs": 1}


def test_completion_logprobs_streamed_without_echo(codec):
    c, backend = client(codec)
    events = sse(c, "/v1/completions", comp(logprobs=0))
    tokens = [t for e in events if e["choices"][0]["logprobs"]
              for t in e["choices"][0]["logprobs"]["tokens"]]
    assert "".join(tokens) == "Paris is nice."
    offsets = [o for e in events if e["choices"][0]["logprobs"]
               for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert offsets[0] == 0 and offsets == sorted(offsets)


def test_echo_without_logprobs_prepends_the_prompt(codec):
    c, _ = client(codec, engines=("mocker",))
    body = c.post("/v1/completions", json=comp(echo=True)).json()
    assert body["choices"][0]["text"].startswith("The capital")
    assert body["choices"][0]["logprobs"] is None


def test_vllm_gets_every_sampling_field_and_returns_logprobs():
    from types import SimpleNamespace

    from vllm.logprobs import Logprob

    from splitserve.components.engines.vllm.requests import sampling_params, to_delta

    wreq = WorkerRequest.model_validate({
        "token_ids": [5, 6, 7], "stop_conditions": {"max_tokens": 4, "min_tokens": 2},
        "sampling_options": {"presence_penalty": 0.5, "frequency_penalty": 0.25,
                             "repetition_penalty": 1.1, "top_k": 3, "min_p": 0.05,
                             "logit_bias": {"9": -100}},
        "output_options": {"logprobs": 1, "prompt_logprobs": 0}})
    sp = sampling_params(params_from_wire(wreq))
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, 0.25,
                                                                                  1.1)
    assert (sp.top_k, sp.min_p, sp.min_tokens) == (3, 0.05, 2)
    assert sp.logit_bias == {9: -100.0} and (sp.logprobs, sp.prompt_logprobs) == (1, 0)
    comp = SimpleNamespace(token_ids=[8], finish_reason=None, logprobs=[
        {8: Logprob(-0.5, rank=2), 4: Logprob(-0.1, rank=1)}])
    out = SimpleNamespace(outputs=[comp], finished=False, prompt_token_ids=[5, 6, 7],
                          num_cached_tokens=0,
                          prompt_logprobs=[None, {6: Logprob(-2.0, rank=5)},
                                           {7: Logprob(-1.0, rank=1)}])
    d = to_delta(out, 1, 0)
    assert d.logprobs.logprobs == [-0.5] and d.logprobs.top == [[(4, -0.1)]]
    assert d.prompt_logprobs.logprobs == [-2.0, -1.0] and d.prompt_logprobs.top == [[], []]


def test_response_format_goes_to_the_engine_as_a_schema(codec):
    c, backend = client(codec)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "A", "schema": schema,
                                                  "strict": True}}
    assert c.post("/v1/chat/completions", json=chat(response_format=fmt)).status_code == 200
    wreq = WorkerRequest.model_validate(backend.requests[0])
    assert wreq.sampling_options.guided_decoding.json_schema == schema
    assert json.loads(params_from_wire(wreq).json_schema) == schema
    assert torch_request("r", params_from_wire(wreq)).json_schema == params_from_wire(wreq).json_schema
    c.post("/v1/chat/completions", json=chat(response_format={"type": "json_object"}))
    assert backend.requests[1]["sampling_options"]["guided_decoding"] == {
        "json": {"type": "object"}}
    c.post("/v1/chat/completions", json=chat(response_format={"type": "text"}))
    assert "guided_decoding" not in backend.requests[2]["sampling_options"]


@pytest.mark.parametrize("fmt", [{"type": "json_schema"}, {"type": "xml"},
                                 {"type": "json_schema", "json_schema": {"schema": {}}},
                                 {"type": "json_schema", "json_schema": {
                                     "name": "A", "schema": {"type": "no-such-type"}}}])
def test_malformed_response_format_is_400(codec, fmt):
    c, _ = client(codec)
    r = c.post("/v1/chat/completions", json=chat(response_format=fmt))
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("response_format")


def test_response_format_is_refused_by_engines_without_structured_output(codec):
    c, _ = client(codec, engines=("mocker",))
    r = c.post("/v1/chat/completions", json=chat(response_format={"type": "json_object"}))
    assert r.status_code == 400 and "mocker" in r.json()["error"]["message"]


@pytest.mark.parametrize("engine", ["sglang", "trtllm"])
@pytest.mark.parametrize("extra", [{"response_format": {"type": "json_object"}},
                                   {"logprobs": True, "top_logprobs": 2}])
def test_sglang_and_trtllm_are_sent_schemas_and_logprob_requests(codec, engine, extra):
    c, backend = client(codec, engines=(engine,))
    assert c.post("/v1/chat/completions", json=chat(**extra)).status_code == 200
    assert len(backend.requests) == 1


def test_sglang_and_trtllm_get_the_schema_and_logprobs_in_their_own_form():
    from splitserve.components.engines.sglang.requests import generate_kwargs
    from splitserve.components.engines.trtllm.requests import guided_kwargs, sampling_kwargs

    wreq = WorkerRequest.model_validate({
        "token_ids": [1], "stop_conditions": {"max_tokens": 3},
        "sampling_options": {"guided_decoding": {"json": {"type": "object"}}},
        "output_options": {"logprobs": 2}})
    p = params_from_wire(wreq)
    kw = generate_kwargs("r", p)
    assert json.loads(kw["sampling_params"]["json_schema"]) == {"type": "object"}
    assert (kw["return_logprob"], kw["top_logprobs_num"]) == (True, 2)
    assert json.loads(guided_kwargs(p)["json"]) == {"type": "object"}
    assert sampling_kwargs(p)["logprobs"] == 2


def test_vllm_gets_the_schema_as_structured_outputs():
    from splitserve.components.engines.vllm.requests import sampling_params

    wreq = WorkerRequest.model_validate({"token_ids": [1], "stop_conditions": {"max_tokens": 3},
                                         "sampling_options": {"guided_decoding": {
                                             "json": {"type": "object"}}}})
    sp = sampling_params(params_from_wire(wreq))
    assert sp.structured_outputs.json == {"type": "object"}


def test_sglang_and_trtllm_get_the_penalties_they_take():
    from splitserve.components.engines.sglang.requests import sampling_params as sglang_params
    from splitserve.components.engines.trtllm.requests import sampling_kwargs

    wreq = WorkerRequest.model_validate({
        "token_ids": [1], "stop_conditions": {"max_tokens": 3, "min_tokens": 1},
        "sampling_options": {"presence_penalty": 0.5, "repetition_penalty": 1.2,
                             "top_k": 4, "min_p": 0.1, "logit_bias": {"7": 2.0}}})
    p = params_from_wire(wreq)
    sp = sglang_params(p)
    assert (sp["presence_penalty"], sp["repetition_penalty"], sp["top_k"], sp["min_p"],
            sp["min_new_tokens"], sp["logit_bias"]) == (0.5, 1.2, 4, 0.1, 1, {"7": 2.0})
    assert "frequency_penalty" not in sp
    kw = sampling_kwargs(p)
    assert (kw["presence_penalty"], kw["repetition_penalty"], kw["top_k"], kw["min_p"],
            kw["min_tokens"]) == (0.5, 1.2, 4, 0.1, 1)
    neutral = sampling_kwargs(params_from_wire(WorkerRequest.model_validate(
        {"token_ids": [1], "stop_conditions": {"max_tokens": 3}})))
    assert not {"top_k", "min_p", "presence_penalty", "repetition_penalty"} & set(neutral)


def test_closing_a_fan_out_closes_every_choice():
    from splitserve.components.frontend.pipeline import merged
    from splitserve.components.frontend.responses import Event

    closed: list[int] = []

    async def choice(i: int):
        try:
            yield Event(i, "x", None)
            await asyncio.sleep(3600)
        finally:
            closed.append(i)

    async def main():
        events = merged([choice(0), choice(1)])
        got = [await events.__anext__(), await events.__anext__()]
        await events.aclose()
        return got

    got = asyncio.run(main())
    assert sorted(e.index for e in got) == [0, 1] and sorted(closed) == [0, 1]


@pytest.mark.parametrize("engine", ["torch", "mocker"])
def test_the_plan_tells_the_frontend_its_engines(tmp_path, engine):
    from splitserve.serve.graph import load_graph
    from splitserve.serve.plan import build_plan

    graph = load_graph("graphs.agg:Frontend")
    plan = build_plan(graph, "graphs.agg:Frontend", {"Worker": {"engine": engine}}, "<test>")
    rc = plan.run_config(plan.component("Frontend"), 0, tmp_path / "s.json")
    assert rc.engines == [engine]
    # what the frontend decides with: the engine's own declaration, through the file
    again = type(rc).model_validate_json(rc.model_dump_json())
    assert graph_engines(again) == request_params_of([engine])


def test_other_choices_start_after_the_first_choice_has_its_prompt_cached(codec):
    c, backend = client(codec)
    order: list[str] = []
    stream = backend.stream

    async def traced(request, meta, context):
        order.append(f"start {meta.request_id[-2:]}")
        async for chunk in stream(request, meta, context):
            order.append(f"chunk {meta.request_id[-2:]}")
            yield chunk

    backend.stream = traced
    body = c.post("/v1/chat/completions", json=chat(n=3, max_tokens=2)).json()
    assert len(body["choices"]) == 3
    assert order[:2] == [order[0], order[0].replace("start", "chunk")]
    assert sum(o.startswith("start") for o in order) == 3
