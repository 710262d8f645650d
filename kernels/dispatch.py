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
