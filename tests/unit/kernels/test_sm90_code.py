"""What the kernels compile to for Hopper, checked without a GPU: 16-byte accesses for the
copies, and correctly rounded division in the FP8 kernels (the cause of the scales that
differed from the reference in the last bit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.slow]

PROBE = Path(__file__).with_name("sm90_probe.py")


@pytest.fixture(scope="module")
def ptx_ops() -> dict[str, list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "0")     # silences Triton 3.9's notice
    done = subprocess.run([sys.executable, str(PROBE)], capture_output=True, text=True,
                          env=env, timeout=240, check=False)
    if done.returncode and "GPUTarget" in done.stderr:
        pytest.skip("this Triton cannot compile for a CUDA target here")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kernel", ["pack", "unpack", "tokens", "head_copy", "rechunk"])
def test_copies_use_16_byte_loads_and_stores(ptx_ops, kernel):
    assert "ld.global.v4.b32" in ptx_ops[kernel]
    assert "st.global.v4.b32" in ptx_ops[kernel]


@pytest.mark.parametrize("kernel", ["compress", "pack_compress"])
def test_fp8_kernels_divide_correctly_rounded_and_load_16_bytes(ptx_ops, kernel):
    divisions = [op for op in ptx_ops[kernel] if op.startswith("div.") and "f32" in op]
    assert divisions == ["div.rn.f32"]
    assert "ld.global.v4.b32" in ptx_ops[kernel]


def test_decompress_stores_16_bytes(ptx_ops):
    assert "st.global.v4.b32" in ptx_ops["decompress"]
