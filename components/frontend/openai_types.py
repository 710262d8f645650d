"""Validation of OpenAI chat and completion requests.

Types are strict (no ``true`` for a number, no ``"0.5"`` for a float) and every error is a
400 naming the offending parameter, as OpenAI does.  Parameters this server or the
graph's engine does not honour are refused by name unless they carry their no-op value
(``capabilities.py`` holds that table): silently ignoring ``tools`` or a penalty would
return something the client did not ask for.  Fields OpenAI does not define are ignored
(clients send vendor extensions), except the sampling extensions vLLM also takes
(``top_k``, ``min_p``, ``min_tokens``, ``repetition_penalty``).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

import msgspec
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .capabilities import GraphEngines, refuse_unhonoured
from .errors import APIError, bad_request
from .tools import NamedToolChoice, ToolCallIn, ToolChoice, ToolDef, check_schema, forced_schema

StrictPositiveInt = Annotated[int, Field(strict=True, gt=0)]
TokenId = Annotated[int, Field(strict=True)]
# Seeds travel as signed 64-bit integers to every engine.
Seed = Annotated[int, Field(strict=True, ge=-(2**63), le=2**63 - 1)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool | None = None


Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = Field(min_length=1)
    n: Annotated[int, Field(strict=True, ge=1, le=16)] = 1
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    logit_bias: dict[str, Bias] | None = None
    top_k: Annotated[int, Field(strict=True, ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    min_tokens: Annotated[int, Field(strict=True, ge=0)] | None = None
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

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is not None and any(not (k.isascii() and k.isdigit()) for k in v):
            raise ValueError("keys must be token ids (decimal strings)")
        return v

    def bias_ids(self) -> dict[int, float]:
        """``logit_bias`` with integer token ids."""
        return {int(k): b for k, b in (self.logit_bias or {}).items()}

    def sampling_fields(self) -> dict[str, Any]:
        """The wire's SamplingOptions beyond temperature / top-p / seed (set ones only)."""
        out: dict[str, Any] = {}
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty",
                     "top_k", "min_p"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.logit_bias:
            out["logit_bias"] = self.bias_ids()
        return out

    def top_logprobs_asked(self) -> int | None:
        """Alternatives per sampled token to return (None: no log-probabilities)."""
        return None

    def prompt_logprobs_asked(self) -> int | None:
        """Alternatives per prompt token to return (None: no prompt log-probabilities)."""
        return None

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
    tool_calls: list[ToolCallIn] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _compiles(cls, v: dict[str, Any]) -> dict[str, Any]:
        """A schema the engines' grammar compiler cannot take is the client's error."""
        return check_schema(v)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _needs_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        return self

    def answer_schema(self) -> dict[str, Any] | None:
        """The JSON schema the answer must follow (None: free text)."""
        if self.type == "json_object":
            return {"type": "object"}
        if self.type == "json_schema" and self.json_schema is not None:
            return self.json_schema.schema_ or {"type": "object"}
        return None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    response_format: ResponseFormat | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[int, Field(strict=True, ge=0, le=20)] | None = None
    tools: list[ToolDef] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool = True

    @field_validator("tool_choice")
    @classmethod
    def _choice_names_a_tool(cls, v: ToolChoice | None, info: ValidationInfo
                             ) -> ToolChoice | None:
        tools = info.data.get("tools") or []
        if v in (None, "none", "auto"):
            return v
        if not tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(v, NamedToolChoice) and v.function.name not in {
                t.function.name for t in tools}:
            raise ValueError(f"names {v.function.name!r}, which is not one of the tools")
        fmt = info.data.get("response_format")
        if fmt is not None and fmt.answer_schema() is not None:
            raise ValueError("a forced tool call and a JSON response_format cannot both "
                             "set the answer's schema")
        return v

    def forced_tool_schema(self) -> dict[str, Any] | None:
        """The answer's schema when tool_choice forces a call (required / named)."""
        return forced_schema(self.tools or [], self.tool_choice, self.parallel_tool_calls)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def sampling_fields(self) -> dict[str, Any]:
        out = super().sampling_fields()
        schema = self.response_format.answer_schema() if self.response_format else None
        schema = self.forced_tool_schema() if schema is None else schema
        if schema is not None:
            out["guided_decoding"] = {"json": schema}
        return out


