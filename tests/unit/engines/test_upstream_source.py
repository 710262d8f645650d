"""The contract tests' reader of upstream source cannot pass quietly: it skips only when
a distribution is absent (naming it) and fails, naming what is gone, when the pinned
release lacks a file or a piece of code, or when another release is installed."""

from __future__ import annotations

import ast
import importlib.metadata
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.unit.engines import upstream

pytestmark = pytest.mark.unit


@pytest.fixture
def installed(monkeypatch, tmp_path: Path):
    """Pretend distributions: name -> version, their files under ``tmp_path``."""
    dists: dict[str, str] = {}

    def distribution(name: str):
        if name not in dists:
            raise importlib.metadata.PackageNotFoundError(name)
        return SimpleNamespace(version=dists[name], locate_file=lambda rel: tmp_path / rel)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    return dists, tmp_path


def outcome(fn) -> tuple[str, str]:
    try:
        fn()
    except pytest.skip.Exception as e:
        return "skipped", str(e)
    except pytest.fail.Exception as e:
        return "failed", str(e)
    return "passed", ""


def test_an_absent_distribution_skips_naming_it(installed):
    kind, why = outcome(lambda: upstream.dynamo_source("sglang/shutdown.py"))
    assert kind == "skipped" and f"ai-dynamo {upstream.PINS['ai-dynamo']} is not installed" in why


def test_another_release_fails(installed):
    dists, _ = installed
    dists["sglang"] = "0.0.1"
    kind, why = outcome(lambda: upstream.sglang_source("srt/environ.py"))
    assert kind == "failed" and "sglang 0.0.1 is installed" in why


def test_a_missing_package_file_or_symbol_fails_naming_it(installed):
    dists, root = installed
    dists["ai-dynamo"] = upstream.PINS["ai-dynamo"]
    kind, why = outcome(lambda: upstream.dynamo_source("sglang/shutdown.py"))
    assert kind == "failed" and "without its dynamo/ package" in why
    (root / "dynamo/sglang").mkdir(parents=True)
    kind, why = outcome(lambda: upstream.dynamo_source("sglang/shutdown.py"))
    assert kind == "failed" and "dynamo/sglang/shutdown.py is missing" in why
    (root / "dynamo/sglang/shutdown.py").write_text("def guard():\n    pass\n")
    src = upstream.dynamo_source("sglang/shutdown.py")
    assert outcome(lambda: src.require("def guard")) == ("passed", "")
    kind, why = outcome(lambda: src.require("def guard", "loop.add_signal_handler = "))
    assert kind == "failed" and "loop.add_signal_handler = " in why and "shutdown.py" in why
    kind, why = outcome(lambda: src.after("def gone", 10))
    assert kind == "failed" and "'def gone'" in why
    kind, why = outcome(lambda: src.node(ast.ClassDef, "Guard"))
    assert kind == "failed" and "'Guard'" in why
