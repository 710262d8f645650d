"""Model families' answers, as the models emit them, read by vLLM's parsers through the
frontend's output stage: streamed (one token, or a few, per delta) and whole give the same
reasoning, content and calls; formats chosen from chat templates; names checked."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from pydantic import ValidationError

from splitserve.components.frontend import formats
from splitserve.components.frontend.chat_input import output_plan
from splitserve.components.frontend.chat_output import ChoiceOutput, finish_reason, fold
from splitserve.components.frontend.config import FrontendConfig
from splitserve.components.frontend.openai_types import ChatCompletionRequest

from .families import PARIS, RECORDED, ROME, WEATHER_TOOLS, Recorded, tokenizer_for

pytestmark = pytest.mark.unit


def request(**extra) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "Weather?"}],
        "tools": WEATHER_TOOLS, **extra})


def read(case: Recorded, tok, stream: bool, group: int = 1, with_ids: bool = True,
         **extra):
    """The answer through a ChoiceOutput: ``group`` tokens per delta when streamed (with
    their ids, as the chat stream hands them over, or without: re-encoded from the text,
    as for a delta whose text is not its tokens' alone)."""
    plan = output_plan(request(stream=stream, **extra), case.tool, case.reasoning, tok)
    out = ChoiceOutput(plan)
    ids = tok.encode(case.text, add_special_tokens=False)
    deltas = []
    for i in range(0, len(ids), group):
        part = ids[i:i + group]
        text = tok.decode(part, skip_special_tokens=False)
        deltas.append(out.push(text, part if with_ids else None))
    deltas.append(out.finish())
    return fold(deltas), out


def calls_of(whole) -> tuple[tuple[str, dict], ...]:
    return tuple((c["function"]["name"], json.loads(c["function"]["arguments"]))
                 for c in whole.tool_calls)


@pytest.mark.parametrize("case", RECORDED, ids=[c.family for c in RECORDED])
def test_each_family_reads_the_same_streamed_and_whole(case, smollm2_dir):
    tok = tokenizer_for(str(smollm2_dir), case)
    for stream, group in ((False, 1), (True, 1), (True, 3)):
        whole, out = read(case, tok, stream, group)
        label = f"{case.family} stream={stream} group={group}"
        assert calls_of(whole) == case.calls, label
        assert whole.content.strip() == case.content, label
        assert whole.reasoning.strip() == case.thinking, label
        assert len({c["id"] for c in whole.tool_calls}) == len(case.calls), label
        assert finish_reason("stop", out) == ("tool_calls" if case.calls else "stop")
        assert finish_reason("length", out) == "length"


@pytest.mark.parametrize("case", [c for c in RECORDED if c.tool != "openai"],
                         ids=[c.family for c in RECORDED if c.tool != "openai"])
def test_text_only_deltas_are_re_encoded_for_the_parser(case, smollm2_dir):
    """A delta handed over as text only (held back for a stop string and released with
    later text) gets its token ids from the text."""
    tok = tokenizer_for(str(smollm2_dir), case)
    whole, _ = read(case, tok, True, with_ids=False)
    assert calls_of(whole) == case.calls and whole.content.strip() == case.content


@pytest.mark.parametrize("case", [c for c in RECORDED if len(c.calls) == 2],
                         ids=[c.family for c in RECORDED if len(c.calls) == 2])
def test_parallel_tool_calls_false_keeps_the_first_call(case, smollm2_dir):
    tok = tokenizer_for(str(smollm2_dir), case)
    for stream in (False, True):
        whole, out = read(case, tok, stream, parallel_tool_calls=False)
        assert calls_of(whole) == case.calls[:1] and out.calls == 1


def test_tool_choice_none_reads_calls_as_text(smollm2_dir):
    case = RECORDED[2]  # hermes, two calls
    whole, out = read(case, tokenizer_for(str(smollm2_dir), case), True, tool_choice="none")
    assert whole.tool_calls == [] and "<tool_call>" in whole.content and not out.called


def forced(text: str, parallel: bool = True):
    plan = output_plan(request(tool_choice="required", parallel_tool_calls=parallel),
                       "hermes", None, None)
    out = ChoiceOutput(plan)
    return fold([out.push(text), out.finish()]), out


def test_a_cut_off_required_answer_keeps_its_complete_calls():
    whole, out = forced('[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                        '{"name": "get_weather", "arguments": {"city": "Ro')
    assert calls_of(whole) == (PARIS,) and whole.content == ""
    assert finish_reason("length", out) == "length"
    whole, out = forced('[{"name": "get_weather", "argu')  # no complete call: text
    assert whole.tool_calls == [] and whole.content.startswith("[{")


def test_required_answers_honour_parallel_tool_calls():
    two = ('[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": '
           '"get_weather", "arguments": {"city": "Rome", "days": 2}}]')
    assert calls_of(forced(two)[0]) == (PARIS, ROME)
    assert calls_of(forced(two, parallel=False)[0]) == (PARIS,)


def test_the_required_schema_is_a_bounded_array():
    from splitserve.components.frontend.tools import MAX_PARALLEL_CALLS

    schema = request(tool_choice="required").forced_tool_schema()
    assert schema["maxItems"] == MAX_PARALLEL_CALLS and schema["minItems"] == 1
    assert request(tool_choice="required",
                   parallel_tool_calls=False).forced_tool_schema()["maxItems"] == 1


# Fragments of each family's chat template, as its tokenizer_config.json ships it.
TEMPLATES = [
    ("{{- '<|start|>assistant<|channel|>' }}{{ '<|call|>' }}", True, "openai",
     "openai_gptoss"),
    ("{% if tools %}<|tool_calls_section_begin|>{% endif %}", True, "kimi_k2", None),
    ("{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + "
     "'<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json'}}{{'<think>\\n'}}",
     True, "deepseek_v3", "deepseek_r1"),
    ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + "
     "'<｜tool▁sep｜>' + tool['function']['arguments']}}", True, "deepseek_v31", None),
    ("<tool_call>{{ tc.name }}<arg_key>{{ k }}</arg_key><arg_value>{{ v }}</arg_value>"
     "{% if enable_thinking %}<think>{% endif %}", True, "glm45", "glm45"),
    ("{%- if tools %}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{% endif %}"
     "[TOOL_CALLS]", True, "mistral", None),
    ("{%- if tools %}<tools>{% endif %}<tool_call>\\n<function={{ name }}>\\n"
     "<parameter={{ k }}>", True, "qwen3_coder", None),
    ("{%- if tools %}<tools>{{ tools }}</tools>{% endif %}<tool_call>\\n{{ call }}"
     "</tool_call>{%- if enable_thinking is false %}<think>\\n\\n</think>{% endif %}", True,
     "hermes", "qwen3"),
    ("{%- if tools %}<tools></tools>{% endif %}<tool_call>\\n{{ call }}</tool_call>", True,
     "hermes", None),
    ("{%- if tools %}Environment: ipython{% endif %}<|python_tag|>{{ call }}", True,
     "llama3_json", None),
    ("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}<think>\\n", False,
     "hermes", "deepseek_r1"),
    ("{% for m in messages %}{{ m.tools_text }}{% endfor %}", True, None, None),
]


@pytest.mark.parametrize("template, renders, tool, reasoning", TEMPLATES)
def test_formats_are_chosen_from_the_chat_template(template, renders, tool, reasoning):
    found = formats.detect(template, renders)
    assert (found.tool, found.reasoning) == (tool, reasoning), found.why


def test_the_default_model_gets_hermes_and_no_reasoning(codec):
    """SmolLM2's template renders no tools: the frontend describes them in Hermes'
    format and reads the answer with vLLM's hermes parser."""
    found = formats.resolve(None, None, codec.tok.chat_template, codec.template_has_tools)
    assert (found.tool, found.reasoning) == ("hermes", None)
    assert formats.resolve("llama3_json", None, codec.tok.chat_template,
                           codec.template_has_tools).tool == "llama3_json"


def test_every_detected_name_is_one_vllm_registers():
    for _, tool, reasoning, _ in formats.DETECTION:
        assert formats.check_tool_parser(tool) == tool
        assert formats.check_reasoning_parser(reasoning) == reasoning
    assert len(formats.tool_parser_names()) >= 40
    assert len(formats.reasoning_parser_names()) >= 30


@pytest.mark.parametrize("field, name", [("tool_call_parser", "hermes2"),
                                         ("reasoning_parser", "deepseek-r1")])
def test_unknown_parser_names_are_refused_naming_the_field_and_the_known_ones(field, name):
    with pytest.raises(ValidationError) as err:
        FrontendConfig.model_validate({field: name})
    text = str(err.value)
    assert field in text and repr(name) in text
    assert ("kimi_k2" in text and "qwen3_coder" in text) if field == "tool_call_parser" \
        else ("deepseek_r1" in text and "openai_gptoss" in text)
    assert FrontendConfig.model_validate({field: name.replace("2", "").replace("-", "_")})


def test_checking_a_config_does_not_import_vllm():
    code = ("import sys; from splitserve.components.frontend.config import FrontendConfig; "
            "FrontendConfig.model_validate({'tool_call_parser': 'kimi_k2', "
            "'reasoning_parser': 'qwen3'}); assert 'vllm' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
