"""Pure parts of benchmarks/trace_replay.py: traces, prompts, scaling, statistics, and
the streaming client against a scripted local HTTP server."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from .loader import load_benchmark

pytestmark = pytest.mark.unit

tr = load_benchmark("trace_replay")


# ---- traces ----------------------------------------------------------------------------
def write_mooncake(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    return path


MOONCAKE = [
    {"timestamp": 1000, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]},
    {"timestamp": 1500, "input_length": 600, "output_length": 5, "hash_ids": [0, 2]},
    {"timestamp": 4000, "input_length": 100, "output_length": 1, "hash_ids": [3]},
    {"timestamp": 9000, "input_length": 2048, "output_length": 64, "hash_ids": [4, 5, 6, 7]},
]


def test_mooncake_parsing_rebases_to_seconds(tmp_path):
    rows = tr.load_trace(write_mooncake(tmp_path / "t.jsonl", MOONCAKE))
    assert [r.t_s for r in rows] == [0.0, 0.5, 3.0, 8.0]
    assert rows[0].input_length == 1000 and rows[0].output_length == 10
    assert rows[1].hash_ids == [0, 2]


def test_mooncake_bad_row_names_line(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(MOONCAKE[0]) + "\n" + '{"timestamp": 1}\n')
    with pytest.raises(ValueError, match=":2:"):
        tr.load_mooncake(p)


def test_azure_csv_parsing(tmp_path):
    p = tmp_path / "a.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:17:03.9799600,4808,10\n"
                 "2023-11-16 18:17:04.0319600,3180,8\n"
                 "2023-11-16 18:17:05,110,27\n")
    rows = tr.load_trace(p)  # .csv -> azure
    assert [r.input_length for r in rows] == [4808, 3180, 110]
    assert [r.output_length for r in rows] == [10, 8, 27]
    assert rows[0].t_s == 0.0
    assert rows[1].t_s == pytest.approx(0.052, abs=1e-6)
    assert rows[2].t_s == pytest.approx(1.02004, abs=1e-6)
    assert all(r.hash_ids is None for r in rows)


def test_azure_csv_missing_column(tmp_path):
    p = tmp_path / "a.csv"
    p.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:17:03,1\n")
    with pytest.raises(ValueError, match="GeneratedTokens"):
        tr.load_azure_csv(p)


def test_window_and_time_scaling(tmp_path):
    rows = tr.load_trace(write_mooncake(tmp_path / "t.jsonl", MOONCAKE))
    w = tr.select_window(rows, start_s=0.5, duration_s=5)
    assert [r.t_s for r in w] == [0.0, 2.5]  # rebased to the window start; 8.0 is out
    assert rows[1].t_s == 0.5  # the input is not modified
    assert len(tr.select_window(rows, max_requests=3)) == 3
    assert [r.t_s for r in tr.scale_times(w, time_scale=0.5)] == [0.0, 1.25]
    assert [r.t_s for r in tr.scale_times(w, rate_scale=2)] == [0.0, 1.25]
    assert [r.t_s for r in tr.scale_times(w, time_scale=2, rate_scale=4)] == [0.0, 1.25]
    with pytest.raises(ValueError):
        tr.scale_times(w, time_scale=0)


# ---- prompts ---------------------------------------------------------------------------
def test_equal_hash_ids_give_equal_blocks_and_different_ids_differ():
    a = tr.BlockTokens(32, seed=0)
    b = tr.BlockTokens(32, seed=0)  # a fresh instance: no shared cache
    assert a.block(7) == b.block(7)
    assert len(a.block(7)) == 32
    assert a.block(7) != a.block(8)
    assert tr.BlockTokens(32, seed=1).block(7) != a.block(7)
    # ints and their string form are different keys
    assert a.block(7) != a.block("7")


def test_block_tokens_avoid_special_ids_and_stay_in_vocab():
    bt = tr.BlockTokens(512, seed=3, vocab_size=100, first_regular_id=17)
    ids = [t for h in range(50) for t in bt.block(h)]
    assert min(ids) >= 17 and max(ids) <= 99
    assert len(set(ids)) > 70  # spread over the range


def test_shared_prefix_in_trace_is_shared_in_tokens():
    rows = [tr.TraceRequest(0, 1000, 10, [0, 1]), tr.TraceRequest(1, 600, 5, [0, 2]),
            tr.TraceRequest(2, 100, 1, [3])]
    scaling = tr.TokenScaling(token_scale=16)
    reqs = tr.build_requests(rows, scaling, tr.BlockTokens(scaling.block_tokens))
    p0, p1, p2 = (r.prompt for r in reqs)
    assert len(p0) == math.ceil(1000 / 16) == 63 and len(p1) == math.ceil(600 / 16) == 38
    assert p0[:32] == p1[:32]  # hash id 0 -> one 32-token block in common
    assert p0[32:38] != p1[32:38]
    assert p2[:7] != p0[:7]
    # deterministic across builds
    again = tr.build_requests(rows, scaling, tr.BlockTokens(scaling.block_tokens))
    assert [r.prompt for r in again] == [p0, p1, p2]


def test_rows_without_hash_ids_share_nothing():
    rows = [tr.TraceRequest(0, 320, 4), tr.TraceRequest(0, 320, 4)]
    scaling = tr.TokenScaling(token_scale=16)
    a, b = tr.build_requests(rows, scaling, tr.BlockTokens(scaling.block_tokens))
    assert len(a.prompt) == 20 and a.prompt[:16] != b.prompt[:16]


def test_token_scaling_lengths_and_clipping():
    s = tr.TokenScaling(token_scale=16, output_scale=16, context=8192)
    assert s.block_tokens == 32
    assert s.lengths(12000, 343) == (750, 22, False)
    assert s.lengths(1, 0) == (1, 1, False)  # at least one token each way (not a clip)
    assert s.lengths(126195, 2000) == (7888, 125, False)  # the trace's longest still fits
    # 140k tokens: 8,750 + 125 > 8,192 -> the prompt is cut to the room left
    assert s.lengths(140000, 2000) == (8192 - 125, 125, True)
    capped = tr.TokenScaling(token_scale=16, output_scale=1, context=8192, max_output=100)
    assert capped.lengths(1600, 343) == (100, 100, True)
    assert capped.lengths(1600, 50) == (100, 50, False)
    with pytest.raises(ValueError):
        tr.TokenScaling(token_scale=3)  # does not divide 512
    # a clipped prompt is still a prefix of the unclipped one (prefix structure kept)
    small = tr.TokenScaling(token_scale=16, output_scale=1, context=64)
    bt = tr.BlockTokens(small.block_tokens)
    [r] = tr.build_requests([tr.TraceRequest(0, 2048, 10, [1, 2, 3, 4])], small, bt)
    assert r.clipped and len(r.prompt) == 54 and r.prompt == (bt.block(1) + bt.block(2))[:54]


def test_prefix_reuse():
    rows = [tr.TraceRequest(0, 1, 1, [0, 1]), tr.TraceRequest(0, 1, 1, [0, 2]),
            tr.TraceRequest(0, 1, 1, [0, 1, 3])]
    assert tr.prefix_reuse(rows) == pytest.approx(3 / 7)


# ---- statistics ------------------------------------------------------------------------
def test_percentile_matches_linear_interpolation():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert tr.percentile(xs, 50) == 3.0
    assert tr.percentile(xs, 0) == 1.0 and tr.percentile(xs, 100) == 5.0
    assert tr.percentile(xs, 90) == pytest.approx(4.6)
    assert tr.percentile([float(i) for i in range(1, 101)], 99) == pytest.approx(99.01)
    assert tr.percentile([7.0], 99) == 7.0
    assert tr.percentile([], 50) is None


def test_parse_slo():
    assert tr.parse_slo("ttft=500,tpot=50") == {"ttft_ms": 500.0, "tpot_ms": 50.0}
    assert tr.parse_slo("ttft=2000ms") == {"ttft_ms": 2000.0}
    assert tr.parse_slo("") == {}
    with pytest.raises(ValueError):
        tr.parse_slo("itl=5")


def rec(outcome="ok", ttft=0.1, tpot=0.01, e2e=1.0, out=10, prompt=100):
    return {"outcome": outcome, "ttft_s": ttft, "tpot_s": tpot, "e2e_s": e2e,
            "output_tokens": out, "prompt_tokens": prompt}


def test_goodput_counts_ok_requests_meeting_both_limits():
    slo = {"ttft_ms": 200.0, "tpot_ms": 20.0}
    records = [rec(), rec(ttft=0.2), rec(ttft=0.3), rec(tpot=0.05), rec(tpot=None, out=1),
               rec("rejected", ttft=None, tpot=None, out=None),
               rec("error", ttft=0.01, tpot=0.001)]
    assert [tr.meets_slo(r, slo) for r in records] == [True, True, False, False, True, False,
                                                       False]
    s = tr.summarize(records, slo, makespan_s=2.0)
    assert s["slo_met"] == 3 and s["goodput_rps"] == 1.5
    assert s["slo_attainment"] == pytest.approx(3 / 7)
    assert s["outcomes"] == {"ok": 5, "rejected": 1, "error": 1}
    assert s["request_throughput_rps"] == 2.5
    assert s["output_token_throughput_tps"] == (10 * 4 + 1) / 2.0
    assert s["ttft_ms"]["n"] == 5 and s["tpot_ms"]["n"] == 4  # ok requests only
    assert s["ttft_ms"]["p50"] == pytest.approx(100.0)
    # no SLO: every ok request counts
    assert tr.summarize(records, {}, 1.0)["goodput_rps"] == 5


# ---- the client against a scripted server ----------------------------------------------
def _sse(chunks: list[dict]) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


async def _serve_and_replay(handler, requests):
    from aiohttp import web

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    app.router.add_get("/v1/models", lambda r: web.json_response({"data": [{"id": "m"}]}))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        return await tr.replay(f"http://127.0.0.1:{port}", requests, timeout_s=10,
                               progress_s=0, deadline_s=20)
    finally:
        await runner.cleanup()


def test_replay_records_outcomes_and_timings():
    from aiohttp import web

    seen = []

    async def handler(request):
        body = await request.json()
        seen.append(body)
        n = body["max_tokens"]
        if n == 2:
            return web.json_response({"error": {"message": "busy"}}, status=503)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            await asyncio.sleep(0.01)
            fin = "length" if i == n - 1 and n != 3 else None
            chunk = {"choices": [{"index": 0, "text": "x", "finish_reason": fin}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if n == 3:  # error mid-stream
            await resp.write(b'data: {"error": {"message": "worker died"}}\n\n')
        else:
            await resp.write(_sse([{"choices": [], "usage": {"completion_tokens": n}}]))
        await resp.write_eof()
        return resp

    reqs = [tr.PreparedRequest(i, 0.02 * i, [17, 18, 19], n, 0, 0, False)
            for i, n in enumerate([5, 2, 3, 1])]
    records, makespan = asyncio.run(_serve_and_replay(handler, reqs))
    assert [r["outcome"] for r in records] == ["ok", "rejected", "error", "ok"]
    assert seen[0]["prompt"] == [17, 18, 19] and seen[0]["stream"] is True
    assert seen[0]["model"] == "m"
    ok = records[0]
    assert ok["output_tokens"] == 5 and ok["ttft_s"] > 0 and ok["tpot_s"] > 0.005
    assert ok["e2e_s"] >= ok["ttft_s"]
    assert records[1]["status"] == 503
    assert "worker died" in records[2]["error"]
    assert records[3]["tpot_s"] is None and records[3]["output_tokens"] == 1
    assert all(r["sent_s"] >= r["scheduled_s"] - 1e-3 for r in records)
    assert makespan > 0.06
