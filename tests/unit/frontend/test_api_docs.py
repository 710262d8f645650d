"""docs/api.md's compatibility table is the one the frontend decides with: its rows and
what every registered engine declares."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve.components.frontend.capabilities import committed_table
from splitserve.serve.api_docs import table

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[3] / "docs" / "api.md"


def test_committed_table_equals_the_generated_one():
    assert committed_table(DOC.read_text(encoding="utf-8")) == table(), (
        "docs/api.md is stale: run python -m splitserve.serve.api_docs --write")
