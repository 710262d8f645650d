"""Which OpenAI request parameters are served, and by whom: the table the frontend decides
with and the API docs' compatibility table is printed from.

Each row says who serves a parameter: the frontend itself for every engine (``n`` fans
out, stop strings are matched on the detokenised text...), the engine (then only the
graph's engines that declare it, ``EngineRequestParams``, serve it), or nobody.  The
frontend names no engine: the supervisor resolves each engine of the graph through the
engine registry and hands their declarations over in the run config
(``ComponentRunConfig.engine_params``).

A parameter sent with its no-op value (``n: 1``, ``presence_penalty: 0``...) is always
accepted.  Otherwise it is served only when every engine of the graph honours it; an
engine that cannot is named in the 400, so a client is never answered as if a parameter
it sent had been applied.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from splitserve.contracts.config import ComponentRunConfig
from splitserve.contracts.engine import EngineRequestParams

from .errors import APIError

BOTH = frozenset({"chat", "completion"})
CHAT = frozenset({"chat"})
COMPLETION = frozenset({"completion"})

ServedBy = Literal["frontend", "engine", "nobody"]
FRONTEND: ServedBy = "frontend"
ENGINE: ServedBy = "engine"
NOBODY: ServedBy = "nobody"


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
    """One request parameter: where it applies, its no-op test, who serves it."""

    param: str
    endpoints: frozenset[str]
    is_noop: Callable[[Any], bool]
    served_by: ServedBy
    """``engine``: the parameter is one of ``contracts.engine.EngineParam``, and served
    only where every engine of the graph declares it."""
    note: str = ""
    """What the docs' table says of it for every engine (each engine's own notes, from its
    declaration, follow)."""


def _any(v: Any) -> bool:
    return True


CAPABILITIES: tuple[Capability, ...] = (
    Capability("model", BOTH, _any, FRONTEND, "a served model name of the graph: "
               "Common.served_model_name or a Models pool's, each served by its own "
               "workers, or a LoRA adapter's name once a worker has it loaded, served on "
               "its base model's workers (docs/lora.md; engines that serve LoRA only; "
               "another name: 404 model_not_found)"),
    Capability("n", BOTH, _is(1), FRONTEND, "the frontend fans out n requests; the others "
               "start after the first one's first token and reuse its cached prompt"),
    Capability("stop", BOTH, _is_none, FRONTEND, "matched on the detokenised text"),
    Capability("max_completion_tokens", BOTH, _is_none, FRONTEND),
    Capability("stream_options", BOTH, _is_none, FRONTEND, "include_usage: a last chunk "
               "with the usage"),
    Capability("seed", BOTH, _is_none, ENGINE),
    Capability("presence_penalty", BOTH, _is(0), ENGINE),
    Capability("frequency_penalty", BOTH, _is(0), ENGINE),
    Capability("repetition_penalty", BOTH, _is(1), ENGINE, "extension"),
    Capability("top_k", BOTH, _is(0, -1), ENGINE, "extension"),
    Capability("min_p", BOTH, _is(0), ENGINE, "extension"),
    Capability("min_tokens", BOTH, _is(0), ENGINE, "extension"),
    Capability("logit_bias", BOTH, lambda v: v is None or v == {}, ENGINE),
    Capability("logprobs", CHAT, _is(False), ENGINE),
    Capability("top_logprobs", CHAT, _is(0), ENGINE),
    Capability("logprobs", COMPLETION, _is_none, ENGINE),
    Capability("echo", COMPLETION, _is(False), FRONTEND, "with logprobs, the prompt's "
               "log-probabilities need an engine that honours logprobs"),
    Capability("best_of", COMPLETION, _is(1), NOBODY),
    Capability("suffix", COMPLETION, lambda v: v is None or v == "", NOBODY),
    Capability("response_format", CHAT, lambda v: v is None or v == {"type": "text"},
               ENGINE, "json_object and json_schema, enforced by token masks"),
    Capability("tools", CHAT, _is_empty_list, FRONTEND, "calls are read from the answer by "
               "vLLM's parser for the model's format (Frontend.tool_call_parser, or "
               "chosen from the chat template)"),
    Capability("tool_choice", CHAT, lambda v: v in (None, "none", "auto"), ENGINE,
               "none and auto on every engine; required and a named function force the "
               "call with a JSON schema (structured output)"),
    Capability("parallel_tool_calls", CHAT, lambda v: v is None or type(v) is bool,
               FRONTEND, "false: one call at most; required: at most 8"),
    Capability("functions", CHAT, _is_empty_list, NOBODY, "deprecated: send tools"),
    Capability("function_call", CHAT, lambda v: v is None or v == "none", NOBODY,
               "deprecated: send tool_choice"),
    Capability("audio", CHAT, _is_none, NOBODY),
    Capability("modalities", CHAT, lambda v: v is None or v == ["text"], NOBODY),
    Capability("prediction", CHAT, _is_none, NOBODY),
    Capability("web_search_options", CHAT, _is_none, NOBODY),
    Capability("reasoning_effort", CHAT, _is_none, NOBODY),
    Capability("store", CHAT, _is(False), NOBODY, "this server keeps no completions "
               "(as /v1/responses keeps no responses)"),
    Capability("verbosity", CHAT, lambda v: v is None or v == "medium", NOBODY),
    Capability("service_tier", CHAT, lambda v: v in (None, "auto", "default"), NOBODY,
               "one tier here: priority classes are the priority header's "
               "(docs/qos.md)"),
)

GraphEngines = Mapping[str, EngineRequestParams]
"""The graph's engines by name, with what each declares it honours."""


