"""Tools in chat requests: their types, the JSON schema that forces a call, and the
history (tool definitions, past calls, tool results) rendered for the chat template.

``tool_choice`` decides how calls are found:

- ``none`` (or no tools): the answer is text; the tools are not shown to the model.
- ``auto``: the model decides; the tool-call parser (``formats.py``) finds calls in its
  text.
- ``required`` / a named function: the engine's structured output forces the answer to
  be JSON of a given schema (an array of ``{name, arguments}`` of at most
  ``MAX_PARALLEL_CALLS`` items, one with ``parallel_tool_calls: false``; or the named
  function's arguments), so even a small model emits a valid call; no parser is
  involved.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .tool_prompts import Call, prompt_format


MAX_PARALLEL_CALLS = 8
"""Most calls a ``required`` answer may hold (OpenAI sets no number; eight covers a call
per item of a short list, and bounds what a looping model can spend)."""


SCHEMA_CACHE_SIZE = 4096
"""Schemas remembered as compiling (by their JSON text): agents send the same tool
definitions with every request, and compiling even a small one costs 0.06–0.25 ms."""


def check_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` unchanged if the engines' grammar compiler (xgrammar) takes it, else
    ValueError with its reason (a 400 naming the field, not a worker failure)."""
    text = json.dumps(schema or {"type": "object"}, sort_keys=True)
    if text in _COMPILED:
        _COMPILED.move_to_end(text)
        return schema
    import xgrammar as xgr

    try:
        xgr.Grammar.from_json_schema(text)
    except (RuntimeError, ValueError, TypeError) as exc:
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"unsupported JSON schema: {reason.split(': ', 1)[-1]}") from None
    _COMPILED[text] = None
    if len(_COMPILED) > SCHEMA_CACHE_SIZE:
        _COMPILED.popitem(last=False)
    return schema


_COMPILED: OrderedDict[str, None] = OrderedDict()


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _compiles(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if v is None else check_schema(v)

    def schema(self) -> dict[str, Any]:
        """The arguments' JSON schema (an object of anything when none is given)."""
        return self.parameters or {"type": "object"}

    def described(self) -> dict[str, Any]:
        """The definition shown to the model (only the fields a model reads)."""
        out: dict[str, Any] = {"name": self.name}
        if self.description:
            out["description"] = self.description
        out["parameters"] = self.schema()
        return out


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: str


class ToolCallIn(BaseModel):
    """A past call in an assistant message of the history."""

    model_config = ConfigDict(extra="ignore", strict=True)
    id: str = ""
    type: Literal["function"] = "function"
    function: CalledFunction


def choice_mode(tools: list[ToolDef] | None, choice: ToolChoice | None) -> str:
    """``none``, ``auto``, ``required`` or ``named``: how this request's calls are found."""
    if not tools or choice == "none":
        return "none"
    if isinstance(choice, NamedToolChoice):
        return "named"
    return choice or "auto"


def forced_schema(tools: list[ToolDef], choice: ToolChoice | None,
                  parallel: bool) -> dict[str, Any] | None:
    """The JSON schema the answer must follow for ``required`` or a named function
    (None: the answer is free text)."""
    mode = choice_mode(tools, choice)
    if mode == "named":
        name = choice.function.name  # type: ignore[union-attr]
        return next(t.function.schema() for t in tools if t.function.name == name)
    if mode != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"enum": [t.function.name]},
                                               "arguments": t.function.schema()},
              "required": ["name", "arguments"], "additionalProperties": False}
             for t in tools]
    # The array is bounded: a small model held to an open-ended array can repeat one call
    # until max_tokens, and an answer cut there is no call at all.
    return {"type": "array", "minItems": 1,
            "maxItems": MAX_PARALLEL_CALLS if parallel else 1,
            "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}


def _forced_instructions(tools: list[ToolDef], mode: str, named: str | None) -> str:
    if mode == "named":
        fn = next(t.function for t in tools if t.function.name == named)
        return (f"Call the function {fn.name} now: answer only with its arguments as a JSON "
                f"object.\n{json.dumps(fn.described(), ensure_ascii=False)}")
    listed = "\n".join(json.dumps(t.function.described(), ensure_ascii=False) for t in tools)
    return ("Call one of these functions now: answer only with a JSON array of calls, "
            'each {"name": function name, "arguments": {argument name: value}}.\n' + listed)


def render_history(messages: list[dict[str, Any]], tools: list[ToolDef] | None,
                   choice: ToolChoice | None, parser: str | None, template_has_tools: bool
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages for the chat template and the ``tools`` argument to pass it.

    ``messages`` hold ``role``, ``content`` (text) and, for the tool protocol,
    ``tool_calls`` (a list of ToolCallIn) or ``tool_call_id``.  A template that renders
    tools itself gets them as they are.  Otherwise the tools are described in a system
    message in the format ``parser`` reads (or, when the call is forced, as the JSON the
    answer must be), and past calls are written back into the assistant's text the same
    way, so the model sees the conversation in the form it is asked to answer in.
    """
    mode = choice_mode(tools, choice)
    shown = tools if mode != "none" else None
    fmt = prompt_format(parser)
    out: list[dict[str, Any]] = []
    for m in messages:
        calls: list[ToolCallIn] = m.get("tool_calls") or []
        msg = {"role": m["role"], "content": m["content"]}
        if template_has_tools:
            if calls:
                msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _args(c.function.arguments)}}
                    for c in calls]
            if m.get("tool_call_id"):
                msg["tool_call_id"] = m["tool_call_id"]
        elif calls:
            written = fmt.render_calls([Call(c.function.name, c.function.arguments)
                                        for c in calls])
            msg["content"] = f"{msg['content']}\n{written}" if msg["content"] else written
        out.append(msg)
    if template_has_tools:
        return out, [{"type": "function", "function": t.function.described()}
                     for t in shown] if shown else None
    if shown:
        described = [t.function.described() for t in shown]
        text = (_forced_instructions(shown, mode, choice.function.name  # type: ignore[union-attr]
                                     if mode == "named" else None)
                if mode in ("named", "required") else fmt.instructions(described))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, None


def _args(arguments: str) -> Any:
    """Templates expect a call's arguments as a mapping; text that is not JSON stays text."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
