"""Which OpenAI request parameters each engine honours: the one table the frontend decides
with and the API docs' compatibility table is printed from.

A parameter sent with its no-op value (``n: 1``, ``presence_penalty: 0``...) is always
accepted.  Otherwise it is served only when every engine of the graph honours it; an
engine that cannot is named in the 400, so a client is never answered as if a parameter
it sent had been applied.  Parameters the frontend implements itself (``n`` fans out,
stop strings are matched on the detokenised text) hold for every engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .errors import APIError

ENGINES = ("torch", "vllm", "sglang", "trtllm", "mocker")
EVERY = frozenset(ENGINES)
NONE: frozenset[str] = frozenset()
BOTH = frozenset({"chat", "completion"})
CHAT = frozenset({"chat"})
COMPLETION = frozenset({"completion"})


def _is(*values: Any) -> Callable[[Any], bool]:
    """No-op when unset or one of ``values`` (numbers compare by value, not by type)."""
    def check(v: Any) -> bool:
        if v is None:
            return True
        if type(v) is bool:
            return any(type(x) is bool and x is v for x in values)
        return any(type(x) is not bool and type(v) in (int, float) and v == x
                   for x in values)
    return check


def _is_empty(v: Any) -> bool:
    return v is None or v == [] or v == {}


def _is_empty_list(v: Any) -> bool:
    return v is None or v == []


def _is_none(v: Any) -> bool:
    return v is None


@dataclass(frozen=True)
class Capability:
    """One request parameter: where it applies, its no-op test, who honours it."""

    param: str
    endpoints: frozenset[str]
    is_noop: Callable[[Any], bool]
    engines: frozenset[str]
    note: str = ""


_SAMPLING_ENGINES = frozenset({"torch", "vllm", "sglang", "trtllm"})
_LOGPROB_ENGINES = frozenset({"torch", "vllm", "sglang", "trtllm"})
_STRUCTURED_ENGINES = frozenset({"torch", "vllm", "sglang", "trtllm"})

CAPABILITIES: tuple[Capability, ...] = (
    Capability("n", BOTH, _is(1), EVERY, "the frontend fans out n requests; the others "
               "start after the first one's first token and reuse its cached prompt"),
    Capability("stop", BOTH, _is_none, EVERY, "matched on the detokenised text"),
    Capability("max_completion_tokens", BOTH, _is_none, EVERY),
    Capability("stream_options", BOTH, _is_none, EVERY, "include_usage: a last chunk "
               "with the usage"),
    Capability("seed", BOTH, _is_none, _SAMPLING_ENGINES, "SGLang only with "
               "deterministic_inference (refused by the worker otherwise)"),
    Capability("presence_penalty", BOTH, _is(0), _SAMPLING_ENGINES),
    Capability("frequency_penalty", BOTH, _is(0), _SAMPLING_ENGINES),
    Capability("repetition_penalty", BOTH, _is(1), _SAMPLING_ENGINES, "extension"),
    Capability("top_k", BOTH, _is(0, -1), _SAMPLING_ENGINES, "extension"),
    Capability("min_p", BOTH, _is(0), _SAMPLING_ENGINES, "extension"),
    Capability("min_tokens", BOTH, _is(0), _SAMPLING_ENGINES, "extension"),
    Capability("logit_bias", BOTH, lambda v: v is None or v == {}, frozenset({"torch", "vllm", "sglang"})),
    Capability("logprobs", CHAT, _is(False), _LOGPROB_ENGINES),
    Capability("top_logprobs", CHAT, _is(0), _LOGPROB_ENGINES),
    Capability("logprobs", COMPLETION, _is_none, _LOGPROB_ENGINES),
    Capability("echo", COMPLETION, _is(False), EVERY, "with logprobs, the prompt's "
               "log-probabilities need an engine that honours logprobs; TensorRT-LLM "
               "workers refuse echo with logprobs (no prompt log-probabilities)"),
    Capability("best_of", COMPLETION, _is(1), NONE),
    Capability("suffix", COMPLETION, lambda v: v is None or v == "", NONE),
    Capability("response_format", CHAT, lambda v: v is None or v == {"type": "text"},
               _STRUCTURED_ENGINES, "json_object and json_schema, enforced by token masks "
               "(torch: xgrammar; vLLM: its structured outputs; SGLang: its json_schema, "
               "with engine_args.structured_output; TensorRT-LLM: GuidedDecodingParams, "
               "with engine_args.guided_decoding_backend; workers refuse it otherwise)"),
    Capability("tools", CHAT, _is_empty_list, EVERY, "calls are read from the answer by "
               "Frontend.tool_call_parser (hermes, llama3_json, pythonic); tool_choice auto "
               "needs one"),
    Capability("tool_choice", CHAT, lambda v: v in (None, "none", "auto"), _STRUCTURED_ENGINES,
               "none and auto on every engine; required and a named function force the "
               "call with a JSON schema (structured output)"),
    Capability("parallel_tool_calls", CHAT, lambda v: v is None or type(v) is bool, EVERY,
               "false: one call at most"),
    Capability("functions", CHAT, _is_empty_list, NONE, "deprecated: send tools"),
    Capability("function_call", CHAT, lambda v: v is None or v == "none", NONE,
               "deprecated: send tool_choice"),
    Capability("audio", CHAT, _is_none, NONE),
    Capability("modalities", CHAT, lambda v: v is None or v == ["text"], NONE),
    Capability("prediction", CHAT, _is_none, NONE),
    Capability("web_search_options", CHAT, _is_none, NONE),
    Capability("reasoning_effort", CHAT, _is_none, NONE),
)


def capabilities(kind: str) -> list[Capability]:
    """The table's rows for one endpoint kind ("chat" or "completion")."""
    return [c for c in CAPABILITIES if kind in c.endpoints]


