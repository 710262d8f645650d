"""Tool-call and reasoning parsers on answers split at every possible point: streaming in
pieces gives what parsing the whole answer gives."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from splitserve.components.frontend.chat_output import ChoiceOutput, OutputPlan, fold
from splitserve.components.frontend.config import FrontendConfig
from splitserve.components.frontend.reasoning_parsers import REASONING_PARSERS
from splitserve.components.frontend.tool_parsers import TOOL_PARSERS, ParsedCall

pytestmark = pytest.mark.unit

PARIS = ParsedCall("get_weather", '{"city": "Paris"}')
ROME = ParsedCall("get_weather", '{"city": "Rome", "days": 2}')

# parser, answer, content, calls
CASES = [
    ("hermes", 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
     "</tool_call>", "Sure. ", [PARIS]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
     '</tool_call>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", '
     '"days": 2}}</tool_call>\n', "", [PARIS, ROME]),
    ("hermes", "No call here, just <tool text.", "No call here, just <tool text.", []),
    ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}', "",
     [PARIS]),  # cut before the closing tag, but whole
    ("hermes", '<tool_call>{"name": "get_weather", "argum', '<tool_call>{"name": '
     '"get_weather", "argum', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}', "", [PARIS, ROME]),
    ("llama3_json", "Paris is sunny.", "Paris is sunny.", []),
    ("llama3_json", "{not a call}", "{not a call}", []),
    ("pythonic", '[get_weather(city="Paris"), get_weather(city="Rome", days=2)]', "",
     [PARIS, ROME]),
    ("pythonic", "[1, 2]", "[1, 2]", []),
    ("pythonic", "It is [sunny].", "It is [sunny].", []),
]


def run(parser: str, pieces: list[str]) -> tuple[str, list[ParsedCall]]:
    p = TOOL_PARSERS[parser]()
    content, calls = "", []
    for piece in pieces:
        step = p.push(piece)
        content, calls = content + step.content, calls + step.calls
    step = p.finish()
    return content + step.content, calls + step.calls


@pytest.mark.parametrize("parser, answer, content, calls", CASES)
def test_parsers_split_content_and_calls_wherever_the_text_is_cut(parser, answer, content,
                                                                  calls):
    assert run(parser, [answer]) == (content, calls)
    for cut in range(1, len(answer)):
        assert run(parser, [answer[:cut], answer[cut:]]) == (content, calls), cut
    assert run(parser, list(answer)) == (content, calls)


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_rendered_calls_parse_back(parser):
    cls = TOOL_PARSERS[parser]
    assert run(parser, [cls.render_calls([PARIS, ROME])]) == ("", [PARIS, ROME])
    assert "get_weather" in cls.instructions([{"name": "get_weather", "parameters": {}}])


THINK = [
    ("deepseek_r1", "<think>a plan</think>\n\nParis.", "a plan", "Paris."),
    ("deepseek_r1", "a plan</think>Paris.", "a plan", "Paris."),
    ("deepseek_r1", "still thinking", "still thinking", ""),
    ("qwen3", "<think>a plan</think>Paris.", "a plan", "Paris."),
    ("qwen3", "Paris, no thinking.", "", "Paris, no thinking."),
    ("qwen3", "<thin", "", "<thin"),
]


@pytest.mark.parametrize("name, answer, reasoning, content", THINK)
def test_reasoning_is_split_wherever_the_text_is_cut(name, answer, reasoning, content):
    for cut in range(len(answer) + 1):
        p = REASONING_PARSERS[name]()
        parts = [p.push(answer[:cut]), p.push(answer[cut:]), p.finish()]
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == (
            reasoning, content), cut


def choice(plan: OutputPlan, pieces: list[str]):
    out = ChoiceOutput(plan)
    deltas = [out.push(p) for p in pieces] + [out.finish()]
    return fold(deltas), out


def test_reasoning_then_calls_in_one_answer():
    plan = OutputPlan(mode="auto", tool_parser="hermes", reasoning_parser="deepseek_r1")
    answer = ('<think>need weather</think>On it.<tool_call>{"name": "get_weather", '
              '"arguments": {"city": "Paris"}}</tool_call>')
    whole, out = choice(plan, list(answer))
    assert (whole.reasoning, whole.content) == ("need weather", "On it.")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in whole.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert out.called and whole.tool_calls[0]["id"].startswith("call_")


def test_forced_calls_are_read_as_json_without_a_parser():
    named, _ = choice(OutputPlan(mode="named", named="get_weather"), ['{"city":', ' "Paris"}'])
    assert named.tool_calls[0]["function"] == {"name": "get_weather",
                                               "arguments": '{"city": "Paris"}'}
    required, _ = choice(OutputPlan(mode="required"),
                         ['[{"name": "get_weather", "arguments": {"city": "Paris"}}, ',
                          '{"name": "now", "arguments": {}}]'])
    assert [c["function"]["name"] for c in required.tool_calls] == ["get_weather", "now"]
    cut, out = choice(OutputPlan(mode="required"), ['[{"name": "get_weather", "argu'])
    assert cut.content == '[{"name": "get_weather", "argu' and not out.called


def test_parallel_tool_calls_false_keeps_the_first_call():
    answer = run("hermes", [TOOL_PARSERS["hermes"].render_calls([PARIS, ROME])])
    assert len(answer[1]) == 2
    whole, _ = choice(OutputPlan(mode="auto", tool_parser="hermes", parallel=False),
                      [TOOL_PARSERS["hermes"].render_calls([PARIS, ROME])])
    assert [c["function"]["arguments"] for c in whole.tool_calls] == [PARIS.arguments]


@pytest.mark.parametrize("field", ["tool_call_parser", "reasoning_parser"])
def test_unknown_parser_names_are_refused_naming_the_field(field):
    with pytest.raises(ValidationError) as err:
        FrontendConfig(**{field: "no-such-parser"})
    assert err.value.errors()[0]["loc"] == (field,)
    assert "known:" in str(err.value)
    assert getattr(FrontendConfig(**{field: None}), field) is None
