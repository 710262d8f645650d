"""Which tool-call and reasoning formats a model writes, and vLLM's parsers for them.

The parsers themselves are vLLM's (``vllm.tool_parsers``, ``vllm.reasoning``, composed by
``vllm.parser.ParserManager`` as vLLM's own server composes them): about fifty tool-call
and forty reasoning formats, maintained upstream.  Their names are read from vLLM's two
registries (the literal ``_TOOL_PARSERS_TO_REGISTER`` / ``_REASONING_PARSERS_TO_REGISTER``
tables) without importing vLLM, so a config is checked in milliseconds; the parser
modules are imported only when a request first needs one (``load``), because any vLLM
module brings torch and vLLM's config with it: about 7 s and +500 MiB on the first
import (docs/results/output_formats.md).

``detect`` chooses the formats from the model's chat template when the config names none
(the rule is ``DETECTION`` below, first match wins).
"""

from __future__ import annotations

import ast
import functools
import gc
import importlib.util
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# (markers that must all appear in the chat template, tool-call parser, reasoning
# parser when the template also thinks, why), first match wins.  Each row is the format
# the family's own template writes calls in; markers are the literal tokens or words of
# that format, so a fine-tune that keeps its family's template keeps its parser.
DETECTION: tuple[tuple[tuple[str, ...], str, str | None, str], ...] = (
    (("<|channel|>", "<|call|>"), "openai", "openai_gptoss", "harmony channels (gpt-oss)"),
    (("<|tool_calls_section_begin|>",), "kimi_k2", "kimi_k2", "Kimi K2 tool sections"),
    (("<｜tool▁calls▁begin｜>", "```json"), "deepseek_v3", "deepseek_r1",
     "DeepSeek V3 / R1 tool calls with a fenced JSON body"),
    (("<｜tool▁calls▁begin｜>",), "deepseek_v31", "deepseek_r1", "DeepSeek V3.1 tool calls"),
    (("<arg_key>", "<arg_value>"), "glm45", "glm45", "GLM 4.5 key/value tool calls"),
    (("[TOOL_CALLS]",), "mistral", "mistral", "Mistral [TOOL_CALLS]"),
    (("<function=", "<parameter="), "qwen3_coder", "qwen3", "Qwen3-Coder XML tool calls"),
    (("<tool_call>",), "hermes", "qwen3", "<tool_call> JSON (Hermes, Qwen 2.5, Qwen3)"),
    (("<|python_tag|>",), "llama3_json", None, "Llama 3 JSON calls (<|python_tag|>)"),
)
# A template that thinks: the reasoning parser of a row above, or, for a template that
# matched no row, ``qwen3`` when thinking can be switched off in the template
# (``enable_thinking``) and ``deepseek_r1`` (the answer starts inside the reasoning)
# otherwise.
THINK_MARKERS = ("<think>", "[THINK]", "<|channel|>")
HARMONY_TOOL, HARMONY_REASONING = "openai", "openai_gptoss"


@functools.cache
def _registry(package: str, table: str) -> tuple[str, ...]:
    """The names in vLLM's lazy registry ``table`` of ``vllm/<package>/__init__.py``, read
    as source (importing it would import vLLM); empty when vLLM is not installed."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return ()
    source = Path(spec.submodule_search_locations[0], package, "__init__.py")
    for node in ast.parse(source.read_text()).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target",
                                                                              None)
        if isinstance(target, ast.Name) and target.id == table and node.value is not None:
            return tuple(sorted(ast.literal_eval(node.value)))
    return ()


def tool_parser_names() -> tuple[str, ...]:
    """Every tool-call parser name vLLM registers (``Frontend.tool_call_parser``)."""
    return _registry("tool_parsers", "_TOOL_PARSERS_TO_REGISTER")


def reasoning_parser_names() -> tuple[str, ...]:
    """Every reasoning parser name vLLM registers (``Frontend.reasoning_parser``)."""
    return _registry("reasoning", "_REASONING_PARSERS_TO_REGISTER")


def _check(kind: str, name: str | None, known: tuple[str, ...]) -> str | None:
    if name is None or name in known:
        return name
    if not known:
        raise ValueError(f"unknown {kind} {name!r}: vLLM's parser modules are not installed")
    raise ValueError(f"unknown {kind} {name!r}; known (vLLM's names): {', '.join(known)}")


def check_tool_parser(name: str | None) -> str | None:
    """Config validation: ``name`` unchanged, or ValueError listing the known ones."""
    return _check("tool call parser", name, tool_parser_names())


def check_reasoning_parser(name: str | None) -> str | None:
    """Config validation: ``name`` unchanged, or ValueError listing the known ones."""
    return _check("reasoning parser", name, reasoning_parser_names())


@dataclass(frozen=True)
class Detected:
    """The formats chosen for a model, and why (logged once at start)."""

    tool: str | None
    reasoning: str | None
    why: str


def template_text(template: Any) -> str:
    """A tokenizer's chat template as one text (several named templates joined)."""
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    if isinstance(template, list):  # [{"name": ..., "template": ...}] in tokenizer_config
        return "\n".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return template or ""


def detect(template: str, renders_tools: bool) -> Detected:
    """The formats of a model whose chat template is ``template``.

    ``renders_tools``: whether the template writes the tool definitions itself.  One that
    does not gets the tools described by the frontend in the Hermes format (a system
    message with ``<tools>`` and ``<tool_call>`` examples, ``tools.render_history``), so
    its parser is ``hermes``.  A template that renders tools in a format no row of
    ``DETECTION`` knows gets no parser: tool_choice auto is then refused by name.
    """
    thinks = any(m in template for m in THINK_MARKERS)
    for markers, tool, reasoning, why in DETECTION:
        if all(m in template for m in markers):
            return Detected(tool, reasoning if thinks else None, f"chat template: {why}")
    reasoning = None
    if thinks:
        reasoning = "qwen3" if "enable_thinking" in template else "deepseek_r1"
    if not renders_tools:
        return Detected("hermes", reasoning, "chat template renders no tools: the frontend "
                        "describes them in the Hermes format")
    return Detected(None, reasoning, "chat template renders tools in a format with no "
                    "known parser")


