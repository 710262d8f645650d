"""The worker-stream benchmark runs the aggregated shell's real stream path and reports
its CPU per token beside the bare engine stream's."""

from __future__ import annotations

import json

import pytest

from .loader import load_benchmark

pytestmark = pytest.mark.unit

bench_worker_stream = load_benchmark("bench_worker_stream")


def test_a_small_run_reports_both_paths(tmp_path):
    out = tmp_path / "r.json"
    result = bench_worker_stream.main(["--tokens", "8", "--requests", "5", "--rounds", "2",
                                       "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert len(result["shell_us_per_token"]) == len(result["bare_us_per_token"]) == 2
    assert result["shell_median"] > 0 and result["bare_median"] > 0


def test_the_shell_path_is_the_shells_own(monkeypatch):
    """The measured path is ``stream_chunks``: every token becomes one wire chunk."""
    chunks = []
    real = bench_worker_stream.stream_chunks

    async def counting(*args, **kwargs):
        async for c in real(*args, **kwargs):
            chunks.append(c)
            yield c

    monkeypatch.setattr(bench_worker_stream, "stream_chunks", counting)
    bench_worker_stream.main(["--tokens", "4", "--requests", "3", "--rounds", "1"])
    finals = [c for c in chunks if c.get("finish_reason")]
    assert finals and all(c["finish_reason"] == "length" for c in finals)
    assert len(chunks) == 4 * (10 + 3)  # the warm-up's 10 requests and the round's 3
