"""Tool calling through the chat endpoint against a scripted backend: calls found by the
configured parser (streamed and not), forced calls sent to the engine as a JSON schema,
the history rendered for the template, and refusals by name."""

from __future__ import annotations

import json

import openai
import pytest

from splitserve.components.frontend.tools import ToolDef, forced_schema

from .scripted import MODEL, TOOLS, WEATHER, scripted, sse_events

pytestmark = pytest.mark.unit

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def chat(**extra):
    return {"model": MODEL, "messages": ASK, "max_tokens": 60, **extra}


def test_auto_call_is_parsed_into_message_tool_calls(codec):
    c, backend = scripted(codec, "Checking. " + CALL)
    body = c.post("/v1/chat/completions", json=chat(tools=TOOLS)).json()
    parsed = openai.types.chat.ChatCompletion.model_validate(body)
    ch = parsed.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Checking. "
    call = ch.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Paris"}
    prompt = codec.decode(backend.requests[0]["token_ids"])
    assert "<tools>" in prompt and '"get_weather"' in prompt  # described to the model
    assert "guided_decoding" not in backend.requests[0]["sampling_options"]


def test_streamed_calls_arrive_as_tool_call_deltas(codec):
    c, _ = scripted(codec, "Checking. " + CALL)
    chunks = [openai.types.chat.ChatCompletionChunk.model_validate(e)
              for e in sse_events(c, "/v1/chat/completions", chat(tools=TOOLS))]
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    pieces = [tc for ch in chunks for tc in ch.choices[0].delta.tool_calls or []]
    assert content == "Checking. " and {tc.index for tc in pieces} == {0}
    first = pieces[0]  # the call's id and name, then its arguments as they stream
    assert first.id.startswith("call_") and first.function.name == "get_weather"
    assert all(tc.id is None and tc.function.name is None for tc in pieces[1:])
    arguments = "".join(tc.function.arguments or "" for tc in pieces)
    assert json.loads(arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_hides_the_tools_and_parses_nothing(codec):
    c, backend = scripted(codec, CALL)
    body = c.post("/v1/chat/completions", json=chat(tools=TOOLS, tool_choice="none")).json()
    assert body["choices"][0]["message"]["content"] == CALL
    assert "tool_calls" not in body["choices"][0]["message"]
    assert "<tools>" not in codec.decode(backend.requests[0]["token_ids"])


def test_named_and_required_calls_are_forced_by_a_schema(codec):
    named = {"type": "function", "function": {"name": "get_weather"}}
    c, backend = scripted(codec, '{"city": "Paris"}', tool_call_parser=None)
    body = c.post("/v1/chat/completions", json=chat(tools=TOOLS, tool_choice=named)).json()
    assert backend.requests[0]["sampling_options"]["guided_decoding"] == {"json": WEATHER}
    call = body["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    c, backend = scripted(codec, '[{"name": "get_weather", "arguments": {"city": "Rome"}}]',
                          tool_call_parser=None)
    body = c.post("/v1/chat/completions", json=chat(tools=TOOLS, tool_choice="required",
                                                     parallel_tool_calls=False)).json()
    schema = backend.requests[0]["sampling_options"]["guided_decoding"]["json"]
    assert schema["maxItems"] == 1 and schema["items"]["properties"]["name"] == {
        "enum": ["get_weather"]}
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert json.loads(body["choices"][0]["message"]["tool_calls"][0]["function"][
        "arguments"]) == {"city": "Rome"}


def test_forced_schemas_compile_with_the_engines_grammar_compiler():
    import xgrammar as xgr

    tools = [ToolDef.model_validate(t) for t in TOOLS * 2]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        from splitserve.components.frontend.tools import NamedToolChoice

        c = NamedToolChoice.model_validate(choice) if isinstance(choice, dict) else choice
        xgr.Grammar.from_json_schema(json.dumps(forced_schema(tools, c, True)))


@pytest.mark.parametrize("engine", ["mocker"])
@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_engines_without_structured_output_refuse_forced_calls(codec, engine, choice):
    c, backend = scripted(codec, CALL, engines=(engine,))
    r = c.post("/v1/chat/completions", json=chat(tools=TOOLS, tool_choice=choice))
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "tool_choice" and engine in err["message"]
    assert backend.requests == []
    # auto is read by the frontend's parser: every engine serves it
    assert c.post("/v1/chat/completions", json=chat(tools=TOOLS)).status_code == 200


@pytest.mark.parametrize("extra, param", [
    ({"tools": TOOLS}, "tool_choice"),  # auto without a configured parser
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "no-such-type"}}}]}, "tools.0.function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
])
def test_bad_tool_requests_are_400_naming_the_parameter(codec, extra, param):
    c, backend = scripted(codec, CALL, tool_call_parser=None)
    r = c.post("/v1/chat/completions", json=chat(**extra))
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()
    assert backend.requests == []