class CompletionRequest(_Request):
    # A batch of one (``["text"]``, ``[[ids]]``) is what harnesses such as lm-eval send.
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] = Field(min_length=1)
    logprobs: Annotated[int, Field(strict=True, ge=0, le=20)] | None = None
    echo: StrictBool = False

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_asked(self) -> int | None:
        return self.logprobs if self.echo else None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str | list):
            if len(v) != 1:
                raise ValueError("batched prompts are not supported; send one prompt")
            if isinstance(v[0], list) and not v[0]:
                raise ValueError("the prompt's token list is empty")
        return v

    def given_ids(self) -> list[int] | None:
        """The prompt's token ids when the client sent ids (None: text to tokenise)."""
        p = self.prompt
        if isinstance(p, list) and isinstance(p[0], list):
            return list(p[0])
        if isinstance(p, list) and isinstance(p[0], int):
            return list(p)
        return None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> dict[str, Any]:
    """Decode a request body; a 400 error for anything but a JSON object of valid text.

    Deep nesting, numbers with thousands of digits, NaN/Infinity, invalid UTF-8 and lone
    surrogates (``"\\ud800"``, which no tokenizer can encode) are all client errors.

    A body is first decoded by msgspec's strict decoder (a third of json's time on an
    8,000-id prompt): what it accepts, json reads the same (UTF-8 without a BOM, no
    NaN/Infinity, numbers in range, valid surrogate pairs only), so no walk for
    surrogates is needed.  Anything it refuses goes through json below, which accepts
    or refuses it with the messages clients have always had.
    """
    try:
        data = _strict_decode(raw)
    except (msgspec.MsgspecError, RecursionError):
        return _parse_json_lenient(raw)
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    return data


_strict_decode = msgspec.json.Decoder().decode


def _parse_json_lenient(raw: bytes) -> dict[str, Any]:
    """``parse_json`` for a body msgspec refused: json's reading and its errors."""
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise bad_request("request body is nested too deeply", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    # In a UTF-8 body a lone surrogate can only come from the forms _SURROGATE_ESCAPE
    # finds: without one there is nothing to find, and the walk over every string and
    # list item is skipped.  (json also reads UTF-16 and UTF-32 bodies, which
    # can carry a surrogate as is: those are always walked.)
    walk = json.detect_encoding(raw) != "utf-8" or _may_hold_surrogate(raw)
    bad = _first_unencodable(data) if walk else None
    if bad is not None:
        raise bad_request("string holds a lone UTF-16 surrogate (invalid Unicode)",
                          bad or None, "invalid_unicode")
    return data


# Where a surrogate can come from in a UTF-8 body: a \uD800-\uDFFF escape, or the bytes
# ED A0-BF (a surrogate encoded as UTF-8, which json decodes with "surrogatepass").
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def _may_hold_surrogate(raw: bytes) -> bool:
    """``_SURROGATE_ESCAPE`` in ``raw``; the two byte searches first (a body of token ids
    has neither, and they take a sixth of the pattern's time)."""
    return (b"\\u" in raw or b"\xed" in raw) and _SURROGATE_ESCAPE.search(raw) is not None


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


def validate(model: type[_Request], data: dict[str, Any],
             engines: GraphEngines | None = None) -> _Request:
    """Validate a decoded body; the first error becomes a 400 naming its parameter.

    ``engines``: the graph's engines; a parameter one of them does not honour is refused
    by name (see ``capabilities.py``)."""
    refuse_unhonoured("chat" if model is ChatCompletionRequest else "completion", data,
                      engines or {})
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid(exc) from None


def invalid(exc: ValidationError) -> APIError:
    """The 400 for a body's first validation error, naming its parameter."""
    err = exc.errors()[0]
    loc = list(err["loc"])
    # Drop pydantic's union-branch labels ("str", "list[...]") from the path.
    param = ".".join(str(p) for p in loc if not _is_branch(p)) or None
    msg = f"invalid value for '{param}': {err['msg']}" if param else err["msg"]
    return APIError(400, msg, param=param, code="invalid_value")


def _is_branch(part: Any) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none")
                                      or "[" in part or part.startswith("function-"))
