"""From a request body to what the chat template and the answer's reader need.

Called by ``app.prepare`` (in the tokenizer pool) for chat and Responses API requests:
``parse_request`` validates the body (a Responses request becomes the chat request it
stands for), ``chat_history`` gives the messages and tools for the template, and
``output_plan`` says how the answer's text will be split (and by which of vLLM's
parsers, ``formats.py``).
"""

from __future__ import annotations

from typing import Any

from .capabilities import GraphEngines
from .chat_output import OutputPlan
from .errors import APIError, bad_request
from .formats import load
from .openai_types import ChatCompletionRequest, CompletionRequest, parse_json, validate
from .tools import NamedToolChoice, choice_mode, render_history


def parse_request(kind: str, raw: bytes, engines: GraphEngines) -> tuple[Any, Any]:
    """The validated request and, for kind "responses", the Responses request it came
    from (else None); raises APIError(400) on any client mistake."""
    if kind == "responses":
        from .responses_api import ResponsesRequest, as_responses_error, chat_body

        resp = ResponsesRequest.parse(parse_json(raw))
        try:
            return validate(ChatCompletionRequest, chat_body(resp), engines), resp
        except APIError as err:
            raise as_responses_error(err) from None
    model = ChatCompletionRequest if kind == "chat" else CompletionRequest
    return validate(model, parse_json(raw), engines), None


def output_plan(req: ChatCompletionRequest, tool_parser: str | None,
                reasoning_parser: str | None, tokenizer: Any) -> OutputPlan:
    """How this request's answers are read (called in the tokenizer threads: the first
    request that needs a parser imports vLLM's, see ``formats.load``); tool_choice auto
    without a tool-call parser is a 400 (the calls could not be found in the answer)."""
    mode = choice_mode(req.tools, req.tool_choice)
    if mode == "auto" and tool_parser is None:
        raise bad_request("tools with tool_choice auto need a tool call parser, and this "
                          "server has none (Frontend.tool_call_parser: the model's chat "
                          "template writes calls in no format it knows); send tool_choice "
                          "required or a named function, or none", "tool_choice",
                          "unsupported_parameter")
    named = req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) \
        else None
    # An answer held to a JSON schema (a forced call, a JSON response_format) is JSON from
    # its first token: there is no <think> part to split off, and a parser that reads
    # everything before </think> as reasoning would take the whole answer.
    constrained = mode in ("named", "required") or (
        req.response_format is not None and req.response_format.answer_schema() is not None)
    reasoning = None if constrained else reasoning_parser
    tool = tool_parser if mode == "auto" else None
    try:
        fmt = load(tool, reasoning, tokenizer)
    except ValueError as exc:  # the model's tokenizer lacks the format's markers
        raise APIError(500, f"cannot read this model's answers: {exc}",
                       type_="server_error", code="output_format_unavailable") from None
    request, skip = None, True
    if fmt is not None:
        request = _parser_request(req, mode)
        skip = fmt.skip_special_tokens
    return OutputPlan(mode=mode, tool_parser=tool_parser, reasoning_parser=reasoning,
                      named=named, parallel=req.parallel_tool_calls, stream=req.stream,
                      format=fmt, request=request, skip_special_tokens=skip)


def _parser_request(req: ChatCompletionRequest, mode: str) -> Any:
    """The request as vLLM's parsers read it: its tools (typed as vLLM types them) and
    whether calls are looked for."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionRequest as ParserRequest,
    )

    tools = [{"type": "function", "function": t.function.described()}
             for t in req.tools or []] if mode == "auto" else None
    return ParserRequest(model=req.model, messages=[], tools=tools,
                         tool_choice="auto" if mode == "auto" else "none")


def chat_history(req: ChatCompletionRequest, tool_parser: str | None,
                 template_has_tools: bool) -> tuple[list[dict[str, Any]], list | None]:
    """The messages (developer read as system) and the tools for the chat template."""
    msgs: list[dict[str, Any]] = []
    for m in req.messages:
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                               "content": m.text()}
        if m.tool_calls:
            msg["tool_calls"] = m.tool_calls
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        msgs.append(msg)
    return render_history(msgs, req.tools, req.tool_choice, tool_parser, template_has_tools)
