"""One chat choice's text split into reasoning, content and tool calls, as it streams.

``ChoiceOutput.push(text)`` takes each detokenised delta and returns a ``Delta``: the
reasoning (``reasoning_content``), the content and the tool-call deltas it completes;
``finish()`` at the end of generation returns what was held back.  A non-streamed answer
is the same deltas folded into one message (``fold``), so both forms always agree.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from .reasoning_parsers import REASONING_PARSERS
from .tool_parsers import TOOL_PARSERS, ParsedCall, ParseStep


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
    """How a request's answers are read: set once per request from its tools and the
    frontend's parsers."""

    mode: str = "none"  # none | auto | required | named (see tools.choice_mode)
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    named: str | None = None
    parallel: bool = True


class ChoiceOutput:
    """The per-choice state: reasoning split first, then tool calls in the content."""

    def __init__(self, plan: OutputPlan) -> None:
        self.plan = plan
        self.reasoning = (REASONING_PARSERS[plan.reasoning_parser]()
                          if plan.reasoning_parser else None)
        self.tools = TOOL_PARSERS[plan.tool_parser]() if plan.mode == "auto" else None
        self.forced = ""  # required: the JSON array of calls, read at the end
        self.calls = 0

    @property
    def called(self) -> bool:
        return self.calls > 0

    def push(self, text: str) -> Delta:
        if self.reasoning is None:
            return self._content(text, final=False)
        reasoning, content = self.reasoning.push(text)
        return Delta(reasoning=reasoning).add(self._content(content, final=False))

    def finish(self) -> Delta:
        if self.reasoning is None:
            return self._content("", final=True)
        reasoning, content = self.reasoning.finish()
        return Delta(reasoning=reasoning).add(self._content(content, final=True))

    def _content(self, text: str, final: bool) -> Delta:
        mode = self.plan.mode
        if mode == "named":
            return self._named(text)
        if mode == "required":
            self.forced += text
            return self._required() if final else Delta()
        if self.tools is None:
            return Delta(content=text)
        step = self.tools.push(text) if text else ParseStep()
        if final:
            tail = self.tools.finish()
            step.content += tail.content
            step.calls += tail.calls
        return Delta(content=step.content, tool_calls=self._shape(step.calls))

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
        try:
            items = json.loads(self.forced)
        except ValueError:
            return Delta(content=self.forced)  # cut short (max_tokens): not a call
        calls = [ParsedCall(i["name"], json.dumps(i["arguments"], ensure_ascii=False))
                 for i in items if isinstance(i, dict) and "name" in i and "arguments" in i]
        return Delta(tool_calls=self._shape(calls)) if calls else Delta(content=self.forced)

    def _shape(self, calls: list[ParsedCall]) -> list[dict[str, Any]]:
        out = []
        for c in calls:
            if self.called and not self.plan.parallel:
                break  # parallel_tool_calls: false keeps the first call only
            out.append({"index": self.calls, "id": call_id(), "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments}})
            self.calls += 1
        return out


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
                calls[tc["index"]] = {"id": tc["id"], "type": "function",
                                      "function": dict(tc["function"])}
            else:
                have["function"]["arguments"] += tc["function"].get("arguments", "")
    out.tool_calls = [calls[i] for i in sorted(calls)]
    return out


def message(whole: Delta) -> dict[str, Any]:
    """A non-streamed chat ``message`` from a folded choice."""
    msg: dict[str, Any] = {"role": "assistant",
                           "content": whole.content if whole.content or not whole.tool_calls
                           else None}
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
