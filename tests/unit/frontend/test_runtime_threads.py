"""Frontend.runtime_threads: Dynamo's runtime threads in the frontend process, set before
the runtime starts, and never over what the environment says."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve.components.frontend import main as frontend_main
from splitserve.contracts.config import ConfigError
from splitserve.contracts.kit import component
from tests.run_configs import run_config_file

GRAPH = "graphs.agg:Frontend"
VAR = "DYN_RUNTIME_NUM_WORKER_THREADS"


@pytest.fixture(autouse=True)
def restore_environment():
    """``run`` sets the variable in this process: put back what was there."""
    import os

    before = os.environ.get(VAR)
    yield
    if before is None:
        os.environ.pop(VAR, None)
    else:
        os.environ[VAR] = before


def frontend_run_config(tmp_path: Path, overrides: list[str]) -> Path:
    return run_config_file(tmp_path, GRAPH, "mocker_agg_inproc.yaml", "Frontend", overrides)


def environment_seen_by_the_component(monkeypatch, config: Path) -> str | None:
    """Run the frontend's entry point with a stand-in for the component's async main
    (no runtime): what the runtime would have read."""
    import os

    seen = {}

    async def fake_amain(main, run_cfg):
        seen["value"] = os.environ.get(VAR)

    monkeypatch.setattr(component, "_amain", fake_amain)
    monkeypatch.setattr(component, "configure_logging", lambda *a: None)
    component.run(frontend_main.main, ["--config", str(config)],
                  runtime_env=frontend_main.runtime_env)
    return seen["value"]


def test_one_runtime_thread_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    assert environment_seen_by_the_component(
        monkeypatch, frontend_run_config(tmp_path, [])) == "1"


def test_the_setting_and_null(tmp_path, monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    assert environment_seen_by_the_component(monkeypatch, frontend_run_config(
        tmp_path, ["--Frontend.runtime_threads=3"])) == "3"
    monkeypatch.delenv(VAR, raising=False)
    assert environment_seen_by_the_component(monkeypatch, frontend_run_config(
        tmp_path, ["--Frontend.runtime_threads=null"])) is None


def test_the_environment_wins(tmp_path, monkeypatch):
    monkeypatch.setenv(VAR, "4")
    assert environment_seen_by_the_component(
        monkeypatch, frontend_run_config(tmp_path, [])) == "4"


def test_a_bad_value_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match="runtime_threads"):
        frontend_run_config(tmp_path, ["--Frontend.runtime_threads=0"])
