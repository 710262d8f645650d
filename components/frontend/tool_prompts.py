"""Tools and past calls written into the prompt, for a chat template that renders none.

Such a model is told about the tools in a system message and sees its earlier calls in
its own turns, in the format the frontend then reads its answer with: Hermes'
(``<tool_call>{json}</tool_call>``, what ``formats.detect`` chooses for these templates),
Llama 3's JSON or the pythonic list when one of those parsers is named instead.  These
are prompt texts, not parsers: vLLM's parsers read the answers (``formats.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Call:
    """A past call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


def _tool_json(tools: list[dict[str, Any]]) -> str:
    return "\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False)
                     for t in tools)


def _hermes_instructions(tools: list[dict[str, Any]]) -> str:
    return ("You can call functions. Their signatures, as JSON schemas, are listed "
            f"between <tools> and </tools>:\n<tools>\n{_tool_json(tools)}\n</tools>\n"
            "To call one, reply with a JSON object holding the function's name and "
            "its arguments between <tool_call> and </tool_call>, for example:\n"
            '<tool_call>\n{"name": "function_name", "arguments": {"arg": "value"}}\n'
            "</tool_call>")


def _hermes_calls(calls: list[Call]) -> str:
    return "\n".join(f'<tool_call>\n{{"name": {json.dumps(c.name)}, "arguments": '
                     f"{c.arguments}}}\n</tool_call>" for c in calls)


def _llama3_instructions(tools: list[dict[str, Any]]) -> str:
    return ("You can call functions. To call one, answer only with a JSON object of "
            'the form {"name": function name, "parameters": {argument name: value}}. '
            f"The functions:\n{_tool_json(tools)}")


def _llama3_calls(calls: list[Call]) -> str:
    return "; ".join(f'{{"name": {json.dumps(c.name)}, "parameters": {c.arguments}}}'
                     for c in calls)


def _pythonic_instructions(tools: list[dict[str, Any]]) -> str:
    return ("You can call functions. To call them, answer only with a Python list of "
            'calls with keyword arguments, such as [function_name(arg="value")]. '
            f"The functions:\n{_tool_json(tools)}")


def _pythonic_calls(calls: list[Call]) -> str:
    parts = []
    for c in calls:
        args = ", ".join(f"{k}={v!r}" for k, v in json.loads(c.arguments).items())
        parts.append(f"{c.name}({args})")
    return f"[{', '.join(parts)}]"


@dataclass(frozen=True)
class PromptFormat:
    instructions: Callable[[list[dict[str, Any]]], str]
    """The system text describing ``tools`` (each a function's name, description,
    parameters) and how to call them."""
    render_calls: Callable[[list[Call]], str]
    """Past calls as the assistant would have written them."""


HERMES = PromptFormat(_hermes_instructions, _hermes_calls)
PROMPT_FORMATS: dict[str, PromptFormat] = {
    "hermes": HERMES,
    "llama3_json": PromptFormat(_llama3_instructions, _llama3_calls),
    "pythonic": PromptFormat(_pythonic_instructions, _pythonic_calls),
}
"""By tool-call parser name; any other parser gets Hermes' (the detected default)."""


def prompt_format(parser: str | None) -> PromptFormat:
    return PROMPT_FORMATS.get(parser or "", HERMES)
