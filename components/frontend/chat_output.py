"""One chat choice's text split into reasoning, content and tool calls, as it streams.

``ChoiceOutput.push(text)`` takes each detokenised delta and returns a ``Delta``: the
reasoning (``reasoning_content``), the content and the tool-call deltas it completes;
``finish()`` at the end of generation returns what was held back.  The splitting is
vLLM's (``formats.load``: its reasoning and tool-call parsers composed as its server
composes them): ``parse_delta`` per delta when the answer streams, ``parse`` on the whole
text when it does not.  Forced calls (``required``, a named function) are JSON the engine
was held to and are read here without a parser.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from .formats import LoadedFormat


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class Delta:
    """What one step adds to a chat choice."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def add(self, other: Delta) -> Delta:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self

    def fields(self) -> dict[str, Any]:
        """The non-empty fields, as a stream chunk's ``delta`` carries them."""
        out: dict[str, Any] = {}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.content:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


@dataclass(frozen=True)
class OutputPlan:
    """How a request's answers are read: set once per request (``chat_input.output_plan``,
    in the tokenizer threads) from its tools and the frontend's formats."""

    mode: str = "none"  # none | auto | required | named (see tools.choice_mode)
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    named: str | None = None
    parallel: bool = True
    stream: bool = True
    """Streamed answers are parsed delta by delta, others whole at the end."""
    format: LoadedFormat | None = None
    """vLLM's parser for this request (auto tool calls and/or reasoning), or None."""
    request: Any = None
    """The request as vLLM's parsers read it (its tools and tool_choice)."""
    skip_special_tokens: bool = True
    """False when the format's markers are special tokens the text must keep."""


class ChoiceOutput:
    """The per-choice state of one answer."""

    def __init__(self, plan: OutputPlan) -> None:
        self.plan = plan
        fmt = plan.format
        self.parser = fmt.new(plan.request.tools) if fmt is not None else None
        self.started = False
        self.text: list[str] = []  # not streamed: the answer, parsed at the end
        self.ids: list[int] = []
        self.forced = ""  # required: the JSON array of calls, read at the end
        self.calls = 0
        self.index: dict[int, int | None] = {}  # the parser's call index -> ours (None: dropped)

    @property
    def called(self) -> bool:
        return self.calls > 0

    def push(self, text: str, token_ids: list[int] | None = None) -> Delta:
        """``text``: the next detokenised piece; ``token_ids``: its tokens, when known
        (otherwise they are re-encoded from the text for the parser)."""
        return self._step(text, token_ids, final=False)

    def finish(self, token_ids: list[int] | None = None) -> Delta:
        """At the end of generation: what was held back."""
        return self._step("", token_ids, final=True)

    def _step(self, text: str, token_ids: list[int] | None, final: bool) -> Delta:
        mode = self.plan.mode
        if mode == "named":
            return self._named(text)
        if mode == "required":
            self.forced += text
            return self._required() if final else Delta()
        if self.parser is None:
            return Delta(content=text)
        if not self.plan.stream:
            self.text.append(text)
            if token_ids is None and self.plan.format.reads_ids:
                token_ids = self._encode(text)
            self.ids += token_ids or []
            return self._whole() if final else Delta()
        if token_ids is None:
            token_ids = self._encode(text)
        if not text and not token_ids and not final:
            return Delta()
        out = Delta()
        pieces = self._pieces(text, list(token_ids))
        for i, (piece, ids) in enumerate(pieces):
            msg = self.parser.parse_delta(piece, ids, self.plan.request,
                                          prompt_token_ids=None if self.started else [],
                                          finished=final and i == len(pieces) - 1)
            self.started = True
            if msg is not None:
                out.add(self._from_parser(msg))
        return out

    def _pieces(self, text: str, ids: list[int]) -> list[tuple[str, list[int]]]:
        """A delta of several tokens as one piece per token, as vLLM's parsers see a
        stream (some drop the text before a marker that shares a delta with it); whole
        when the tokens' own texts do not add up to ``text``."""
        if len(ids) < 2:
            return [(text, ids)]
        decode = self.plan.format.tokenizer.decode
        texts = [decode([t], skip_special_tokens=False) for t in ids]
        if "".join(texts) != text:
            return [(text, ids)]
        return [(t, [i]) for t, i in zip(texts, ids, strict=True)]

    def _from_parser(self, msg: Any) -> Delta:
        out = Delta(reasoning=msg.reasoning or "", content=msg.content or "")
        for tc in msg.tool_calls or []:
            fn = tc.function
            piece = self._call(tc.index, fn.name if fn else None,
                               fn.arguments if fn else None)
            if piece is not None:
                out.tool_calls.append(piece)
        return out

    def _encode(self, text: str) -> list[int]:
        if not text:
            return []
        tok = self.plan.format.tokenizer
        rust = getattr(tok, "backend_tokenizer", None)  # transformers' own wrapper costs 4x
        if rust is not None:
            return rust.encode(text, add_special_tokens=False).ids
        return tok.encode(text, add_special_tokens=False)

    def _call(self, index: int, name: str | None, arguments: str | None
              ) -> dict[str, Any] | None:
        """One streamed call fragment in OpenAI's shape, numbered by this choice; a call
        past the first is dropped when ``parallel_tool_calls`` is false."""
        if index not in self.index:
            keep = self.plan.parallel or self.calls == 0
            self.index[index] = self.calls if keep else None
            if keep:
                self.calls += 1
                return {"index": self.index[index], "id": call_id(), "type": "function",
                        "function": {"name": name or "", "arguments": arguments or ""}}
            return None
        ours = self.index[index]
        if ours is None or not (name or arguments):
            return None
        fn: dict[str, Any] = {"arguments": arguments or ""}
        if name:
            fn["name"] = name
        return {"index": ours, "function": fn}

    def _whole(self) -> Delta:
        reasoning, content, calls = self.parser.parse(
            "".join(self.text), self.plan.request, enable_auto_tools=self.plan.mode == "auto",
            model_output_token_ids=self.ids)
        return Delta(reasoning=reasoning or "", content=content or "",
                     tool_calls=self._shape([(c.name, c.arguments) for c in calls or []]))

    def _named(self, text: str) -> Delta:
        # The answer is the named function's arguments: stream them as they come.
        if not text:
            return Delta()
        first = not self.called
        self.calls = 1
        fn: dict[str, Any] = {"arguments": text}
        if first:
            return Delta(tool_calls=[{"index": 0, "id": call_id(), "type": "function",
                                      "function": {"name": self.plan.named, **fn}}])
        return Delta(tool_calls=[{"index": 0, "function": fn}])

    def _required(self) -> Delta:
        calls = [(i["name"], json.dumps(i["arguments"], ensure_ascii=False))
                 for i in complete_items(self.forced)
                 if isinstance(i, dict) and isinstance(i.get("name"), str) and "arguments" in i]
        return Delta(tool_calls=self._shape(calls)) if calls else Delta(content=self.forced)

    def _shape(self, calls: list[tuple[str, str]]) -> list[dict[str, Any]]:
        out = []
        for name, arguments in calls:
            if self.called and not self.plan.parallel:
                break  # parallel_tool_calls: false keeps the first call only
            out.append({"index": self.calls, "id": call_id(), "type": "function",
                        "function": {"name": name, "arguments": arguments}})
            self.calls += 1
        return out


