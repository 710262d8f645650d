"""Shared test helpers: repository paths and skipping GPU tests cleanly."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _has_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - any import problem means no usable GPU
        return False


def _import_triton_interpreted() -> None:
    """Without a GPU, import Triton (and the kernels) under its interpreter before any test
    module does: Triton fixes interpreted-or-compiled at its first import, and a module
    that imports the kernels indirectly (KV transfer) would otherwise fix it to compiled
    and turn every kernel test in the run into a skip.  The variable is restored at once,
    so processes the tests start do not inherit it."""
    import importlib
    import os
    import sys

    if "triton" in sys.modules:
        return
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for module in ("triton", "splitserve.kernels.kv_pack", "splitserve.kernels.kv_layout",
                       "splitserve.kernels.kv_fp8"):
            importlib.import_module(module)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


if not _has_gpu():
    _import_triton_interpreted()


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The exported, weight-less SmolLM2 directory (tokenizer + config), cached per user."""
    from splitserve.common.cache import model_cache_dir
    from splitserve.components.engines.model_dir import export_model_dir, served_model_name

    return export_model_dir(model_cache_dir(served_model_name()))
