"""Tool-call parsers imported in the background once the frontend is ready: each model
with a tool-call format is loaded once, a model without one is skipped, and a
tokenizer that lacks the format's markers is logged without stopping the others."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from splitserve.components.frontend import main as frontend_main
from splitserve.components.frontend.config import FrontendConfig

pytestmark = pytest.mark.unit


def lane(name: str, tool: str | None, reasoning: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(name=name, tool_call_parser=tool, reasoning_parser=reasoning,
                           codec=SimpleNamespace(tok=f"tokenizer of {name}"))


def test_each_model_with_a_tool_format_is_loaded_once_and_a_failure_is_logged(
        monkeypatch, caplog):
    loaded = []

    def load(tool, reasoning, tok):
        loaded.append((tool, reasoning, tok))
        if tool == "mistral":
            raise ValueError("the tokenizer has no [TOOL_CALLS] token")

    monkeypatch.setattr(frontend_main.formats, "load", load)
    lanes = [lane("a", "hermes"), lane("b", None), lane("c", "mistral"),
             lane("d", "qwen3_coder", "qwen3")]
    with caplog.at_level(logging.INFO, logger="splitserve.frontend"):
        asyncio.run(frontend_main._preload_formats(lanes))
    assert loaded == [("hermes", None, "tokenizer of a"),
                      ("mistral", None, "tokenizer of c"),
                      ("qwen3_coder", "qwen3", "tokenizer of d")]
    text = caplog.text
    assert "tool calls of c cannot be read: the tokenizer has no [TOOL_CALLS] token" in text
    assert "tool-call parser hermes for a ready" in text
    assert "tool-call parser qwen3_coder for d ready" in text


def test_preloading_is_on_by_default_and_can_be_turned_off():
    assert FrontendConfig().preload_parsers is True
    assert FrontendConfig(preload_parsers=False).preload_parsers is False


def test_a_failed_import_is_logged_and_the_start_goes_on(monkeypatch, caplog):
    def load(tool, reasoning, tok):
        raise ImportError("no module named vllm.parser")

    monkeypatch.setattr(frontend_main.formats, "load", load)
    with caplog.at_level(logging.WARNING, logger="splitserve.frontend"):
        asyncio.run(frontend_main._preload_formats([lane("a", "hermes")]))
    assert "could not import the tool-call parser hermes for a" in caplog.text
