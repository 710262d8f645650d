"""Backend choice shared by the KV kernels: Triton (compiled or interpreted) or torch.

Rule: a CUDA tensor runs the compiled Triton kernel; a CPU tensor runs the Triton
kernel under Triton's interpreter when ``TRITON_INTERPRET=1`` (the switch Triton itself
honours), and the torch reference otherwise.  The rule is the pure function
:func:`select_backend`; :func:`resolve_backend` is the single place that reads the
environment, at call time.

Triton fixes the mode for the whole process when it is first imported: ``@triton.jit``
(and Triton's own library functions such as ``tl.max``) build interpreted kernels only if
``TRITON_INTERPRET=1`` was set by then.  :func:`launchable` therefore checks, before each
launch, that a CPU tensor meets an interpreted kernel, and says what to do otherwise.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from typing import Literal

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

Backend = Literal["triton", "torch"]
BACKENDS: tuple[Backend, ...] = ("triton", "torch")

# Passed to every launch.  No fused multiply-add, so results match the torch references
# bit for bit; saying so explicitly also keeps Triton 3.9 from warning that the default
# is about to change.  The interpreter ignores it.
LAUNCH_OPTIONS = {"enable_fp_fusion": False}

# Whole-block pack/unpack on CUDA below this many payload bytes runs torch's
# ``index_select`` / ``index_copy_`` instead of the Triton kernel.  Below it a copy lasts
# a few microseconds and Triton's Python-side launch (~10-20 us) outweighs the kernel;
# torch's launch is cheaper.  On an H100 the previous kernel only matched index_select at
# 180 MiB and above; this value is a first guess for the rewritten kernel, to be set from
# ``benchmarks/bench_kernels.py --device cuda`` (rows ``pack`` vs ``pack_triton``).
TRITON_MIN_BYTES = 64 << 20

# Persistent copy kernels launch this many programs per multiprocessor (each of 4 warps),
# enough resident threads to keep the memory system busy while each loops over tiles.
PROGRAMS_PER_SM = 8


def select_backend(device: torch.device, interpret: bool) -> Backend:
    """Pure dispatch rule; called by :func:`resolve_backend`.

    Returns ``"triton"`` for CUDA tensors, and for CPU tensors when the interpreter is
    on; ``"torch"`` otherwise.
    """
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu" and interpret:
        return "triton"
    return "torch"


def select_copy_backend(device: torch.device, interpret: bool, nbytes: int,
                        min_bytes: int = TRITON_MIN_BYTES) -> Backend:
    """Pure rule for whole-block pack/unpack, which have a one-call torch equivalent.

    As :func:`select_backend`, except that on CUDA a payload under ``min_bytes`` goes to
    torch (the faster of the two there).  The interpreter always gets Triton: it exists
    to test the kernels.
    """
    if device.type == "cuda" and nbytes < min_bytes:
        return "torch"
    return select_backend(device, interpret)


def resolve_copy_backend(tensor: torch.Tensor, backend: Backend | None,
                         nbytes: int) -> Backend:
    """Called by kv_pack/kv_unpack: :func:`resolve_backend` with the size rule of
    :func:`select_copy_backend` when the choice is automatic."""
    if backend is None:
        return select_copy_backend(tensor.device, interpret_requested(), nbytes)
    return resolve_backend(tensor, backend)


def interpret_requested() -> bool:
    """True when ``TRITON_INTERPRET=1`` is set now; read at each call on purpose."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(tensor: torch.Tensor, backend: Backend | None) -> Backend:
    """Called first by every wrapper: ``None`` means automatic, a name forces a path.

    Forcing ``"triton"`` on a CPU tensor needs interpreted kernels (see :func:`launchable`).
    """
    if backend is None:
        return select_backend(tensor.device, interpret_requested())
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "triton" and tensor.device.type not in ("cuda", "cpu"):
        raise ValueError(f"no Triton path for tensors on {tensor.device}")
    return backend


def is_interpreted(kernel) -> bool:
    """True when ``kernel`` was built by Triton's interpreter (CPU tensors can run it)."""
    return isinstance(kernel, InterpretedFunction)


@triton.jit
def _probe():
    pass


def kernels_interpreted() -> bool:
    """True when this process imported Triton under its interpreter, so every kernel of
    this package accepts CPU tensors; decided when this module was imported."""
    return is_interpreted(_probe)


def launchable(kernel, device: torch.device):
    """Called by wrappers right before a launch; returns ``kernel`` once it is known to run
    on ``device``.  A compiled kernel needs CUDA tensors; an interpreted one runs on CPU
    tensors, and on CUDA tensors too (copied to the host and back, slowly)."""
    if device.type != "cuda" and not is_interpreted(kernel):
        raise RuntimeError(
            f"Triton kernel {kernel.fn.__name__} was compiled for CUDA and got a {device.type} "
            "tensor; to run it on the CPU set TRITON_INTERPRET=1 before triton is first "
            "imported, or pass backend='torch'")
    return kernel


def as_index_tensor(ids: Sequence[int] | torch.Tensor, limit: int,
                    device: torch.device) -> torch.Tensor:
    """Turn a block table into an int64 tensor on ``device``; called by every wrapper.

    Python sequences are range-checked against ``limit`` here; a tensor is trusted as is,
    because checking it would force a device synchronisation on the hot path.
    """
    if isinstance(ids, torch.Tensor):
        return ids.to(device=device, dtype=torch.int64)
    ids = list(ids)
    bad = [i for i in ids if not 0 <= i < limit]
    if bad:
        raise IndexError(f"block ids {bad[:5]} outside [0, {limit})")
    return torch.tensor(ids, dtype=torch.int64, device=device)


# ---------------------------------------------------------------- wide copies

def copy_unit(byte_counts: Sequence[int], tensors: Sequence[torch.Tensor]
              ) -> tuple[torch.dtype, int]:
    """Called by the copy kernels' wrappers: the element type to move bytes as, and how
    many consecutive units form an aligned 16-byte vector (the ``VEC`` hint).

    Every length and offset the kernel uses (``byte_counts``) and every tensor's address
    must be a multiple of the unit.  Returns int32 with VEC 4 (16 bytes) when all are
    multiples of 16, VEC 2 or 1 for 8 or 4; int16 or uint8 (VEC 1) when 4 bytes do not
    divide them.  A copy of any float dtype is then a copy of 32-bit words, which the
    compiler turns into 16-byte loads and stores.
    """
    common = 16
    for n in [*byte_counts, *(t.data_ptr() for t in tensors)]:
        common = math.gcd(common, n)
    if common >= 4:
        return torch.int32, common // 4
    return (torch.int16 if common == 2 else torch.uint8), 1


def as_units(t: torch.Tensor, unit: torch.dtype) -> torch.Tensor:
    """A contiguous tensor's bytes seen as a flat tensor of ``unit`` (no copy)."""
    return t.reshape(-1).view(torch.uint8).view(unit)


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def persistent_grid(device: torch.device, tiles: int) -> int:
    """Programs of a persistent copy launch: :data:`PROGRAMS_PER_SM` per multiprocessor
    (4 when interpreted: it runs programs one after another), never more than ``tiles``."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        limit = PROGRAMS_PER_SM * _multiprocessors(index)
    else:
        limit = 4
    return max(1, min(tiles, limit))
