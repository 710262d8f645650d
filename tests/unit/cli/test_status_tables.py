"""The CLI's tables piped into another command print every value whole: no column is
cut to fit an assumed 80-column terminal (`dynamo status`; every command prints on
``cli_console``)."""

from __future__ import annotations

import pytest

from splitserve.cli import status_cmd
from splitserve.cli.console import PIPED_WIDTH, cli_console

pytestmark = pytest.mark.unit

MODEL = "org/a-model-name-long-enough-to-need-a-wide-column-Instruct"
ENDPOINT = "dynamo.decodeworker_decode.generate"


def test_piped_tables_keep_every_value_whole(capsys):
    report = {
        "supervisors": [{"graph": "graphs.agg:Frontend", "pid": 1, "control": "http://127.0.0.1:1",
                         "replicas": [{"component": "DecodeWorker", "replica": 0, "model": MODEL,
                                       "pid": 4242, "state": "ready", "endpoint": ENDPOINT,
                                       "restarts": 0}],
                         "dependencies_down": []}],
        "etcd": {"http://127.0.0.1:2379": [
            {"namespace": "dynamo", "component": "decodeworker", "endpoint": "generate",
             "instance_id": 0x1782A23580DFF964, "address": "127.0.0.1:39657"}]},
    }
    status_cmd._print(report, [])
    out = capsys.readouterr().out
    assert "…" not in out
    rows = [line for line in out.splitlines() if "│" in line]
    assert any(MODEL in r and ENDPOINT in r for r in rows), out
    assert any("1782a23580dff964" in r and "127.0.0.1:39657" in r for r in rows), out


def test_the_cli_console_is_wide_only_when_piped(monkeypatch):
    monkeypatch.setattr("sys.stdout.isatty", lambda: False)
    assert cli_console().width == PIPED_WIDTH
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    monkeypatch.setenv("COLUMNS", "97")
    assert cli_console().width == 97


def test_the_lora_list_piped_keeps_each_path_and_worker_whole(monkeypatch, capsys):
    from splitserve.cli import lora_cmd

    path = "/srv/adapters/a-team/sql-assistant-rank-16-trained-on-the-long-schema-set"
    reply = {"data": [{"id": "sql", "base_model": MODEL, "path": path, "source": "api",
                       "served": True,
                       "workers": {"1782a23580dff964": {"state": "loaded"},
                                   "1782a23580dff966": {"state": "failed",
                                                        "error": "no slot left"}}}]}
    monkeypatch.setattr(lora_cmd, "_call", lambda *a, **k: (200, reply))
    monkeypatch.setattr(lora_cmd, "_check", lambda status, body: body)
    lora_cmd.list_(run=None, json_out=False, state_dir=None)
    out = capsys.readouterr().out
    assert "…" not in out
    row = next(line for line in out.splitlines() if "│ sql" in line)
    assert MODEL in row and path in row and "1782a23580dff966 failed: no slot left" in row
