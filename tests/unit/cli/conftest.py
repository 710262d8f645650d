"""Fixtures of the CLI tests."""

from __future__ import annotations

import pytest

from splitserve.components.frontend.textcodec import TextCodec


@pytest.fixture(scope="session")
def codec(smollm2_dir) -> TextCodec:
    """The packaged model's tokenizer (the frontend that `dynamo lora` talks to)."""
    return TextCodec.from_dir(smollm2_dir)
