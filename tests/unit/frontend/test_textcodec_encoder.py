"""The prompt encoder: fastokens by default, the same ids as tokenizers, a clear fallback."""

from __future__ import annotations

import logging
import random
import string
import sys

import pytest

from splitserve.components.frontend.textcodec import TextCodec


@pytest.fixture(scope="module")
def hf(smollm2_dir) -> TextCodec:
    return TextCodec.from_dir(smollm2_dir, encoder="huggingface")


def _texts() -> list[str]:
    rng = random.Random(7)
    alphabet = string.ascii_letters + string.digits + string.punctuation + " \n\t\u00e9\u6f22\U0001f600"
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3000)))
            for _ in range(40)]


def test_auto_uses_fastokens_and_encodes_as_tokenizers_does(codec, hf):
    assert codec.encoder == "fastokens" and hf.encoder == "huggingface"
    for text in [*_texts(), "a<|im_end|>b", "<|im_start|>user\nhi<|im_end|>"]:
        assert codec.prompt_ids(text) == hf.prompt_ids(text), text[:40]
    chat = [{"role": "system", "content": "be brief <|im_end|> ok"},
            {"role": "user", "content": "caf\u00e9 <|im_start|> \U0001f600\n\n  spaces  "},
            {"role": "assistant", "content": "sure"}, {"role": "user", "content": "again"}]
    assert codec.chat_ids(chat) == hf.chat_ids(chat)
    # control tokens typed in chat content stay text; in a raw prompt they are parsed
    end = codec.tok.convert_tokens_to_ids("<|im_end|>")
    typed = codec.chat_ids([{"role": "user", "content": "x <|im_end|> y"}])
    assert typed.count(end) == codec.chat_ids([{"role": "user", "content": "x y"}]).count(end)
    assert end in codec.prompt_ids("x<|im_end|>y")


def test_without_fastokens_auto_falls_back_and_a_named_one_fails(codec, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "fastokens", None)  # import fails
    with caplog.at_level(logging.WARNING):
        slow = TextCodec(codec.tok, codec.context_length)
    assert slow.encoder == "huggingface"
    assert "fastokens unusable" in caplog.text
    assert slow.prompt_ids("hello world") == codec.prompt_ids("hello world")
    with pytest.raises(ValueError, match="tokenizer: fastokens cannot encode this model"):
        TextCodec(codec.tok, codec.context_length, encoder="fastokens")


def test_a_fast_encoder_that_disagrees_is_not_used(codec, monkeypatch, caplog):
    real = TextCodec._encode_hf
    # tokenizers reading one probe differently stands for a model fastokens misreads
    monkeypatch.setattr(TextCodec, "_encode_hf", lambda self, specials, texts: [
        ids[:-1] if i == 0 else ids for i, ids in enumerate(real(self, specials, texts))])
    with caplog.at_level(logging.WARNING):
        slow = TextCodec(codec.tok, codec.context_length)
    assert slow.encoder == "huggingface"
    assert "differently from tokenizers" in caplog.text
