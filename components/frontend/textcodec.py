"""Tokens in and text out: chat template, tokenizer, incremental detokenizer, stop strings.

One ``TextCodec`` is loaded per frontend process from an HF-style model directory (the
exported SmolLM2 directory by default).  ``Detokenizer`` is per request: it turns the
token ids a worker streams into text deltas, holding back bytes of an unfinished UTF-8
character and any tail that could still become a stop string.

Encoding is thread-safe and releases the GIL (the frontend tokenises in worker threads so
a long prompt never stalls the event loop).  It runs on ``fastokens`` (a BPE encoder
whose crate Dynamo's runtime library also links, tens of times faster than
``tokenizers`` on long prompts) when it loads the model's ``tokenizer.json`` and encodes
a set of probes exactly as ``tokenizers`` does; otherwise, or with ``tokenizer:
huggingface``, on ``tokenizers``.  Chat message content is encoded as plain text: a control token such as ``<|im_end|>`` typed by a user becomes ordinary text tokens,
and only the markers the chat template itself writes are special tokens.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from .errors import bad_request

log = logging.getLogger(__name__)

TokenizerBackend = Literal["auto", "fastokens", "huggingface"]
# Text the fast encoder must encode exactly as ``tokenizers`` does before it is used (the
# model's special tokens are added to these, parsed and as plain text).
PROBES = ("Hello, world!", "  leading and trailing spaces  ", "tabs\t\tand\n\nnew lines\r\n",
          "caf\u00e9 na\u00efve \u6f22\u5b57 \u3072\u3089\u304c\u306a \U0001f600\u200d\U0001f4bb",
          "def f(x):\n    return x ** 2  # 1234567890", "'s 'll 're 've 'd 'm n't",
          "<not a token> <|fake|> </s>", "\u0000\u0001 \ufeff\u00a0")


class TextCodec:
    """Tokenizer + chat template of the served model."""

    def __init__(self, tokenizer, context_length: int, vocab_size: int | None = None,
                 encoder: TokenizerBackend = "auto") -> None:
        self.tok = tokenizer
        self.context_length = context_length
        # Ids a client may send: those the tokenizer knows and the model can embed.
        self.vocab_size = min(len(tokenizer), vocab_size) if vocab_size else len(tokenizer)
        eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        self.eos_token_ids = sorted(eos)
        # Two immutable Rust tokenizers, never reconfigured after this point (changing a
        # shared one per call would race between threads): one parses special tokens
        # (template text, raw completion prompts), one treats them as text (chat content).
        from tokenizers import Tokenizer

        backend = tokenizer.backend_tokenizer
        spec = backend.to_str()
        self._special = Tokenizer.from_str(spec)
        self._plain = Tokenizer.from_str(spec)
        self._special.encode_special_tokens = False
        self._plain.encode_special_tokens = True
        self.special_tokens = sorted(tokenizer.all_special_tokens)
        self.special_ids = frozenset(tokenizer.all_special_ids)
        # Most characters one token can cover; None when a normalizer may shrink text
        # (then no bound holds).  Lets a prompt far beyond the context window be refused
        # without tokenising megabytes.
        self.max_token_chars = (max(map(len, backend.get_vocab())) if
                                backend.normalizer is None else None)
        # Decoding straight through the Rust tokenizer is what transformers' decode does
        # for a fast tokenizer without clean-up, minus its per-call Python (a streamed
        # answer decodes at every token); any other tokenizer goes through transformers.
        self._decoder = self._special if (
            hasattr(tokenizer, "_tokenizer")
            and not getattr(tokenizer, "clean_up_tokenization_spaces", True)) else None
        self._fast = None if encoder == "huggingface" else self._load_fast(spec, encoder)
        self.encoder: TokenizerBackend = "fastokens" if self._fast is not None else "huggingface"

    def _load_fast(self, spec: str, wanted: TokenizerBackend):
        """The ``fastokens`` encoder of this model (``spec``: its ``tokenizer.json``) when
        it encodes every probe (and the special tokens, parsed and as text) exactly as
        ``tokenizers``; else None, or an error when ``fastokens`` was asked for by name."""
        try:
            import fastokens

            fast = fastokens.Tokenizer.from_json_str(spec)
            probes = [*PROBES, " ".join(self.special_tokens),
                      "".join(f"{t}x{t} " for t in self.special_tokens)]
            for specials in (True, False):
                if _fast_ids(fast, specials, probes) != self._encode_hf(specials, probes):
                    raise ValueError("it encodes the probes differently from tokenizers")
        except Exception as exc:  # not installed, or a model it does not read the same
            if wanted == "fastokens":
                raise ValueError(f"tokenizer: fastokens cannot encode this model: {exc}") \
                    from exc
            log.warning("tokenising with tokenizers (slower): fastokens unusable here: %s", exc)
            return None
        return fast

    @classmethod
    def from_dir(cls, model_dir: Path, context_length: int | None = None,
                 encoder: TokenizerBackend = "auto") -> TextCodec:
        """Load from a directory holding tokenizer.json/tokenizer_config.json (+ config)."""
        import json

        from splitserve.contracts.kit.model_dir import load_tokenizer
        from splitserve.contracts.model_files import read_model_info

        tok = load_tokenizer(model_dir)
        cfg_path = Path(model_dir) / "config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        info = read_model_info(Path(model_dir)) if cfg else None
        if context_length is None:
            context_length = info.context_length if info else 2048
        vocab = cfg.get("vocab_size")
        codec = cls(tok, context_length, int(vocab) if vocab else None, encoder)
        if info is not None:  # generation_config.json's end-of-sequence ids stop too
            codec.eos_token_ids = sorted({*codec.eos_token_ids, *info.eos_token_ids})
        return codec

    def _encode(self, specials: bool, texts: list[str]) -> list[list[int]]:
        """Token ids of ``texts``, control tokens parsed (``specials``) or read as text."""
        if self._fast is not None:
            return _fast_ids(self._fast, specials, texts)
        return self._encode_hf(specials, texts)

    def _encode_hf(self, specials: bool, texts: list[str]) -> list[list[int]]:
        # Releases the GIL while the Rust tokenizer works; ``encode_batch_fast`` skips the
        # character offsets nothing here reads (a quarter of the CPU on long prompts).
        tokenizer = self._special if specials else self._plain
        encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    @property
    def template_has_tools(self) -> bool:
        """Whether the chat template renders tool definitions and calls itself."""
        template = self.tok.chat_template
        if isinstance(template, dict):
            template = template.get("tool_use") or template.get("default") or ""
        return "tools" in (template or "")

    def chat_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of a chat rendered with the model's template and a generation prompt.

        The whole rendering is encoded at once (the usual tokenisation) unless the content
        produced a control token: then the template is rendered with a unique marker in
        place of each content, the template's own text is encoded with special tokens and
        the content as plain text.  A template that rewrites content (trimming, say)
        cannot be split that way: such content is refused with 400 instead.
        """
        def render(msgs, **kw):
            if tools:
                kw["tools"] = tools
            return self.tok.apply_chat_template(msgs, **kw)

        real = render(messages, add_generation_prompt=True, tokenize=False)
        nonce = secrets.token_hex(8)
        marked = [{**m, "content": f"\ue000{nonce}:{i}\ue001"} for i, m in enumerate(messages)]
        literal, order = _split_marked(render(marked, add_generation_prompt=True,
                                              tokenize=False), nonce)
        contents = [messages[i]["content"] for i in order]
        lit_ids = self._encode(True, literal)
        whole = self._encode(True, [real])[0]
        if self._controls(whole) == [t for p in lit_ids for t in self._controls(p)]:
            return whole
        if "".join(p + c for p, c in zip(literal, contents + [""], strict=True)) != real:
            i = next((i for i, m in enumerate(messages)
                      if any(s in m["content"] for s in self.special_tokens)), 0)
            raise bad_request("message content holds a control token of the model",
                              f"messages.{i}.content", "control_token_in_content")
        content_ids = self._encode(False, contents) if contents else []
        ids: list[int] = []
        for i, part in enumerate(lit_ids):
            ids += part
            if i < len(content_ids):
                ids += content_ids[i]
        return ids

    def _controls(self, ids: list[int]) -> list[int]:
        return [t for t in ids if t in self.special_ids]

    def surely_too_long(self, text_chars: int) -> bool:
        """True when text of this many characters cannot fit the context window."""
        return (self.max_token_chars is not None
                and text_chars > self.context_length * self.max_token_chars)

    def prompt_ids(self, prompt: str) -> list[int]:
        """Token ids of a raw completion prompt (the client owns it: specials are parsed)."""
        return self._encode(True, [prompt])[0]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._decoder is not None:
            return self._decoder.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def detokenizer(self, stop: list[str], keep_special_tokens: bool = False) -> Detokenizer:
        """A request's detokenizer; ``keep_special_tokens`` for answers whose format
        marks its parts with special tokens (a tool-call parser asks for it)."""
        return Detokenizer(self, list(stop), keep_special_tokens=keep_special_tokens)


