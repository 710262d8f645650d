"""Reasoning parsers: split a reasoning model's ``<think>...</think>`` from its answer.

Chosen by name (``Frontend.reasoning_parser``, the names vLLM uses); one per choice.
``push(text)`` returns ``(reasoning, content)`` for each detokenised delta, holding back
a tail that could still become a tag; ``finish()`` releases it.

- ``deepseek_r1``: the template opens ``<think>`` itself, so the answer starts inside
  the reasoning whether or not the model repeats the tag; everything up to ``</think>``
  is reasoning (all of it, when the tag never comes).
- ``qwen3``: reasoning only when the answer opens with ``<think>`` (thinking can be
  switched off per request, and then the answer is plain content).
"""

from __future__ import annotations

from collections.abc import Callable

from .tool_parsers import _held_prefix

OPEN, CLOSE = "<think>", "</think>"


class ThinkParser:
    """Splits reasoning from content at ``</think>``; ``starts_inside``: whether the text
    is reasoning before any ``<think>`` (deepseek_r1) or only after one (qwen3)."""

    def __init__(self, starts_inside: bool) -> None:
        self.starts_inside = starts_inside
        self.state = "start"  # start -> thinking -> answer
        self.buf = ""
        self.lead = False  # just after </think>: leading whitespace is dropped

    def push(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning = content = ""
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith(OPEN):
                self.buf, self.state = head[len(OPEN):], "thinking"
            elif OPEN.startswith(head):
                return "", ""  # maybe the opening tag, maybe nothing yet
            else:
                self.state = "thinking" if self.starts_inside else "answer"
        if self.state == "thinking":
            at = self.buf.find(CLOSE)
            if at < 0:
                keep = _held_prefix(self.buf, CLOSE)
                reasoning = self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                return reasoning, ""
            reasoning, self.buf = self.buf[:at], self.buf[at + len(CLOSE):]
            self.state, self.lead = "answer", True
        if self.lead:  # the blank lines after </think> are layout, not the answer
            self.buf = self.buf.lstrip()
            self.lead = not self.buf
        content, self.buf = self.buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        if self.state == "thinking" or (self.state == "start" and self.starts_inside):
            return rest, ""
        return "", rest.lstrip() if self.lead else rest


ReasoningParser = ThinkParser

REASONING_PARSERS: dict[str, Callable[[], ReasoningParser]] = {
    "deepseek_r1": lambda: ThinkParser(starts_inside=True),
    "qwen3": lambda: ThinkParser(starts_inside=False),
}
"""Reasoning parsers by the name ``Frontend.reasoning_parser`` takes."""


def check_reasoning_parser(name: str | None) -> str | None:
    """Config validation: ``name`` unchanged, or ValueError listing the known ones."""
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: "
                         f"{', '.join(sorted(REASONING_PARSERS))}")
    return name
