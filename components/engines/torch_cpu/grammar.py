"""JSON-schema constrained decoding for the torch engine, with xgrammar token masks.

``JsonGrammars`` compiles a request's schema (cached by its text) into a matcher that
says which tokens may come next; the sampler masks every other token's logit to -inf,
so the output always parses and validates (unless max_tokens cuts it short).
"""

from __future__ import annotations

import functools
from typing import Any

import torch


class JsonGrammars:
    """Compiles JSON schemas against the served tokenizer; built once per engine, the
    tokenizer's token table is read on the first constrained request."""

    def __init__(self, tokenizer: Any, vocab_size: int, cache_size: int = 64) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compile = functools.lru_cache(cache_size)(self._compile_uncached)

    @functools.cached_property
    def _compiler(self):
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
        return xgr.GrammarCompiler(info, max_threads=1)

    def _compile_uncached(self, schema: str):
        return self._compiler.compile_json_schema(schema, any_whitespace=False)

    def matcher(self, schema: str):
        """A fresh matcher for ``schema`` (JSON text); raises ValueError if it is invalid."""
        import xgrammar as xgr

        try:
            return xgr.GrammarMatcher(self._compile(schema))
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"invalid JSON schema: {exc}") from None


def mask_logits(out: torch.Tensor, matchers: list[tuple[int, Any]]) -> None:
    """Set to -inf, in place, the logits of ``out`` [B, vocab] rows ``i`` that the
    matcher of row ``i`` does not allow next."""
    import xgrammar as xgr

    mask = xgr.allocate_token_bitmask(out.shape[0], out.shape[1])
    for row, matcher in matchers:
        matcher.fill_next_token_bitmask(mask, row)
    xgr.apply_token_bitmask_inplace(out, mask, indices=[row for row, _ in matchers])
