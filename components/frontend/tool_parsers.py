"""Tool-call parsers: find the calls in a model's text, in the format the model was taught.

A parser is chosen by name (``Frontend.tool_call_parser``, the names vLLM uses) and is
built once per choice.  ``push(text)`` takes each detokenised delta and returns the part
that is plain content plus the calls completed so far; ``finish()`` at the end of
generation releases what was held back.  A call is emitted whole (id, name and all its
arguments in one delta), which every OpenAI client accumulates like a split one.  Text
that looked like a call but does not parse is returned as content, never dropped.

Each parser also says how to describe the tools to a model whose chat template does not
render them (``instructions``) and how to write past calls back into the history
(``render_calls``), so a conversation round-trips in the format the parser reads.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ParsedCall:
    """One function call found in the text; ``arguments`` is a JSON object's text."""

    name: str
    arguments: str


@dataclass
class ParseStep:
    """What one ``push`` or ``finish`` adds: content text and completed calls."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that could still grow into ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _call(name: Any, args: Any) -> ParsedCall | None:
    if not isinstance(name, str) or not name:
        return None
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None
    return ParsedCall(name, json.dumps(args, ensure_ascii=False))


def _tool_json(tools: list[dict[str, Any]]) -> str:
    return "\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False)
                     for t in tools)


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them,
    with content before (Hermes, Qwen 2.5 and many fine-tunes)."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.buf = ""
        self.inside = False
        self.called = False

    def push(self, text: str) -> ParseStep:
        self.buf += text
        step = ParseStep()
        while True:
            if not self.inside:
                at = self.buf.find(self.START)
                if at < 0:
                    keep = _held_prefix(self.buf, self.START)
                    out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                    step.content += self._content(out)
                    return step
                step.content += self._content(self.buf[:at])
                self.buf, self.inside = self.buf[at + len(self.START):], True
            at = self.buf.find(self.END)
            if at < 0:
                return step
            body, self.buf, self.inside = self.buf[:at], self.buf[at + len(self.END):], False
            call = self._parse(body)
            if call is None:
                step.content += f"{self.START}{body}{self.END}"
            else:
                step.calls.append(call)
                self.called = True

    def _content(self, text: str) -> str:
        # Whitespace between or after calls is layout, not an answer.
        return "" if self.called and not text.strip() else text

    def _parse(self, body: str) -> ParsedCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict):
            return None
        return _call(obj.get("name"), obj.get("arguments", obj.get("parameters")))

    def finish(self) -> ParseStep:
        rest, self.buf = self.buf, ""
        if not self.inside:
            return ParseStep(self._content(rest))
        self.inside = False  # generation stopped inside a call: keep it if it is whole
        call = self._parse(rest)
        if call is not None:
            return ParseStep(calls=[call])
        return ParseStep(self.START + rest)

    @staticmethod
    def instructions(tools: list[dict[str, Any]]) -> str:
        return ("You can call functions. Their signatures, as JSON schemas, are listed "
                f"between <tools> and </tools>:\n<tools>\n{_tool_json(tools)}\n</tools>\n"
                "To call one, reply with a JSON object holding the function's name and "
                "its arguments between <tool_call> and </tool_call>, for example:\n"
                '<tool_call>\n{"name": "function_name", "arguments": {"arg": "value"}}\n'
                "</tool_call>")

    @staticmethod
    def render_calls(calls: list[ParsedCall]) -> str:
        return "\n".join(f'<tool_call>\n{{"name": {json.dumps(c.name)}, "arguments": '
                         f"{c.arguments}}}\n</tool_call>" for c in calls)


class _WholeAnswerParser:
    """A parser for formats where a call is the whole answer: the text is held once it
    starts like a call and parsed at the end; anything else streams as content."""

    OPENERS: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.buf = ""
        self.mode: str | None = None  # None: undecided, "text" or "calls"

    def push(self, text: str) -> ParseStep:
        if self.mode == "text":
            return ParseStep(text)
        self.buf += text
        head = self.buf.lstrip()
        if not head:
            return ParseStep()
        if any(head.startswith(o) for o in self.OPENERS):
            self.mode = "calls"
            return ParseStep()
        if any(o.startswith(head) for o in self.OPENERS):
            return ParseStep()  # still could become an opener
        self.mode, out, self.buf = "text", self.buf, ""
        return ParseStep(out)

    def finish(self) -> ParseStep:
        rest, self.buf = self.buf, ""
        if self.mode != "calls":
            return ParseStep(rest)
        calls = self._parse(rest.strip())
        return ParseStep(calls=calls) if calls else ParseStep(rest)

    def _parse(self, text: str) -> list[ParsedCall] | None:
        raise NotImplementedError


class Llama3JsonParser(_WholeAnswerParser):
    """Llama 3.x JSON calls: ``{"name": ..., "parameters": {...}}``, several separated by
    ``;``, optionally after ``<|python_tag|>``."""

    OPENERS = ("{", "<|python_tag|>")

    def _parse(self, text: str) -> list[ParsedCall] | None:
        text = text.removeprefix("<|python_tag|>").strip()
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(text):
            try:
                obj, end = decoder.raw_decode(text, at)
            except ValueError:
                return None
            call = (_call(obj.get("name"), obj.get("parameters", obj.get("arguments")))
                    if isinstance(obj, dict) else None)
            if call is None:
                return None
            calls.append(call)
            at = end
            while at < len(text) and text[at] in " \t\r\n;":
                at += 1
        return calls or None

    @staticmethod
    def instructions(tools: list[dict[str, Any]]) -> str:
        return ("You can call functions. To call one, answer only with a JSON object of "
                'the form {"name": function name, "parameters": {argument name: value}}. '
                f"The functions:\n{_tool_json(tools)}")

    @staticmethod
    def render_calls(calls: list[ParsedCall]) -> str:
        return "; ".join(f'{{"name": {json.dumps(c.name)}, "parameters": {c.arguments}}}'
                         for c in calls)


class PythonicParser(_WholeAnswerParser):
    """Python-style calls in a list: ``[get_weather(city="Paris"), now()]`` (Llama 3.2
    and 4's pythonic format); arguments must be literals."""

    OPENERS = ("[",)

    def _parse(self, text: str) -> list[ParsedCall] | None:
        try:
            tree = ast.parse(text, mode="eval").body
        except SyntaxError:
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and not node.args):
                return None
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            except ValueError:
                return None
            if None in args:  # **kwargs
                return None
            calls.append(ParsedCall(node.func.id, json.dumps(args, ensure_ascii=False)))
        return calls

    @staticmethod
    def instructions(tools: list[dict[str, Any]]) -> str:
        return ("You can call functions. To call them, answer only with a Python list of "
                'calls with keyword arguments, such as [function_name(arg="value")]. '
                f"The functions:\n{_tool_json(tools)}")

    @staticmethod
    def render_calls(calls: list[ParsedCall]) -> str:
        parts = []
        for c in calls:
            args = ", ".join(f"{k}={v!r}" for k, v in json.loads(c.arguments).items())
            parts.append(f"{c.name}({args})")
        return f"[{', '.join(parts)}]"


ToolParser = HermesParser | Llama3JsonParser | PythonicParser

TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "pythonic": PythonicParser,
}
"""Tool-call parsers by the name ``Frontend.tool_call_parser`` takes."""


def check_tool_parser(name: str | None) -> str | None:
    """Config validation: ``name`` unchanged, or ValueError listing the known ones."""
    if name is not None and name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: "
                         f"{', '.join(sorted(TOOL_PARSERS))}")
    return name
