"""The test suite.

Compiled modules are written and reused here even where ``PYTHONDONTWRITEBYTECODE`` is
set: every xdist worker imports every test module (and pytest rewrites its asserts), and
the suite starts thousands of processes that import this project's modules, each paying
to compile them from source again without the cache (0.35 CPU-s a graph process, 7 s a
collection).  The ``__pycache__`` folders are ignored by git.
"""

import os
import sys

sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
