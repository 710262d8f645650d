"""benchmarks/shared_prefix_trace.py: the shared-prefix trace is deterministic, in
Mooncake's format, fits the benchmark's context, and repeats the share of prompt blocks
its docstring says; the replay reads it with its prefixes intact."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]


def _load():
    spec = importlib.util.spec_from_file_location(
        "bench_shared_prefix_trace", REPO / "benchmarks" / "shared_prefix_trace.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


spt = _load()


def test_the_trace_is_deterministic_and_shares_about_half_its_blocks(tmp_path):
    a, b = spt.generate(seconds=60.0, seed=3), spt.generate(seconds=60.0, seed=3)
    assert a == b and a != spt.generate(seconds=60.0, seed=4)
    assert 0.45 < spt.repeated_share(a) < 0.65
    for row in a:
        blocks = len(row["hash_ids"])
        assert (blocks - 1) * spt.BLOCK < row["input_length"] <= blocks * spt.BLOCK <= 8192
    assert [r["timestamp"] for r in a] == sorted(r["timestamp"] for r in a)
    assert 0.9 * 20 * 60 < len(a) < 1.1 * 20 * 60  # Poisson at 20 req/s for 60 s


def test_the_replay_reads_its_shared_prefixes(tmp_path):
    from splitserve.bench import replay as rp

    path = spt.write(tmp_path / "t.jsonl", seconds=5.0, seed=0)
    rows = rp.load_trace(path)
    raw = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r.hash_ids for r in rows] == [r["hash_ids"] for r in raw]
    assert spt.repeated_share(raw) == spt.repeated_share(
        [{"hash_ids": r.hash_ids} for r in rows])


def test_the_groups_shape_opens_each_prefix_once_with_a_group_within_seconds():
    rows = spt.generate_groups(seconds=60.0, seed=3)
    assert rows == spt.generate_groups(seconds=60.0, seed=3)
    assert 0.45 < spt.repeated_share(rows) < 0.65
    assert 0.8 * 20 * 60 < len(rows) < 1.2 * 20 * 60
    assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)
    by_prefix: dict[int, list[int]] = {}
    for row in rows:
        blocks = len(row["hash_ids"])
        assert (blocks - 1) * spt.BLOCK < row["input_length"] <= blocks * spt.BLOCK <= 8192
        by_prefix.setdefault(row["hash_ids"][0], []).append(row["timestamp"])
    for times in by_prefix.values():
        assert len(times) <= 6 and max(times) - min(times) <= 3000
    assert sum(len(t) > 1 for t in by_prefix.values()) > 0.7 * len(by_prefix)
