"""Tokens in and text out: chat template, tokenizer, incremental detokenizer, stop strings.

One ``TextCodec`` is loaded per frontend process from an HF-style model directory (the
exported SmolLM2 directory by default).  ``Detokenizer`` is per request: it turns the
token ids a worker streams into text deltas, holding back bytes of an unfinished UTF-8
character and any tail that could still become a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


class TextCodec:
    """Tokenizer + chat template of the served model."""

    def __init__(self, tokenizer, context_length: int) -> None:
        self.tok = tokenizer
        self.context_length = context_length
        eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        self.eos_token_ids = sorted(eos)

    @classmethod
    def from_dir(cls, model_dir: Path, context_length: int | None = None) -> TextCodec:
        """Load from a directory holding tokenizer.json/tokenizer_config.json (+ config)."""
        import json

        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir))
        if context_length is None:
            cfg = Path(model_dir) / "config.json"
            context_length = 2048
            if cfg.exists():
                context_length = int(json.loads(cfg.read_text()).get(
                    "max_position_embeddings", context_length))
        return cls(tok, context_length)

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat rendered with the model's template and a generation prompt."""
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tok.encode(text, add_special_tokens=False)

    def prompt_ids(self, prompt: str) -> list[int]:
        """Token ids of a raw completion prompt."""
        return self.tok.encode(prompt, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def detokenizer(self, stop: list[str]) -> Detokenizer:
        return Detokenizer(self, list(stop))


@dataclass
class Detokenizer:
    """Incremental detokenizer with stop-string handling for one request."""

    codec: TextCodec
    stop: list[str]
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    held: str = ""
    stopped: bool = False

    def _decode_new(self) -> str:
        # Decode a short window so that merges across token boundaries (spaces, multi-byte
        # characters) come out right without re-decoding the whole output every step.
        prefix = self.codec.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.codec.decode(self.ids[self.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""  # an unfinished UTF-8 character: wait for more tokens
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full[len(prefix):]

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the text that is now safe to send (may be empty)."""
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        text = self.held + self._decode_new()
        if self.stop:
            hit = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
            if hit >= 0:
                self.stopped = True
                self.held = ""
                return text[:hit]
            keep = _longest_stop_prefix_suffix(text, self.stop)
            self.held = text[len(text) - keep:] if keep else ""
            return text[:len(text) - keep] if keep else text
        return text

    def flush(self) -> str:
        """At the end of generation: release any held-back text (no stop matched)."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out


def _longest_stop_prefix_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