def complete_items(text: str) -> list[Any]:
    """The complete elements of a JSON array, even when the array was cut off (an answer
    that reached max_tokens): ``[{"a": 1}, {"b"`` gives ``[{"a": 1}]``."""
    s, decoder = text.strip(), json.JSONDecoder()
    if not s.startswith("["):
        return []
    items, at = [], 1
    while True:
        while at < len(s) and s[at] in " \t\r\n,":
            at += 1
        if at >= len(s) or s[at] == "]":
            return items
        try:
            item, at = decoder.raw_decode(s, at)
        except ValueError:
            return items
        items.append(item)


def fold(deltas: list[Delta]) -> Delta:
    """The deltas of one choice merged: tool calls joined by index (their argument
    fragments concatenated)."""
    out = Delta()
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        out.reasoning += d.reasoning
        out.content += d.content
        for tc in d.tool_calls:
            have = calls.get(tc["index"])
            if have is None:
                calls[tc["index"]] = {"id": tc.get("id") or call_id(), "type": "function",
                                      "function": {"name": "", "arguments": "",
                                                   **tc["function"]}}
            else:
                have["function"]["arguments"] += tc["function"].get("arguments", "")
                if not have["function"]["name"]:
                    have["function"]["name"] = tc["function"].get("name", "")
    out.tool_calls = [calls[i] for i in sorted(calls)]
    return out


def message(whole: Delta) -> dict[str, Any]:
    """A non-streamed chat ``message`` from a folded choice."""
    # Whitespace around calls is the format's layout (newlines between <tool_call>
    # blocks), not an answer.
    text = whole.content if whole.content.strip() or not whole.tool_calls else None
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if whole.reasoning:
        msg["reasoning_content"] = whole.reasoning
    if whole.tool_calls:
        msg["tool_calls"] = whole.tool_calls
    return msg


def finish_reason(finish: str | None, output: ChoiceOutput) -> str | None:
    """``tool_calls`` when the choice called a tool and was not cut short."""
    if finish is not None and finish != "length" and output.called:
        return "tool_calls"
    return finish
