"""The Responses API (``POST /v1/responses``), stateless: a request is the chat request it
stands for, served by the same path, and its answer is reshaped into a Response object or
the Responses event stream.

Supported: ``input`` as text or items (messages with text parts, ``function_call`` and
``function_call_output`` items; ``reasoning`` items are accepted and not replayed),
``instructions``, function ``tools``, ``tool_choice``, ``parallel_tool_calls``,
``max_output_tokens``, ``temperature``, ``top_p``, ``text.format`` (text, json_object,
json_schema) and ``stream``.  Nothing is stored: ``previous_response_id``, ``store: true``,
``conversation`` and ``background`` are refused by name.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from .errors import APIError, bad_request
from .openai_types import invalid

StrictPositiveInt = Annotated[int, Field(strict=True, gt=0)]
STATEFUL = ("previous_response_id", "conversation")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: StrictPositiveInt | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    text: dict[str, Any] | None = None
    stream: StrictBool = False
    store: StrictBool | None = None
    background: StrictBool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None

    @classmethod
    def parse(cls, data: dict[str, Any]) -> ResponsesRequest:
        """A validated request; 400 naming the parameter for what this server cannot do
        (it keeps no state) or for an invalid value."""
        for name in STATEFUL:
            if data.get(name) is not None:
                raise bad_request(f"'{name}' is not supported: this server keeps no "
                                  "responses; send the whole conversation as input items",
                                  name, "unsupported_parameter")
        if data.get("store") is True:
            raise bad_request("'store' is not supported: this server keeps no responses "
                              "(send store: false or leave it out)", "store",
                              "unsupported_parameter")
        if data.get("background") is True:
            raise bad_request("'background' is not supported", "background",
                              "unsupported_parameter")
        if (data.get("reasoning") or {}).get("effort") not in (None, "none"):
            raise bad_request("'reasoning.effort' is not supported by this server",
                              "reasoning", "unsupported_parameter")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise invalid(exc) from None


def chat_body(r: ResponsesRequest) -> dict[str, Any]:
    """The chat completions body this request stands for (validated by the caller)."""
    messages: list[dict[str, Any]] = []
    if r.instructions:
        messages.append({"role": "system", "content": r.instructions})
    if isinstance(r.input, str):
        messages.append({"role": "user", "content": r.input})
    else:
        for i, item in enumerate(r.input):
            _add_item(messages, item, f"input.{i}")
    body: dict[str, Any] = {"model": r.model, "messages": messages, "stream": r.stream,
                            "max_tokens": r.max_output_tokens, "temperature": r.temperature,
                            "top_p": r.top_p, "user": r.user, "metadata": r.metadata}
    if r.tools:
        body["tools"] = [_chat_tool(t, f"tools.{i}") for i, t in enumerate(r.tools)]
    if r.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(r.tool_choice)
    if r.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = r.parallel_tool_calls
    fmt = (r.text or {}).get("format")
    if fmt is not None:
        body["response_format"] = _chat_format(fmt)
    return {k: v for k, v in body.items() if v is not None}


def as_responses_error(err: APIError) -> APIError:
    """A 400 found on the chat request a Responses request became, naming the Responses
    parameter the client sent (``text.format``, not ``response_format``)."""
    param = err.param or ""
    head, _, rest = param.partition(".")
    if head == "tools" and rest:  # tools.0.function.parameters -> tools.0.parameters
        new = param.replace(".function.", ".", 1)
    else:
        new = {"response_format": "text.format", "max_tokens": "max_output_tokens",
               "messages": "input"}.get(head, head) + (f".{rest}" if rest and head not in (
                   "messages", "response_format") else "")
    if not param or new == param:
        return err
    message = err.message.replace(f"'{param}'", f"'{new}'").replace(f"'{head}'", f"'{new}'")
    return APIError(err.status, message, type_=err.type, param=new, code=err.code)


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("content must be text or a list of text parts", where,
                          "invalid_value")
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text",
                                                                    "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"content part type {kind!r} is not supported (text only)",
                              f"{where}.{j}.type", "unsupported_parameter")
        if not isinstance(part.get("text"), str):
            raise bad_request("a text part needs text", f"{where}.{j}.text", "invalid_value")
        out.append(part["text"])
    return "".join(out)


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise bad_request(f"message role {role!r} is not one of user, assistant, "
                              "system, developer", f"{where}.role", "invalid_value")
        messages.append({"role": role, "content": _text_of(item.get("content"),
                                                           f"{where}.content")})
    elif kind == "function_call":
        call = {"id": str(item.get("call_id") or ""), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and "tool_calls" in last:
            last["tool_calls"].append(call)  # parallel calls: one assistant turn
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""),
                         "content": _text_of(item.get("output"), f"{where}.output")})
    elif kind != "reasoning":  # past reasoning is not shown to the model again
        raise bad_request(f"input item type {kind!r} is not supported (message, "
                          "function_call, function_call_output, reasoning)", f"{where}.type",
                          "unsupported_parameter")


def _chat_tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise bad_request(f"tool type {tool.get('type')!r} is not supported (function only)",
                          f"{where}.type", "unsupported_parameter")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict")
          if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _chat_format(fmt: dict[str, Any]) -> dict[str, Any]:
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": fmt.get("type")}


def response_tools(r: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's tools as a Response object lists them."""
    return [{"type": "function", "name": t.get("name"), "description": t.get("description"),
             "parameters": t.get("parameters"), "strict": t.get("strict", True)}
            for t in r.tools or []]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_object(r: ResponsesRequest, response_id: str, created: int,
                    output: list[dict[str, Any]], status: str,
                    usage: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Response; ``status``: in_progress, completed or incomplete (cut at
    max_output_tokens)."""
    return {
        "id": response_id, "object": "response", "created_at": created,
        "status": status, "model": r.model, "output": output, "error": None,
        "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                               else None),
        "instructions": r.instructions, "metadata": r.metadata or {},
        "parallel_tool_calls": r.parallel_tool_calls is not False,
        "temperature": r.temperature, "top_p": r.top_p,
        "max_output_tokens": r.max_output_tokens,
        "tool_choice": r.tool_choice if r.tool_choice is not None else "auto",
        "tools": response_tools(r), "text": {"format": (r.text or {}).get(
            "format") or {"type": "text"}},
        "store": False, "background": False, "previous_response_id": None,
        "reasoning": None, "truncation": "disabled", "user": r.user,
        "completed_at": int(time.time()) if status != "in_progress" else None,
        "usage": usage,
    }


def response_usage(prompt_tokens: int, output_tokens: int, cached: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


def status_of(finish: str | None) -> Literal["completed", "incomplete"]:
    return "incomplete" if finish == "length" else "completed"
