"""The backend rule: CUDA -> Triton, CPU -> Triton only under the interpreter, else torch."""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels import dispatch, kv_pack

from .kernel_factories import needs_interpreter, pool

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("device", "interpret", "expected"), [
    ("cpu", False, "torch"),
    ("cpu", True, "triton"),
    ("cuda", False, "triton"),
    ("cuda", True, "triton"),
    ("meta", True, "torch"),
])
def test_select_backend_rule(device, interpret, expected):
    assert dispatch.select_backend(torch.device(device), interpret) == expected


@pytest.mark.parametrize(("env", "expected"), [(None, "torch"), ("0", "torch"), ("1", "triton")])
def test_resolve_backend_reads_the_switch_at_call_time(monkeypatch, env, expected):
    if env is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", env)
    assert dispatch.resolve_backend(torch.ones(1), None) == expected


@pytest.mark.parametrize("forced", ["torch", "triton"])
def test_a_named_backend_wins_over_the_switch(monkeypatch, forced):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert dispatch.resolve_backend(torch.ones(1), forced) == forced


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend must be one of"):
        dispatch.resolve_backend(torch.ones(1), "cuda-graphs")


def test_a_compiled_kernel_refuses_cpu_tensors_with_advice():
    class Compiled:  # stands in for a JITFunction: not interpreted
        fn = test_a_compiled_kernel_refuses_cpu_tensors_with_advice

    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        dispatch.launchable(Compiled(), torch.device("cpu"))


@needs_interpreter
def test_both_backends_agree_through_the_automatic_path(monkeypatch):
    src = pool(6, 2, 4, 3, 10, seed=1)
    ids = [5, 1, 3]
    auto_triton = kv_pack.kv_pack(src, ids)                 # the fixture sets the switch
    monkeypatch.delenv("TRITON_INTERPRET")
    auto_torch = kv_pack.kv_pack(src, ids)
    assert torch.equal(auto_triton, auto_torch)


@pytest.mark.parametrize("ids", [[0, 6], [-1]])
def test_block_ids_out_of_range_are_refused(ids):
    with pytest.raises(IndexError, match="outside"):
        dispatch.as_index_tensor(ids, 6, torch.device("cpu"))
