"""Structured output in the torch sampler: with a JSON schema's token mask, even random
logits can only spell JSON that validates against the schema."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from splitserve.components.engines.torch_cpu.grammar import JsonGrammars
from splitserve.components.engines.torch_cpu.request import Request, Sequence
from splitserve.components.engines.torch_cpu.sampler import sample_batch

pytestmark = pytest.mark.unit

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "year": {"type": "integer"}},
          "required": ["city", "year"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return JsonGrammars(tokenizer, len(tokenizer))


def generate(grammars, tokenizer, schema: dict, seed: int, steps: int = 80) -> str:
    eos = tokenizer.eos_token_id
    req = Request("r", (1,), max_tokens=steps, json_schema=json.dumps(schema))
    seq = Sequence(req, 0, frozenset({eos}), None)
    seq.matcher = grammars.matcher(req.json_schema)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        logits = torch.randn(1, len(tokenizer), generator=gen) * 5
        tok = sample_batch(logits, [seq])[0].token
        if tok == eos:
            break
        seq.output_ids.append(tok)
        assert seq.matcher.accept_token(tok)
    else:
        pytest.fail("the grammar never allowed the end of the answer")
    return tokenizer.decode(seq.output_ids)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_logits_under_a_schema_mask_give_valid_json(grammars, tokenizer, seed):
    out = json.loads(generate(grammars, tokenizer, SCHEMA, seed, steps=120))
    assert set(out) == {"city", "year"}
    assert isinstance(out["city"], str) and len(out["city"]) <= 12
    assert isinstance(out["year"], int)


def test_json_object_allows_any_object(grammars, tokenizer):
    out = json.loads(generate(grammars, tokenizer, {"type": "object",
                                                    "maxProperties": 1}, 3, steps=200))
    assert isinstance(out, dict)


def test_an_invalid_schema_is_a_value_error(grammars):
    with pytest.raises(ValueError, match="invalid JSON schema"):
        grammars.matcher('{"type": "no-such-type"}')