def capabilities(kind: str) -> list[Capability]:
    """The table's rows for one endpoint kind ("chat" or "completion")."""
    return [c for c in CAPABILITIES if kind in c.endpoints]


def graph_engines(run: ComponentRunConfig) -> dict[str, EngineRequestParams]:
    """The graph's engines with their declarations, from the frontend's run config (the
    supervisor put them there from the engine registry)."""
    return {name: run.engine_params[name] for name in run.engines}


def refuse_unhonoured(kind: str, data: dict[str, Any], engines: GraphEngines) -> None:
    """400 naming the first parameter of ``data`` (a decoded request body) that is not
    a no-op and that this server, or one of the graph's ``engines``, does not honour.

    Called by request validation before the body is parsed into its model."""
    for cap in capabilities(kind):
        if cap.param not in data or cap.is_noop(data[cap.param]):
            continue
        if cap.served_by == NOBODY:
            raise APIError(400, f"'{cap.param}' is not supported by this server (send it "
                           "unset or with its default value)", param=cap.param,
                           code="unsupported_parameter")
        if cap.served_by == FRONTEND:
            continue
        missing = [name for name, declared in engines.items()
                   if not declared.honours(cap.param)]
        if missing:
            raise APIError(400, f"'{cap.param}' is not supported by the {missing[0]} engine "
                           f"this model is served with (send it unset or with its default "
                           "value)", param=cap.param, code="unsupported_parameter")


def honoured_by(cap: Capability, declared: EngineRequestParams) -> bool:
    """Whether a graph of this one engine serves ``cap``'s parameter when sent."""
    return cap.served_by == FRONTEND or (cap.served_by == ENGINE
                                         and declared.honours(cap.param))


def markdown_table(engines: GraphEngines) -> str:
    """The compatibility table (parameter x engine) as Markdown, for ``engines`` (every
    registered engine's declaration, in the registry's order: docs/api.md holds it)."""
    head = "| Parameter | Endpoints | " + " | ".join(engines) + " | Notes |"
    rule = "|" + "---|" * (len(engines) + 3)
    lines = [head, rule]
    for cap in CAPABILITIES:
        where = ", ".join(sorted(cap.endpoints))
        cells = ["honoured" if honoured_by(cap, d) else "refused" for d in engines.values()]
        notes = [cap.note, *(d.notes.get(cap.param, "") for d in engines.values())]
        note = "; ".join(n for n in notes if n)
        lines.append(f"| `{cap.param}` | {where} | " + " | ".join(cells) + f" | {note} |")
    return "\n".join(lines) + "\n"


def replace_table(text: str, table: str) -> str:
    """``text`` (a Markdown document) with the part between the table markers replaced
    by ``table``."""
    head, rest = text.split(TABLE_BEGIN, 1)
    _, tail = rest.split(TABLE_END, 1)
    return f"{head}{TABLE_BEGIN}\n{table}{TABLE_END}{tail}"


def committed_table(text: str) -> str:
    """The table between the markers of ``text``, as ``markdown_table`` renders it."""
    return text.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0].removeprefix("\n")


TABLE_BEGIN = "<!-- capabilities table: generated by capabilities.py, do not edit -->"
TABLE_END = "<!-- end of capabilities table -->"
