"""The per-request and per-token shortcuts give what the slow paths give: the surrogate
scan is skipped only where no surrogate can be, decoding through the Rust tokenizer
equals transformers' decode, and a prompt of token ids skips the tokenizer pool."""

from __future__ import annotations

import asyncio
import json
import random
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from splitserve.components.frontend.backlog import TokenizeBacklog
from splitserve.components.frontend.errors import APIError
from splitserve.components.frontend.openai_types import _parse_json_lenient, parse_json
from splitserve.components.frontend.pipeline import INLINE_PREPARE_BYTES, parse_and_prepare
from splitserve.components.frontend.request import Endpoint

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


BODIES = [
    b'{"a": 123456789012345678901234567890, "b": -9223372036854775809}',
    b'{"a": 1e400}', b'{"a": NaN}', b'{"a": -Infinity}', b'{"a": 1, "a": 2}',
    b'{"a": 1} x', b' {"a": [1.5e3, -0, true, null]} \n', b'\xef\xbb\xbf{"a": 1}',
    b'{"a": "x\x00y"}', b'{"a": 1' + b"0" * 5000 + b"}", b"[" * 100_000 + b"]" * 100_000,
    b'{"a": "\\ud83d\\ude00 \\udbff\\udfff"}', b'{"a": "\\ud83d x"}',
    b'{"a": "\\ude00"}', b'{"a": "\xf4\x90\x80\x80"}', b'{"a": "\xc0\x80"}',
    b'[1, 2]', b'"text"', b"", b"{", json.dumps({"a": "x"}).encode("utf-16"),
]


@pytest.mark.parametrize("raw", BODIES, ids=range(len(BODIES)))
def test_the_strict_decoder_reads_each_body_as_json_does(raw):
    """msgspec decodes first; whatever it accepts json reads the same, and what it refuses
    json reads or refuses with the messages it always gave."""
    def outcome(parse):
        try:
            return "ok", parse(raw)
        except APIError as exc:
            return exc.status, exc.message

    assert outcome(parse_json) == outcome(_parse_json_lenient)


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


class _CountingPool(ThreadPoolExecutor):
    """The tokenizer pool, counting what is handed to it."""

    def __init__(self) -> None:
        super().__init__(1)
        self.handed = 0

    def submit(self, *args, **kwargs):
        self.handed += 1
        return super().submit(*args, **kwargs)


def _state(pool: _CountingPool) -> SimpleNamespace:
    codec = SimpleNamespace(vocab_size=49152, context_length=65536,
                            surely_too_long=lambda chars: False,
                            prompt_ids=lambda text: [1] * (len(text) // 4))
    lane = SimpleNamespace(codec=codec, base_model=None, lora=None, tool_call_parser=None,
                           reasoning_parser=None)
    return SimpleNamespace(backlog=TokenizeBacklog(threads=1, max_wait_s=2.0,
                                                   max_pending=8),
                           prepare_pool=pool, engines={}, default_max_tokens=16,
                           lane=lambda model: lane)


@pytest.mark.parametrize(("prompt", "pooled"), [
    (list(range(1000, 9000)), 0),   # 8,000 ids, ~46 KB: parsed and checked on the loop
    ("word " * 5000, 1),            # ~25 KB of text: tokenised in the pool
    (list(range(1000, 41000)), 1),  # 40,000 ids, ~240 KB: parsed in the pool
], ids=["ids", "text", "ids-over-the-inline-limit"])
def test_a_prompt_of_token_ids_is_not_handed_to_the_tokenizer_pool(prompt, pooled):
    raw = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 4}).encode()
    assert len(raw) > INLINE_PREPARE_BYTES
    pool = _CountingPool()
    try:
        prepared = asyncio.run(parse_and_prepare(_state(pool), Endpoint.COMPLETION, raw,
                                                 "default"))
    finally:
        pool.shutdown()
    assert pool.handed == pooled
    assert len(prepared.token_ids) == (len(prompt) if isinstance(prompt, list)
                                       else len(prompt) // 4)
    assert prepared.max_tokens == 4
