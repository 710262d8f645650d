"""The files `dynamo serve` publishes (the ready file, control.json, the registry) are
replaced whole: a reader polling them never sees a truncated file."""

from __future__ import annotations

import json
import threading

import pytest

from splitserve.serve.runner import _write_json

pytestmark = pytest.mark.unit


def test_a_reader_never_sees_a_partial_file(tmp_path):
    path = tmp_path / "ready.json"
    rows = [{"component": f"Worker-{i}", "pid": i, "endpoint": "x" * 200} for i in range(200)]
    _write_json(path, {"ready": False, "rows": []})
    stop = threading.Event()
    bad: list[str] = []

    def read() -> None:
        while not stop.is_set():
            text = path.read_text()
            try:
                json.loads(text)
            except ValueError:
                bad.append(text[:40])

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(300):
            _write_json(path, {"ready": True, "round": i, "rows": rows})
    finally:
        stop.set()
        reader.join()
    assert not bad, f"{len(bad)} partial reads, e.g. {bad[0]!r}"
    assert json.loads(path.read_text())["round"] == 299
    assert [p.name for p in tmp_path.iterdir()] == ["ready.json"]  # no temporary left
