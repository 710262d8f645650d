"""The kernel benchmark runs on a CPU with the kernels interpreted (a smoke test of every
row it reports) and names its results file after the device."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

BENCH = Path(__file__).parents[3] / "benchmarks" / "bench_kernels.py"
OPS = {"copy", "index_select", "index_copy", "pack", "pack_triton", "unpack", "unpack_triton",
       "pack_fp8", "pack_then_fp8", "fp8_compress", "fp8_decompress"}


def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_kernels", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_interpreted_run_reports_every_operation(tmp_path):
    out = tmp_path / "k.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "0")
    done = subprocess.run([sys.executable, str(BENCH), "--interpret", "--sizes", "13K",
                           "--out", str(out)], capture_output=True, text=True, env=env,
                          timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["mode"] == "interpret"
    rows = {row["op"]: row for row in report["rows"]}
    assert set(rows) == OPS
    assert all(row["GBps"] > 0 and row["bytes"] == rows["copy"]["bytes"] for row in rows.values())
    assert rows["pack"]["backend"] == rows["pack_fp8"]["backend"] == "triton"
    assert rows["copy"]["vs_copy"] == 1.0 and rows["index_select"]["vs_index_select"] == 1.0


@pytest.mark.parametrize(("name", "expected"), [
    ("NVIDIA H100 80GB HBM3", "kernels_nvidia-h100-80gb-hbm3.json"),
    ("NVIDIA H200", "kernels_nvidia-h200.json"),
])
def test_results_file_is_named_after_the_gpu(name, expected):
    assert _bench_module().results_name(name) == expected


def test_sizes_parse():
    bench = _bench_module()
    assert [bench.parse_size(s) for s in ("13K", "16M", "1G", "4096")] == [
        13 << 10, 16 << 20, 1 << 30, 4096]
