"""docs/api.md's compatibility table is the one the frontend decides with."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve.components.frontend.capabilities import TABLE_BEGIN, TABLE_END, markdown_table

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[3] / "docs" / "api.md"


def test_committed_table_equals_the_generated_one():
    text = DOC.read_text(encoding="utf-8")
    committed = text.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0]
    assert committed == "\n" + markdown_table(), (
        "docs/api.md is stale: run python -m splitserve.components.frontend.capabilities "
        "--write")
