"""Shared test helpers: repository paths and skipping GPU tests cleanly."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from splitserve.contracts.kit.component import SKIP_SGLANG_LOGGING
from tests.graphs import GraphPool
from tests.integration.serve_helpers import ServeRun
from tests.triton_mode import import_triton_interpreted

REPO = Path(__file__).resolve().parent.parent

pytest_plugins = ["tests.parallel"]  # module order and the lock for parallel workers

# Dynamo's runtime in a test process (tests that call a graph's endpoints directly) logs
# at INFO straight to the terminal, past pytest's capture (at interpreter exit, from an
# xdist worker); its graphs' replicas run at this level too (splitserve.serve.runner).
# The push router warns from a background thread when its runtime shuts down ("Instance
# removal watcher stream ended; reconnecting"), which landed between pytest's dots.
os.environ.setdefault("DYN_LOG", "warn,dynamo_runtime::pipeline::network::egress::push_router=error")

# Every process that sets up Dynamo's logging would leave a file in the temporary
# folder for SGLang's logging; the suite starts thousands (contracts/kit/component.py).
os.environ.setdefault(SKIP_SGLANG_LOGGING, "1")

GRAPH_LOG_TAIL_LINES = 60
_GRAPHS_BEFORE = pytest.StashKey[int]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_GRAPHS_BEFORE] = len(ServeRun.started)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report ends with the log tail of every graph it started and of
    every graph still running (the shared ones): what the processes said is in files,
    not interleaved with pytest's progress, and shown only when it may explain a
    failure."""
    report = yield
    if report.failed:
        first = item.stash.get(_GRAPHS_BEFORE, len(ServeRun.started))
        runs = [r for i, r in enumerate(ServeRun.started)
                if i >= first or r.proc.poll() is None]
        for run in runs:
            lines = run.output().splitlines()[-GRAPH_LOG_TAIL_LINES:]
            report.sections.append((f"graph log {run.log_path} (last {len(lines)} lines)",
                                    "\n".join(lines) or "(empty)"))
    return report


def _has_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - any import problem means no usable GPU
        return False


if not _has_gpu():
    # A module importing the kernels indirectly (KV transfer) would otherwise fix Triton
    # to compiled mode and turn every kernel test in a full run into a skip.
    import_triton_interpreted()


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
    """The packaged default model's exported, weight-less directory (tokenizer + config),
    cached per user."""
    from splitserve.contracts.model_files import PACKAGED_MODEL, model_dir

    return model_dir(PACKAGED_MODEL)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, smollm2_dir) -> dict[str, Path]:
    """Tiny random models of the Llama family (Llama, SmolLM, Mistral, Qwen2, Qwen3) as
    Hugging Face directories with the SmolLM2 tokenizer, written once per session from a
    fixed seed (tests/fixtures/tiny_models.py): family name -> directory."""
    from tests.fixtures.tiny_models import write_tiny_models

    return write_tiny_models(tmp_path_factory.mktemp("tiny-models"), smollm2_dir)


@pytest.fixture(scope="session")
def tiny_lora(tmp_path_factory, tiny_models) -> Path:
    """A random rank-8 LoRA adapter of the tiny Llama (every projection targeted), written
    once per session with peft (tests/fixtures/tiny_models.py)."""
    from tests.fixtures.tiny_models import write_lora_adapter

    return write_lora_adapter(tiny_models["llama"], tmp_path_factory.mktemp("lora") / "llama-lora")


@pytest.fixture(scope="session")
def graph_pool(tmp_path_factory):
    """Graphs shared by the live tests that do not change them (tests/graphs.py)."""
    pool = GraphPool(tmp_path_factory.mktemp("graph-pool"))
    yield pool
    pool.close()
