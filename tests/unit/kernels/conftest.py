"""Run the Triton kernels under Triton's interpreter on CPU tensors.

Triton fixes interpreted-or-compiled for the whole process when it is first imported, so
``TRITON_INTERPRET=1`` is set here, at collection, before triton and the kernel modules
are imported, and the previous value is put back right after: later tests and the
subprocesses they start do not inherit it.  While each test in this folder runs, the
autouse fixture sets it again, because the kernels' automatic dispatch reads it at call
time.

If triton was already imported in compiled mode (a GPU run that collected
``tests/gpu`` first), the interpreter tests skip themselves (see
``kernel_factories.needs_interpreter``) and the GPU tests cover the kernels instead.
"""

from __future__ import annotations

import pytest

from tests.triton_mode import import_triton_interpreted

import_triton_interpreted()


@pytest.fixture(autouse=True)
def _triton_interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