def refuse_unhonoured(kind: str, data: dict[str, Any], engines: Iterable[str]) -> None:
    """400 naming the first parameter of ``data`` (a decoded request body) that is not
    a no-op and that this server, or one of the graph's ``engines``, does not honour.

    Called by request validation before the body is parsed into its model."""
    engines = tuple(engines)
    for cap in capabilities(kind):
        if cap.param not in data or cap.is_noop(data[cap.param]):
            continue
        if not cap.engines:
            raise APIError(400, f"'{cap.param}' is not supported by this server (send it "
                           "unset or with its default value)", param=cap.param,
                           code="unsupported_parameter")
        missing = [e for e in engines if e not in cap.engines]
        if missing:
            raise APIError(400, f"'{cap.param}' is not supported by the {missing[0]} engine "
                           f"this model is served with (send it unset or with its default "
                           "value)", param=cap.param, code="unsupported_parameter")


def markdown_table() -> str:
    """The compatibility table (parameter x engine) as Markdown; docs/api.md holds it."""
    head = "| Parameter | Endpoints | " + " | ".join(ENGINES) + " | Notes |"
    rule = "|" + "---|" * (len(ENGINES) + 3)
    lines = [head, rule]
    for cap in CAPABILITIES:
        where = ", ".join(sorted(cap.endpoints))
        cells = ["honoured" if e in cap.engines else "refused" for e in ENGINES]
        lines.append(f"| `{cap.param}` | {where} | " + " | ".join(cells) + f" | {cap.note} |")
    return "\n".join(lines) + "\n"


def write_docs(path: str = "docs/api.md") -> None:
    """Replace the table between the markers of ``path`` with ``markdown_table()``."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    head, rest = text.split(TABLE_BEGIN, 1)
    _, tail = rest.split(TABLE_END, 1)
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"{head}{TABLE_BEGIN}\n{markdown_table()}{TABLE_END}{tail}")


TABLE_BEGIN = "<!-- capabilities table: generated by capabilities.py, do not edit -->"
TABLE_END = "<!-- end of capabilities table -->"

if __name__ == "__main__":  # python -m splitserve.components.frontend.capabilities [--write]
    import sys

    if "--write" in sys.argv[1:]:
        write_docs()
    else:
        print(markdown_table(), end="")