def test_history_with_calls_and_results_is_rendered_in_the_parsers_format(codec):
    """A template without tools sees past calls as the Hermes format writes them."""
    c, backend = scripted(codec, "It is sunny in Paris.")
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    body = c.post("/v1/chat/completions", json=chat(messages=history, tools=TOOLS)).json()
    assert body["choices"][0]["message"]["content"] == "It is sunny in Paris."
    assert body["choices"][0]["finish_reason"] == "stop"
    prompt = codec.decode(backend.requests[0]["token_ids"])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "tool\nsunny, 21 C" in prompt


@pytest.fixture(scope="module")
def think_codec(smollm2_dir):
    """The served model's tokenizer with a reasoning model's <think> and </think> tokens
    (vLLM's deepseek_r1 parser finds them by id)."""
    from splitserve.components.frontend.textcodec import TextCodec

    from .families import THINK, family_tokenizer

    return TextCodec(family_tokenizer(str(smollm2_dir), tuple(THINK)), 2048)


def test_reasoning_content_is_split_streamed_and_not(think_codec):
    c, _ = scripted(think_codec, "<think>France's capital.</think>Paris.",
                    reasoning_parser="deepseek_r1")
    msg = c.post("/v1/chat/completions", json=chat()).json()["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("France's capital.", "Paris.")
    events = sse_events(c, "/v1/chat/completions", chat())
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "France's capital."
    assert "".join(d.get("content", "") for d in deltas) == "Paris."


def test_a_batch_of_one_token_list_is_a_prompt(codec):
    """lm-eval's local-completions sends ``prompt: [[ids]]``."""
    c, backend = scripted(codec, "Paris.")
    ids = codec.prompt_ids("The capital of France is")
    r = c.post("/v1/completions", json={"model": MODEL, "prompt": [ids], "max_tokens": 5})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Paris."
    assert backend.requests[0]["token_ids"] == ids


def test_schema_held_answers_are_not_split_as_reasoning(codec):
    """deepseek_r1 reads text before </think> as reasoning: a JSON answer has none."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    c, _ = scripted(codec, '{"city": "Paris"}', reasoning_parser="deepseek_r1")
    msg = c.post("/v1/chat/completions", json=chat(tools=TOOLS, tool_choice=named)).json()[
        "choices"][0]["message"]
    assert "reasoning_content" not in msg and msg["tool_calls"][0]["function"][
        "arguments"] == '{"city": "Paris"}'
    msg = c.post("/v1/chat/completions", json=chat(response_format={
        "type": "json_object"})).json()["choices"][0]["message"]
    assert msg["content"] == '{"city": "Paris"}' and "reasoning_content" not in msg


@pytest.fixture(scope="module")
def kimi_codec(smollm2_dir):
    """The served model's tokenizer with Kimi K2's tool-call markers as special tokens, as
    in Kimi's own tokenizer: a detokenizer that skips special tokens would drop them."""
    from transformers import AutoTokenizer

    from splitserve.components.frontend.textcodec import TextCodec

    from .families import KIMI

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.add_special_tokens({"additional_special_tokens": KIMI})
    return TextCodec(tok, 2048)


KIMI_CALL = ("Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
             '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
             "<|tool_calls_section_end|>")


def test_calls_marked_with_special_tokens_reach_the_parser(kimi_codec):
    c, _ = scripted(kimi_codec, KIMI_CALL, tool_call_parser="kimi_k2")
    msg = c.post("/v1/chat/completions", json=chat(tools=TOOLS)).json()["choices"][0][
        "message"]
    assert msg["content"] == "Checking." and len(msg["tool_calls"]) == 1
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    events = sse_events(c, "/v1/chat/completions", chat(tools=TOOLS))
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    arguments = "".join(tc["function"].get("arguments", "") for d in deltas
                        for tc in d.get("tool_calls", []))
    assert json.loads(arguments) == {"city": "Paris"}
    assert "".join(d.get("content") or "" for d in deltas) == "Checking."
    # Without tools the same markers are special tokens, skipped as before.
    plain = c.post("/v1/chat/completions", json=chat()).json()["choices"][0]["message"]
    assert "<|tool_call_begin|>" not in plain["content"]


@pytest.mark.parametrize("stream", [True, False])
def test_the_parser_reads_the_workers_token_ids_not_the_text_encoded_again(
        codec, monkeypatch, stream):
    """A delta's token ids come from the worker's chunk (as an engine's own server hands
    them to its parsers); the text is re-encoded only where it is not theirs alone."""
    from splitserve.components.frontend.chat_output import ChoiceOutput

    def no_encode(self, text):
        if text:
            raise AssertionError(f"re-encoded {text!r}")
        return []

    monkeypatch.setattr(ChoiceOutput, "_encode", no_encode)
    c, _ = scripted(codec, "Checking. " + CALL)
    if stream:
        events = sse_events(c, "/v1/chat/completions", chat(tools=TOOLS))
        calls = [tc for e in events if e["choices"]
                 for tc in e["choices"][0]["delta"].get("tool_calls") or []]
        arguments = "".join(tc["function"].get("arguments", "") for tc in calls)
    else:
        body = c.post("/v1/chat/completions", json=chat(tools=TOOLS)).json()
        calls = body["choices"][0]["message"]["tool_calls"]
        arguments = calls[0]["function"]["arguments"]
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(arguments) == {"city": "Paris"}
