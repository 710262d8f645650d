"""`dynamo policy validate`, which needs no etcd: messages and exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from splitserve.cli.main import app

from .policy_factories import CONFIGS, edited, full

pytestmark = pytest.mark.unit


def run(*args: str):
    return CliRunner().invoke(app, ["policy", *args])


def test_valid_file_prints_one_line_and_exits_0() -> None:
    result = run("validate", str(CONFIGS / "policies" / "seed.yaml"))
    assert result.exit_code == 0, result.output
    assert len(result.output.strip().splitlines()) == 1 and "valid" in result.output


def test_invalid_file_lists_every_path_and_exits_2(tmp_path: Path) -> None:
    doc = edited(full(), "autoscale.prefill.min_replicas", 99)
    doc = edited(doc, "qos.default_class", "gold")
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = run("validate", str(path))
    assert result.exit_code == 2
    assert "autoscale.prefill.min_replicas: min_replicas (99)" in result.output
    assert "qos.default_class: default_class 'gold'" in result.output


def test_json_output_for_scripts(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(edited(full(), "cache.min_cache_hit_ratio", 7)))
    result = run("validate", "--json", str(path))
    assert result.exit_code == 2
    report = json.loads(result.stdout)
    assert report["valid"] is False
    assert report["errors"][0].startswith("cache.min_cache_hit_ratio: ")


def test_apply_refuses_an_invalid_file_before_looking_for_etcd(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("split_policy: {}\n")
    result = run("apply", str(path), "--state-dir", str(tmp_path / "state"))
    assert result.exit_code == 2


def test_commands_without_a_graph_say_how_to_point_at_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ETCD_ENDPOINTS", raising=False)
    result = run("history", "--state-dir", str(tmp_path / "state"))
    assert result.exit_code == 1 and "--etcd" in result.output