def _split_marked(text: str, nonce: str) -> tuple[list[str], list[int]]:
    """A template rendered with ``\ue000<nonce>:<i>\ue001`` in place of each message's
    content: the template's own text between the markers, and each marker's message
    index in order.  Plain string splits (a pattern with the per-request nonce in it
    would be compiled anew for every request); a marker the template altered stays
    part of the text around it."""
    head = f"\ue000{nonce}:"
    parts = text.split(head)
    literal, order = [parts[0]], []
    for part in parts[1:]:
        index, end, rest = part.partition("\ue001")
        if end and index.isdigit():
            order.append(int(index))
            literal.append(rest)
        else:
            literal[-1] += head + part
    return literal, order


def _fast_ids(fast, specials: bool, texts: list[str]) -> list[list[int]]:
    """Token ids of ``texts`` from a ``fastokens`` encoder, control tokens parsed
    (``specials``) or read as text."""
    return [e.ids for e in fast.encode_batch(texts, split_special_tokens=not specials)]


@dataclass
class Detokenizer:
    """Incremental detokenizer with stop-string handling for one request."""

    codec: TextCodec
    stop: list[str]
    keep_special_tokens: bool = False
    """Special tokens are text too (the end-of-sequence token never is)."""
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    held: str = ""
    stopped: bool = False
    text_ids: list[int] | None = None
    """The token ids the text the last ``push`` returned was decoded from (special
    tokens among them even where the text leaves them out, as an engine's own output
    reports them): a tool-call or reasoning parser's delta ids, which would otherwise
    be re-encoded from the text.  None when the text is not theirs alone (held-back
    text released with it, a stop string cut it)."""

    def _decode_new(self) -> str:
        # Decode a short window so that merges across token boundaries (spaces, multi-byte
        # characters) come out right without re-decoding the whole output every step.
        skip = not self.keep_special_tokens
        prefix = self.codec.decode(self.ids[self.prefix_offset:self.read_offset], skip)
        full = self.codec.decode(self.ids[self.prefix_offset:], skip)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""  # an unfinished UTF-8 character: wait for more tokens
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full[len(prefix):]

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the text that is now safe to send (may be empty)."""
        self.text_ids = None
        if self.stopped:
            return ""
        if self.keep_special_tokens:
            token_ids = [t for t in token_ids if t not in self.codec.eos_token_ids]
        start = self.read_offset
        self.ids.extend(token_ids)
        text = self.held + self._decode_new()
        exact = not self.held  # no earlier text released with it
        if self.stop:
            hit = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
            if hit >= 0:
                self.stopped = True
                self.held = ""
                return text[:hit]
            keep = _longest_stop_prefix_suffix(text, self.stop)
            exact = exact and not keep
            self.held = text[len(text) - keep:] if keep else ""
            text = text[:len(text) - keep] if keep else text
        if exact:
            self.text_ids = self.ids[start:self.read_offset]
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
