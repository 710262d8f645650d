"""SGLang's logging config file: written for an SGLang engine's start only, removed after;
no other process leaves one in the temporary folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from splitserve.components.engines.sglang import process
from splitserve.contracts.kit.component import SKIP_SGLANG_LOGGING

VAR = process.LOGGING_CONFIG_VARIABLE


def leftover_configs(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.json"))


def test_written_for_the_start_and_removed(monkeypatch, tmp_path):
    monkeypatch.delenv(VAR, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with process.sglang_logging_config():
        path = Path(os.environ[VAR])
        config = json.loads(path.read_text())
        assert "sglang" in config["loggers"]  # SGLang's loggers into Dynamo's handler
    assert VAR not in os.environ
    assert not path.exists()
    assert leftover_configs(tmp_path) == []


def test_removed_when_the_start_fails(monkeypatch, tmp_path):
    monkeypatch.delenv(VAR, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(RuntimeError), process.sglang_logging_config():
        raise RuntimeError("engine failed to start")
    assert leftover_configs(tmp_path) == []
    assert VAR not in os.environ


def test_a_path_the_environment_names_is_left_alone(monkeypatch, tmp_path):
    own = tmp_path / "mine.json"
    own.write_text("{}")
    monkeypatch.setenv(VAR, str(own))
    with process.sglang_logging_config():
        assert os.environ[VAR] == str(own)
    assert own.exists() and os.environ[VAR] == str(own)


def test_a_component_process_leaves_no_file(tmp_path):
    """A component's logging setup (every replica of every graph) writes nothing to the
    temporary folder; without the skip Dynamo's setup leaves one file per process."""
    code = ("from splitserve.contracts.kit.component import configure_logging; "
            "configure_logging('Worker', 0, 'warning')")
    env = {k: v for k, v in os.environ.items()
           if k not in (SKIP_SGLANG_LOGGING, VAR)}
    env["TMPDIR"] = str(tmp_path)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    assert leftover_configs(tmp_path) == []
    # the check can fail: Dynamo's own setup, not skipped, leaves its file there
    code = ("from dynamo.runtime.logging import configure_dynamo_logging; "
            "configure_dynamo_logging()")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    assert len(leftover_configs(tmp_path)) == 1
