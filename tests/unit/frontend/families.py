"""Model families' answers as the models emit them, and tokenizers that hold each family's
marker tokens, for the output-format tests.

The real families' tokenizers cannot be downloaded here, so each is SmolLM2's tokenizer
with the family's markers added as single tokens (as they are in the family's own
tokenizer: ``<tool_call>``, ``<｜tool▁sep｜>``, ``[TOOL_CALLS]``...).  gpt-oss's harmony
format is read from token ids, so its tokenizer is the harmony encoding itself
(``openai_harmony``, installed with vLLM), wrapped in the few tokenizer methods the
parsers call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from transformers import AutoTokenizer

WEATHER_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather now",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}]
PARIS = ("get_weather", {"city": "Paris"})
ROME = ("get_weather", {"city": "Rome", "days": 2})

DEEPSEEK = ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"]
KIMI = ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
        "<|tool_call_end|>", "<|tool_call_argument_begin|>"]
THINK = ["<think>", "</think>"]


@dataclass(frozen=True)
class Recorded:
    """One answer: the parsers that read it and what they must find."""

    family: str
    tool: str | None
    reasoning: str | None
    markers: tuple[str, ...]
    text: str
    content: str
    calls: tuple[tuple[str, dict], ...]
    thinking: str = ""


RECORDED = [
    Recorded("llama3_json", "llama3_json", None, ("<|python_tag|>",),
             '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", (PARIS,)),
    Recorded("llama3_json python_tag, two calls", "llama3_json", None, ("<|python_tag|>",),
             '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
             '{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}', "",
             (PARIS, ROME)),
    Recorded("qwen2.5 hermes", "hermes", None, ("<tool_call>", "</tool_call>"),
             'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
             '"arguments": {"city": "Rome", "days": 2}}\n</tool_call>',
             "Let me check both.", (PARIS, ROME)),
    Recorded("hermes, no call", "hermes", None, ("<tool_call>", "</tool_call>"),
             "Paris is sunny today.", "Paris is sunny today.", ()),
    Recorded("qwen3 thinking then a call", "hermes", "qwen3",
             ("<tool_call>", "</tool_call>", *THINK),
             '<think>\nThe user wants the weather in Paris.\n</think>\n\n<tool_call>\n'
             '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "",
             (PARIS,), "The user wants the weather in Paris."),
    Recorded("qwen3 thinking then an answer", "hermes", "qwen3",
             ("<tool_call>", "</tool_call>", *THINK),
             "<think>\nRecall the capital.\n</think>\n\nParis.", "Paris.", (),
             "Recall the capital."),
    Recorded("qwen3-coder", "qwen3_coder", None, ("<tool_call>", "</tool_call>"),
             "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
             "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>", "", (ROME,)),
    Recorded("mistral", "mistral", None, ("[TOOL_CALLS]", "[ARGS]"),
             '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", (PARIS,)),
    Recorded("deepseek r1 (reasoning open from the prompt)", "deepseek_v3", "deepseek_r1",
             (*DEEPSEEK, *THINK),
             "The user asks for Paris.\n</think>\n\nChecking.<｜tool▁calls▁begin｜>"
             "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
             '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
             "Checking.", (PARIS,), "The user asks for Paris."),
    Recorded("deepseek v3 two calls", "deepseek_v3", None, tuple(DEEPSEEK),
             "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
             '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>'
             'function<｜tool▁sep｜>get_weather\n```json\n{"city": "Rome", "days": 2}\n'
             "```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "", (PARIS, ROME)),
    Recorded("kimi k2", "kimi_k2", None, tuple(KIMI),
             "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
             '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
             "<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>"
             '{"city": "Rome", "days": 2}<|tool_call_end|><|tool_calls_section_end|>', "",
             (PARIS, ROME)),
    Recorded("glm 4.5", "glm45", "glm45",
             ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
              "</arg_value>", *THINK),
             "<think>Weather lookup.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>"
             "\n<arg_value>Rome</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2"
             "</arg_value>\n</tool_call>", "", (ROME,), "Weather lookup."),
    Recorded("gpt-oss harmony", "openai", "openai_gptoss", (),
             "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
             "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
             '{"city": "Paris"}<|call|>', "", (PARIS,), "Need the weather."),
    Recorded("gpt-oss harmony answer", "openai", "openai_gptoss", (),
             "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
             "<|message|>Paris is sunny.<|return|>", "Paris is sunny.", (), "Easy."),
]


class HarmonyTokenizer:
    """gpt-oss's tokenizer as far as the harmony parser uses one (its token ids are the
    harmony encoding's)."""

    def __init__(self) -> None:
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding

        self.enc = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
        self.vocab = {t: self.enc.encode(t, allowed_special="all")[0] for t in (
            "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
            "<|return|>", "<|call|>")}
        self.all_special_tokens = list(self.vocab)
        self.all_special_ids = list(self.vocab.values())

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.enc.encode(text, allowed_special="all")

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.enc.decode(list(ids))

    def get_vocab(self) -> dict[str, int]:
        return self.vocab

    def __len__(self) -> int:
        return 201088


@functools.cache
def family_tokenizer(model_dir: str, markers: tuple[str, ...]):
    """SmolLM2's tokenizer with ``markers`` added as tokens (one per marker), or the
    harmony tokenizer for ``()`` in the gpt-oss cases."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    if markers:
        tok.add_tokens(list(markers))
    return tok


def tokenizer_for(model_dir: str, case: Recorded):
    if case.tool == "openai":
        return _harmony()
    return family_tokenizer(model_dir, case.markers)


@functools.cache
def _harmony() -> HarmonyTokenizer:
    return HarmonyTokenizer()
