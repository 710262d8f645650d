"""The GPU smoke test (scripts/gpu_smoke.py) per engine: agg == disagg greedy, a
cancellation and a killed prefill worker, each engine in its own processes as the
served graphs run them.

Skipped without an NVIDIA GPU, without the engine installed, or without a local model
directory in ``SPLITSERVE_GPU_MODEL`` (Llama 3.1 8B Instruct for the shipped configs;
GPU machines here have no network).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(3600)]

REPO = Path(__file__).resolve().parents[2]
MODULES = {"sglang": "sglang", "trtllm": "tensorrt_llm", "vllm": "vllm"}


@pytest.mark.parametrize("engine", sorted(MODULES))
def test_gpu_smoke(engine):
    model = os.environ.get("SPLITSERVE_GPU_MODEL")
    if not model:
        pytest.skip("set SPLITSERVE_GPU_MODEL to a local model directory")
    if importlib.util.find_spec(MODULES[engine]) is None:
        pytest.skip(f"{engine} is not installed in this environment")
    res = subprocess.run([sys.executable, str(REPO / "scripts/gpu_smoke.py"), engine,
                          "--model", model], cwd=REPO, capture_output=True, text=True,
                         timeout=3500, check=False)
    print(res.stdout[-5000:])
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-3000:]
