"""The floors hold: the import-linter contracts of pyproject.toml pass, the import names
map to the card's folders through splitserve/'s links, and the contracts floor imports
nothing else of the project (checked here too, so a plain test run shows a broken floor
before CI's `lint-imports` does)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
CARD_FOLDERS = ("components", "contracts", "graphs", "kernels", "planner")


def test_the_import_linter_contracts_are_kept():
    # In a process of its own: import-linter's command disables the loggers that exist
    # when it runs, which would silence other tests' log captures in this process.
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), "--no-cache"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


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
