"""The chunk-path benchmark runs its requests through the frontend's app, both ways, and
refuses to report a measurement of requests that did not stream."""

from __future__ import annotations

import json

import pytest

from .loader import load_benchmark

pytestmark = pytest.mark.unit

bench_chunk_path = load_benchmark("bench_chunk_path")


@pytest.mark.parametrize("backend", ["bare", "in_process"])
def test_it_measures_streamed_answers(backend, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert bench_chunk_path.main(["--tokens", "8", "--requests", "3", "--rounds", "1",
                                  "--backend", backend, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["backend"] == backend and report["tokens"] == 8
    assert report["median_cpu_us_per_chunk"] > 0


def test_it_measures_completions_of_token_id_prompts(tmp_path):
    out = tmp_path / "r.json"
    assert bench_chunk_path.main(["--tokens", "4", "--prompt-ids", "500", "--requests", "2",
                                  "--rounds", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["prompt_ids"] == 500 and report["median_cpu_ms_per_request"] > 0


def test_a_request_that_does_not_stream_stops_it(monkeypatch):
    async def refused(app, body, path="/v1/chat/completions"):
        return 400, 1

    monkeypatch.setattr(bench_chunk_path, "one", refused)
    with pytest.raises(SystemExit, match="answered 400"):
        bench_chunk_path.main(["--tokens", "8", "--requests", "1", "--rounds", "1"])


def test_every_warm_up_request_is_sent_before_measuring(monkeypatch):
    sent = []

    async def counted(app, body, path="/v1/chat/completions"):
        sent.append(path)
        return 200, 8

    monkeypatch.setattr(bench_chunk_path, "one", counted)
    assert bench_chunk_path.main(["--tokens", "8", "--requests", "3", "--rounds", "2"]) == 0
    assert len(sent) == bench_chunk_path.WARMUP + 2 * 3
