"""Fixtures shared by the frontend unit tests."""

from __future__ import annotations

import pytest

from splitserve.components.frontend.textcodec import TextCodec


@pytest.fixture(scope="session")
def codec(smollm2_dir) -> TextCodec:
    """The served model's real tokenizer and chat template (no weights)."""
    return TextCodec.from_dir(smollm2_dir)
