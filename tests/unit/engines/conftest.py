"""Shared fixtures for the engine tests: the model is loaded once per test session."""

from __future__ import annotations

import os

import pytest

from splitserve.components.engines.torch_cpu import (
    EngineConfig,
    EngineCore,
    LoadedModel,
    configure_threads,
    load_model,
)


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The packaged default model (SmolLM2-135M-Instruct) with the transformers model kept
    as the reference."""
    if "PYTEST_XDIST_WORKER" not in os.environ:  # under xdist: one thread (tests/parallel.py)
        configure_threads()
    return load_model(keep_hf_model=True)


@pytest.fixture
def make_engine(smollm2: LoadedModel):
    """Factory: a fresh engine over the shared weights, with config overrides."""

    def make(**overrides) -> EngineCore:
        settings = {"num_blocks": 64, **overrides}  # a small pool is quick to allocate
        return EngineCore(smollm2.weights, smollm2.config, EngineConfig(**settings))

    return make