def resolve(tool: str | None, reasoning: str | None, template: Any,
            renders_tools: bool) -> Detected:
    """The effective formats: those named in the config, the rest detected."""
    found = detect(template_text(template), renders_tools)
    if tool is not None and reasoning is not None:
        return Detected(tool, reasoning, "named in the config")
    if tool is None and reasoning is None:
        return found
    return Detected(tool if tool is not None else found.tool,
                    reasoning if reasoning is not None else found.reasoning,
                    f"partly named in the config; the rest from the {found.why}")


# Loading: vLLM's modules are imported once per process, under a lock (the tokenizer
# threads may ask together); these caches memoise imports, they hold no request state.
_LOAD = threading.Lock()


@functools.lru_cache(maxsize=8)
def _parser_class(tool: str | None, reasoning: str | None) -> type:
    from vllm.parser import ParserManager

    harmony = tool == HARMONY_TOOL or reasoning == HARMONY_REASONING
    cls = ParserManager.get_parser(tool_parser_name=tool, reasoning_parser_name=reasoning,
                                   enable_auto_tools=tool is not None, is_harmony=harmony)
    if harmony:
        # vLLM sets the parsers on its one HarmonyParser class; freeze them in a subclass
        # so another combination loaded later cannot change this one.
        cls = type("HarmonyFormat", (cls,), {"reasoning_parser_cls": cls.reasoning_parser_cls,
                                            "tool_parser_cls": cls.tool_parser_cls,
                                            "tool_strict_level": cls.tool_strict_level})
    return cls


@functools.lru_cache(maxsize=4)
def _cached_tokenizer(tokenizer: Any) -> Any:
    # vLLM's parsers read the vocabulary when built (marker token ids); transformers
    # rebuilds it on every get_vocab() call, so give them vLLM's caching proxy, as vLLM's
    # server does.
    from vllm.tokenizers.hf import get_cached_tokenizer

    try:
        return get_cached_tokenizer(tokenizer)
    except (AttributeError, TypeError):  # not a transformers tokenizer: use it as is
        return tokenizer


@dataclass(frozen=True)
class LoadedFormat:
    """vLLM's composed parser class for one (tool, reasoning) pair and the tokenizer its
    instances are built with; ``new()`` makes the per-choice parser."""

    tool: str | None
    reasoning: str | None
    parser_cls: type
    tokenizer: Any
    skip_special_tokens: bool
    """Whether a request with tools may be detokenised without its special tokens (vLLM's
    parsers turn this off where their markers are special tokens)."""
    reads_ids: bool
    """Whether a whole answer is parsed from its token ids (harmony) rather than its
    text (every other format)."""

    def new(self, tools: list[Any] | None) -> Any:
        return self.parser_cls(self.tokenizer, tools)


VLLM_LEVEL_VAR = "VLLM_LOGGING_LEVEL"


def quiet_engine_logs() -> None:
    """Keep vLLM's notes about an engine from the log of a process that runs none.

    Imported for its parsers, vLLM says which kernels it will use (``Triton is
    installed, but doesn't include CPU backend. Disabling Triton.`` and two INFO lines
    on every CPU machine) and, for each parser made, that auto tool choice is on.  Here
    vLLM logs warnings and errors only, its kernel-backend notes none, unless
    ``VLLM_LOGGING_LEVEL`` names a level (which then applies as set)."""
    if os.environ.get(VLLM_LEVEL_VAR):
        return
    logging.getLogger("vllm").setLevel(logging.WARNING)
    logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)


def imported() -> bool:
    """Whether vLLM's parsers are imported (``load`` then takes milliseconds)."""
    return _loaded.cache_info().currsize > 0


def load(tool: str | None, reasoning: str | None, tokenizer: Any) -> LoadedFormat | None:
    """vLLM's parser for ``tool`` and ``reasoning`` (None when both are None); the first
    call imports vLLM (seconds): call it off the event loop.  Raises ValueError when the
    model's tokenizer lacks a marker the format needs."""
    if tool is None and reasoning is None:
        return None
    with _LOAD:
        first = _loaded.cache_info().currsize == 0
        if first:
            quiet_engine_logs()
        loaded = _loaded(tool, reasoning, tokenizer)
        if first:
            # vLLM brought torch and some million objects that live as long as the
            # process: keep the collector from scanning them at every full collection.
            gc.freeze()
        return loaded


@functools.lru_cache(maxsize=8)
def _loaded(tool: str | None, reasoning: str | None, tokenizer: Any) -> LoadedFormat:
    cls = _parser_class(tool, reasoning)
    tok = _cached_tokenizer(tokenizer)
    try:
        parser = cls(tok)  # what vLLM checks at start: the tokenizer has the markers
    except Exception as exc:
        raise ValueError(f"the model's tokenizer cannot be read with tool call parser "
                         f"{tool!r} / reasoning parser {reasoning!r}: {exc}") from exc
    skip = True
    if tool is not None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        probe = ChatCompletionRequest(model="-", messages=[], tool_choice="auto", tools=[
            {"type": "function", "function": {"name": "f", "parameters": {}}}])
        skip = bool(parser.adjust_request(probe).skip_special_tokens)
    harmony = tool == HARMONY_TOOL or reasoning == HARMONY_REASONING
    return LoadedFormat(tool, reasoning, cls, tok, skip, reads_ids=harmony)
