"""Package attributes imported on first use (PEP 562), for packages whose modules import
heavy libraries (torch) that a process reading only their config never needs."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, namespace: dict[str, Any],
                 exports: dict[str, tuple[str, ...]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``exports`` maps a module (relative to
    the package, or absolute) to the names it gives; each is imported on first access and
    kept in ``namespace`` (the package's ``globals()``)."""
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    return __getattr__
