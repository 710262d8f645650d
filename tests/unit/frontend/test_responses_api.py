"""The Responses API against a scripted backend: bodies and event streams parsed by the
official SDK's types, input items mapped onto the chat history, stateful parameters
refused by name."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from .scripted import MODEL, WEATHER, scripted, sse_events

pytestmark = pytest.mark.unit

TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
EVENTS = TypeAdapter(ResponseStreamEvent)


def body(**extra):
    return {"model": MODEL, "input": "Weather in Paris?", **extra}


def test_text_answer_is_a_response_the_sdk_parses(codec):
    c, backend = scripted(codec, "Paris is sunny.")
    r = c.post("/v1/responses", json=body(instructions="Be brief.", max_output_tokens=50,
                                          temperature=0.0))
    resp = Response.model_validate(r.json())
    assert resp.status == "completed" and resp.output_text == "Paris is sunny."
    assert resp.usage.input_tokens == len(backend.requests[0]["token_ids"])
    assert resp.usage.output_tokens == len(codec.prompt_ids("Paris is sunny."))
    assert codec.decode(backend.requests[0]["token_ids"]).startswith("system\nBe brief.")


def test_cut_at_max_output_tokens_is_incomplete(codec):
    c, _ = scripted(codec, "Paris is sunny and warm today.")
    resp = Response.model_validate(c.post("/v1/responses",
                                          json=body(max_output_tokens=2)).json())
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"


def test_function_call_items_and_the_official_event_sequence(codec):
    c, _ = scripted(codec, "Checking. " + CALL)
    resp = Response.model_validate(c.post("/v1/responses", json=body(tools=[TOOL])).json())
    assert [o.type for o in resp.output] == ["message", "function_call"]
    assert resp.output[1].name == "get_weather" and json.loads(
        resp.output[1].arguments) == {"city": "Paris"}
    events = [EVENTS.validate_python(e)
              for e in sse_events(c, "/v1/responses", body(tools=[TOOL]))]
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    args = "".join(e.delta for e in events
                   if e.type == "response.function_call_arguments.delta")
    assert text == "Checking. " and json.loads(args) == {"city": "Paris"}
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert done == ["message", "function_call"]
    assert events[-1].response.output[1].arguments == args


def test_input_items_become_the_chat_history(codec):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather",
              "arguments": '{"city": "Paris"}'},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    c, backend = scripted(codec, "It is sunny.")
    resp = c.post("/v1/responses", json=body(input=items, tools=[TOOL])).json()
    assert resp["output"][0]["content"][0]["text"] == "It is sunny."
    prompt = codec.decode(backend.requests[0]["token_ids"])
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "tool\nsunny" in prompt


def test_json_schema_text_format_is_forced(codec):
    c, backend = scripted(codec, '{"city": "Paris"}')
    fmt = {"type": "json_schema", "name": "place", "schema": WEATHER, "strict": True}
    resp = Response.model_validate(c.post("/v1/responses",
                                          json=body(text={"format": fmt})).json())
    assert backend.requests[0]["sampling_options"]["guided_decoding"] == {"json": WEATHER}
    assert json.loads(resp.output_text) == {"city": "Paris"}


@pytest.mark.parametrize("extra, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"store": True}, "store"), ({"conversation": "conv_1"}, "conversation"),
    ({"input": [{"type": "web_search_call"}]}, "input.0.type"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
     "input.0.content.0.type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
])
def test_what_a_stateless_server_cannot_do_is_refused_by_name(codec, extra, param):
    c, backend = scripted(codec, "x")
    r = c.post("/v1/responses", json=body(**extra))
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()
    assert backend.requests == []
    assert c.post("/v1/responses", json=body(store=False)).status_code == 200


@pytest.mark.parametrize("extra, engine, param", [
    ({"text": {"format": {"type": "json_object"}}}, "mocker", "text.format"),
    ({"tools": [TOOL], "tool_choice": "required"}, "mocker", "tool_choice"),
    ({"tools": [{**TOOL, "parameters": {"type": "no-such-type"}}]}, "torch",
     "tools.0.parameters"),
    ({"input": [{"role": "user", "content": ""}], "max_output_tokens": 100000}, "torch",
     "input"),
])
def test_errors_name_the_responses_parameter(codec, extra, engine, param):
    c, backend = scripted(codec, "x", engines=(engine,))
    r = c.post("/v1/responses", json=body(**extra))
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param, err
    if engine == "mocker":
        assert f"'{param}'" in err["message"] and "mocker" in err["message"]


def test_reasoning_is_an_item_of_its_own_streamed_and_not(codec):
    c, _ = scripted(codec, "<think>Recall.</think>Paris.", reasoning_parser="qwen3")
    resp = Response.model_validate(c.post("/v1/responses", json=body()).json())
    assert [o.type for o in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == "Recall." and resp.output_text == "Paris."
    events = [EVENTS.validate_python(e) for e in sse_events(c, "/v1/responses", body())]
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == "Recall." and [o.type for o in events[-1].response.output] == [
        "reasoning", "message"]
