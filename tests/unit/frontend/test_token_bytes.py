"""Log-probabilities carry each token's own bytes: joined, they are the text, even where
a token holds only part of a UTF-8 character (which decodes alone to U+FFFD)."""

from __future__ import annotations

import pytest

from splitserve.components.frontend.responses import LogprobShaper
from splitserve.components.frontend.token_bytes import TokenBytes, token_bytes_of
from splitserve.contracts.wire import TokenLogprobs

pytestmark = pytest.mark.unit

TEXTS = ["おわん", "café naïve 漢字 😀‍💻", "plain ascii, spaces  and\ttabs"]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_tokens_join_into_the_text(codec, text):
    ids = codec.prompt_ids(text)
    of = token_bytes_of(codec)
    assert b"".join(of(t) for t in ids) == text.encode()


def test_a_partial_character_token_keeps_its_bytes_in_chat_logprobs(codec):
    ids = codec.prompt_ids("おわん")
    partial = [t for t in ids if codec.decode([t]) == "\ufffd"]
    assert partial, "the probe must hold a token that is part of a character"
    shaper = LogprobShaper(codec, frozenset())
    lps = TokenLogprobs(logprobs=[-0.5] * len(ids), top=[[(t, -0.5)] for t in ids])
    entries = shaper.chat(ids, lps)
    assert b"".join(bytes(e["bytes"]) for e in entries) == "おわん".encode()
    assert b"".join(bytes(e["top_logprobs"][0]["bytes"]) for e in entries) == \
        "おわん".encode()
    # the text field stays the decoded token, as OpenAI sends it
    assert any(e["token"] == "\ufffd" for e in entries)


def test_control_tokens_are_their_text(codec):
    of = token_bytes_of(codec)
    for tid in codec.special_ids:
        assert of(tid) == codec.tok.convert_ids_to_tokens(tid).encode()


def _sentencepiece_with_byte_fallback():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in ("▁", "a", "▁a", "b", "▁b", "ab", "▁ab"):
        vocab[piece] = len(vocab)
    merges = [("▁", "a"), ("a", "b"), ("▁a", "b"), ("▁", "b")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                               byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return tok


def test_sentencepiece_byte_fallback_pieces_are_their_bytes():
    tok = _sentencepiece_with_byte_fallback()
    of = TokenBytes(tok, tok.to_str(), lambda t: tok.decode([t]))
    assert of.metaspace and of.byte_fallback and not of.byte_level
    text = "ab お b"
    ids = tok.encode(text).ids
    assert any(tok.id_to_token(t).startswith("<0x") for t in ids)
    joined = b"".join(of(t) for t in ids)
    assert joined == (" " + text).encode()  # the first piece's ▁ is a space
    assert tok.decode(ids) == joined.decode()[1:]
