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


MIN = dispatch.TRITON_MIN_BYTES


@pytest.mark.parametrize(("device", "interpret", "nbytes", "expected"), [
    ("cuda", False, MIN - 1, "torch"),      # small payloads: torch's index_select wins
    ("cuda", False, MIN, "triton"),
    ("cuda", False, 1 << 40, "triton"),
    ("cpu", True, 16, "triton"),            # the interpreter always runs the kernel
    ("cpu", False, 1 << 40, "torch"),
])
def test_copy_rule_sends_small_cuda_payloads_to_torch(device, interpret, nbytes, expected):
    assert dispatch.select_copy_backend(torch.device(device), interpret, nbytes) == expected


def test_copy_rule_threshold_can_be_moved():
    assert dispatch.select_copy_backend(torch.device("cuda"), False, 4096, min_bytes=0) == "triton"


def test_pack_backend_names_the_path_kv_pack_takes(monkeypatch):
    src = pool(6, 2, 4, 3, 10, seed=2)
    assert kv_pack.pack_backend(src, 3) == "triton"          # the fixture sets the switch
    assert kv_pack.pack_backend(src, 3, "torch") == "torch"
    monkeypatch.delenv("TRITON_INTERPRET")
    assert kv_pack.pack_backend(src, 3) == "torch"


@pytest.mark.parametrize(("byte_counts", "offset", "expected"), [
    ([384, 768], 0, (torch.int32, 4)),       # everything a multiple of 16 bytes
    ([384, 40], 0, (torch.int32, 2)),
    ([384, 12], 0, (torch.int32, 1)),
    ([384, 6], 0, (torch.int16, 1)),
    ([384, 3], 0, (torch.uint8, 1)),
    ([384], 2, (torch.int16, 1)),            # a tensor's address only 2-byte aligned
    ([384], 8, (torch.int32, 2)),
])
def test_copy_unit_is_the_widest_that_divides_every_length_and_address(
        byte_counts, offset, expected):
    base = torch.empty(64, dtype=torch.uint8)
    aligned = base[(-base.data_ptr()) % 16:]                 # a 16-byte aligned start
    t = aligned[offset:offset + 16]
    assert dispatch.copy_unit(byte_counts, [t]) == expected


def test_as_units_views_the_same_bytes():
    x = torch.arange(12, dtype=torch.float16).reshape(3, 4)
    words = dispatch.as_units(x, torch.int32)
    assert words.shape == (6,) and words.data_ptr() == x.data_ptr()
    assert torch.equal(words.view(torch.float16).reshape(3, 4), x)
