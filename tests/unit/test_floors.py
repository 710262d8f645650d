"""The floors hold: the import-linter contracts of pyproject.toml pass, the import names
map to the card's folders through splitserve/'s links, and the contracts floor imports
nothing else of the project (checked here too, so a plain test run shows a broken floor
before CI's `lint-imports` does)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
CARD_FOLDERS = ("components", "contracts", "graphs", "kernels", "planner")


def test_the_import_linter_contracts_are_kept(monkeypatch):
    from importlinter.cli import lint_imports

    monkeypatch.chdir(REPO)  # lint-imports reads pyproject.toml from the working directory
    assert lint_imports(no_cache=True, no_logo=True) == 0


@pytest.mark.parametrize("folder", CARD_FOLDERS)
def test_each_import_name_is_a_path_in_the_repository(folder):
    link = REPO / "splitserve" / folder
    assert link.is_symlink() and os.readlink(link) == f"../{folder}"
    import importlib

    module = importlib.import_module(f"splitserve.{folder}")
    assert Path(module.__file__).resolve() == (REPO / folder / "__init__.py").resolve()


def _project_imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return [n for n in names if n == "splitserve" or n.startswith("splitserve.")]


def test_the_contracts_import_nothing_else_of_the_project():
    outside = {f"{p.relative_to(REPO)}: {name}"
               for p in (REPO / "contracts").rglob("*.py")
               for name in _project_imports(p)
               if not name.startswith("splitserve.contracts")}
    assert outside == set()
