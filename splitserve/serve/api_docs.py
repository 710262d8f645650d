"""docs/api.md's parameter x engine table: the frontend's parameter rows
(``components/frontend/capabilities.py``) joined with what each registered engine
declares it honours (its folder's ``capabilities.py``, named by the engine registry).

The frontend names no engine, so the table is put together here, above both.

    python -m splitserve.serve.api_docs           # print the table
    python -m splitserve.serve.api_docs --write   # rewrite it in docs/api.md
"""

from __future__ import annotations

from pathlib import Path

from splitserve.components.frontend.capabilities import markdown_table, replace_table
from splitserve.components.worker import registry

DOC = Path("docs/api.md")


def table() -> str:
    """The table for every registered engine, in the registry's order."""
    return markdown_table(registry.request_params_of(registry.ENGINES))


def write_docs(path: Path = DOC) -> None:
    """Replace the table between the markers of ``path`` with ``table()``."""
    path.write_text(replace_table(path.read_text(encoding="utf-8"), table()),
                    encoding="utf-8")


if __name__ == "__main__":
    import sys

    if "--write" in sys.argv[1:]:
        write_docs()
    else:
        print(table(), end="")
