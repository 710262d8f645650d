"""The chunk-path benchmark runs its requests through the frontend's app, both ways, and
refuses to report a measurement of requests that did not stream."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]


def _load():
    spec = importlib.util.spec_from_file_location("bench_chunk_path",
                                                  REPO / "benchmarks" / "bench_chunk_path.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


bench_chunk_path = _load()


@pytest.mark.parametrize("backend", ["bare", "in_process"])
def test_it_measures_streamed_answers(backend, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert bench_chunk_path.main(["--tokens", "8", "--requests", "3", "--rounds", "1",
                                  "--backend", backend, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["backend"] == backend and report["tokens"] == 8
    assert report["median_cpu_us_per_chunk"] > 0


def test_a_request_that_does_not_stream_stops_it(monkeypatch):
    async def refused(app, body):
        return 400, 1

    monkeypatch.setattr(bench_chunk_path, "one", refused)
    with pytest.raises(SystemExit, match="answered 400"):
        bench_chunk_path.main(["--tokens", "8", "--requests", "1", "--rounds", "1"])
