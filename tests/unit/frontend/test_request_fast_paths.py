"""The per-request and per-token shortcuts give what the slow paths give: the surrogate
scan is skipped only where no surrogate can be, and decoding through the Rust tokenizer
equals transformers' decode."""

from __future__ import annotations

import json
import random

import pytest

from splitserve.components.frontend.errors import APIError
from splitserve.components.frontend.openai_types import parse_json

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("raw", [
    b'{"a": "\\ud800"}',                 # an escaped lone surrogate
    b'{"a": ["x", {"b": "\\uDFFF"}]}',   # nested, upper case
    b'{"a": "\xed\xa0\x80"}',             # a surrogate encoded as UTF-8 bytes
    json.dumps({"a": "x"}).encode("utf-16").replace(b"x\x00", b"\x00\xd8"),  # UTF-16 body
], ids=["escape", "nested", "utf-8-bytes", "utf-16-body"])
def test_every_form_of_a_lone_surrogate_is_still_refused(raw):
    with pytest.raises(APIError) as err:
        parse_json(raw)
    assert err.value.status == 400


def test_a_body_without_surrogates_parses_as_before():
    body = {"prompt": list(range(5000)), "t": "caf\u00e9 \ud7ff \U0001f600", "n": [[1], {"x": 2}]}
    assert parse_json(json.dumps(body, ensure_ascii=False).encode()) == body
    assert parse_json(json.dumps(body).encode()) == body  # the emoji as an escaped pair


def test_decoding_through_the_rust_tokenizer_equals_transformers(codec):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(codec.vocab_size) for _ in range(rng.randint(1, 12))]
        for skip in (True, False):
            assert codec.decode(ids, skip) == codec.tok.decode(ids, skip_special_tokens=skip)
