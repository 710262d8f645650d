"""Each token's own bytes, read from the tokenizer's vocabulary (log-probabilities'
``bytes`` field).

A token may hold part of a UTF-8 character: decoding it alone gives "\ufffd", whose
bytes are not the token's.  OpenAI's ``bytes`` exist so a client can join the tokens'
bytes and decode the text itself, so they must come from the vocabulary:

- byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2): each character of a token's string
  stands for one byte (the ``bytes_to_unicode`` table);
- SentencePiece-style vocabularies with byte fallback (Llama 2, Mistral): ``<0xAB>`` is
  the byte 0xAB, and ``▁`` is a space;
- added tokens (the template's control tokens) are their text.

Any other tokenizer falls back to the token decoded alone.
"""

from __future__ import annotations

import json
import re
import weakref
from functools import lru_cache
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's ``bytes_to_unicode``: printable stand-in → byte."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


def _decoder_types(decoder: dict[str, Any] | None) -> set[str]:
    if not decoder:
        return set()
    found = {decoder.get("type", "")}
    for inner in decoder.get("decoders") or ():
        found |= _decoder_types(inner)
    if decoder.get("type") == "Replace" and (decoder.get("pattern") or {}).get("String") == "▁":
        found.add("Metaspace")
    return found


class TokenBytes:
    """Token id → its bytes, for one tokenizer (``tokenizers.Tokenizer`` and its JSON)."""

    def __init__(self, tokenizer, spec: str, decode_one) -> None:
        self.tok = tokenizer
        data = json.loads(spec)
        kinds = _decoder_types(data.get("decoder"))
        self.byte_level = "ByteLevel" in kinds
        self.metaspace = "Metaspace" in kinds
        self.byte_fallback = "ByteFallback" in kinds or bool(
            (data.get("model") or {}).get("byte_fallback"))
        self.added = {t["id"] for t in data.get("added_tokens") or ()}
        self.decode_one = decode_one
        self.cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        got = self.cache.get(token_id)
        if got is None:
            got = self.cache[token_id] = self._bytes(token_id)
        return got

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tok.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self.added:
            return piece.encode()
        if self.byte_level:
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        if self.byte_fallback and (m := _BYTE_PIECE.fullmatch(piece)):
            return bytes([int(m.group(1), 16)])
        if self.metaspace:
            return piece.replace("▁", " ").encode()
        return self.decode_one(token_id).encode()


_OF: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def token_bytes_of(codec) -> TokenBytes:
    """The ``TokenBytes`` of a ``TextCodec`` (built once per codec)."""
    got = _OF.get(codec)
    if got is None:
        backend = codec.tok.backend_tokenizer
        got = _OF[codec] = TokenBytes(backend, backend.to_str(),
                                      lambda t: codec.decode([t]))
    return got
