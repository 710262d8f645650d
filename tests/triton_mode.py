"""Import Triton (and the kernels) under its interpreter, for tests on machines without a GPU.

Triton fixes interpreted-or-compiled for the whole process at its first import, so the
variable is set only around that import and restored at once: processes the tests start
do not inherit it.
"""

from __future__ import annotations

import importlib
import os
import sys

KERNEL_MODULES = ("triton", "splitserve.kernels.kv_pack", "splitserve.kernels.kv_layout",
                  "splitserve.kernels.kv_fp8", "splitserve.kernels.kv_pack_fp8")


def import_triton_interpreted() -> None:
    """Import Triton and the kernels interpreted, unless Triton is already imported."""
    if "triton" in sys.modules:
        return
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for module in KERNEL_MODULES:
            importlib.import_module(module)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
