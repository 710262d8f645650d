"""Validation of OpenAI chat and completion requests.

Types are strict (no ``true`` for a number, no ``"0.5"`` for a float) and every error is a
400 naming the offending parameter, as OpenAI does.  OpenAI parameters this server does not
implement are refused by name unless they carry their no-op value (``n: 1``,
``logprobs: false``, ``presence_penalty: 0``...): silently ignoring ``tools`` or
``response_format`` would return something the client did not ask for.  Fields OpenAI
does not define are ignored (clients send vendor extensions).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator

from .errors import APIError, bad_request

StrictPositiveInt = Annotated[int, Field(strict=True, gt=0)]
TokenId = Annotated[int, Field(strict=True)]
# Seeds travel as signed 64-bit integers to every engine.
Seed = Annotated[int, Field(strict=True, ge=-(2**63), le=2**63 - 1)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool | None = None


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = Field(min_length=1)
    max_tokens: StrictPositiveInt | None = None
    max_completion_tokens: StrictPositiveInt | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> str | list[str] | None:
        if v == "" or (isinstance(v, list) and (len(v) > 4 or any(not s for s in v))):
            raise ValueError("at most 4 non-empty stop sequences")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(_Request):
    prompt: str | list[TokenId] | list[str] = Field(min_length=1)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("batched prompts are not supported; send one prompt")
        return v


def _is_none(v: Any) -> bool:
    return v is None


def _is_number(*values: float) -> Callable[[Any], bool]:
    return lambda v: v is None or (type(v) in (int, float) and v in values)


def _is_false(v: Any) -> bool:
    return v is None or v is False


def _is_empty_list(v: Any) -> bool:
    return v is None or v == []


def _is_empty_dict(v: Any) -> bool:
    return v is None or v == {}


# OpenAI parameters this server does not implement -> predicate "this value is a no-op".
_COMMON: dict[str, Callable[[Any], bool]] = {
    "n": _is_number(1),
    "logit_bias": _is_empty_dict,
    "presence_penalty": _is_number(0),
    "frequency_penalty": _is_number(0),
}
UNSUPPORTED: dict[str, dict[str, Callable[[Any], bool]]] = {
    "chat": {**_COMMON,
             "logprobs": _is_false,
             "top_logprobs": _is_number(0),
             "tools": _is_empty_list,
             "tool_choice": lambda v: v is None or v == "none",
             "functions": _is_empty_list,
             "function_call": lambda v: v is None or v == "none",
             "parallel_tool_calls": lambda v: v is None or type(v) is bool,
             "response_format": lambda v: v is None or v == {"type": "text"},
             "audio": _is_none,
             "modalities": lambda v: v is None or v == ["text"],
             "prediction": _is_none,
             "web_search_options": _is_none,
             "reasoning_effort": _is_none},
    "completion": {**_COMMON,
                   "logprobs": _is_number(0),
                   "echo": _is_false,
                   "best_of": _is_number(1),
                   "suffix": lambda v: v is None or v == ""},
}


def refuse_unsupported(kind: str, data: dict[str, Any]) -> None:
    """400 naming the first OpenAI parameter this server would otherwise ignore."""
    for name, is_noop in UNSUPPORTED[kind].items():
        if name in data and not is_noop(data[name]):
            raise APIError(400, f"'{name}' is not supported by this server (send it "
                           "unset or with its default value)", param=name,
                           code="unsupported_parameter")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> dict[str, Any]:
    """Decode a request body; a 400 error for anything but a JSON object of valid text.

    Deep nesting, numbers with thousands of digits, NaN/Infinity, invalid UTF-8 and lone
    surrogates (``"\\ud800"``, which no tokenizer can encode) are all client errors.
    """
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise bad_request("request body is nested too deeply", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    bad = _first_unencodable(data)
    if bad is not None:
        raise bad_request("string holds a lone UTF-16 surrogate (invalid Unicode)",
                          bad or None, "invalid_unicode")
    return data


def _first_unencodable(data: dict[str, Any]) -> str | None:
    """Dotted path of the first string (key or value) that is not valid Unicode text."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:  # iterative: bodies may be nested hundreds deep
        path, v = stack.pop()
        if isinstance(v, dict):
            for k, item in v.items():
                p = f"{path}.{k}" if path else str(k)
                if not _encodable(k):
                    return path
                stack.append((p, item))
        elif isinstance(v, list):
            stack.extend((f"{path}.{i}", item) for i, item in enumerate(v))
        elif isinstance(v, str) and not _encodable(v):
            return path
    return None


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def validate(model: type[_Request], data: dict[str, Any]) -> _Request:
    """Validate a decoded body; the first error becomes a 400 naming its parameter."""
    refuse_unsupported("chat" if model is ChatCompletionRequest else "completion", data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = list(err["loc"])
        # Drop pydantic's union-branch labels ("str", "list[...]") from the path.
        param = ".".join(str(p) for p in loc if not _is_branch(p)) or None
        msg = f"invalid value for '{param}': {err['msg']}" if param else err["msg"]
        raise APIError(400, msg, param=param, code="invalid_value") from None


def _is_branch(part: Any) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none")
                                      or "[" in part or part.startswith("function-"))
