"""Our forward pass against transformers, and the batch invariance it relies on."""

from __future__ import annotations

import pytest
import torch

from splitserve.components.engines.torch_cpu import LoadedModel, Request, chat_prompt_ids
from splitserve.components.engines.torch_cpu.model import score_prompt
from splitserve.components.engines.torch_cpu.ops import Linear

pytestmark = pytest.mark.unit

PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Paris is the capital of France. Berlin is the capital of Germany. Madrid is",
]


@pytest.mark.parametrize(("out_f", "in_f"), [(960, 576), (576, 576), (3072, 576), (576, 1536)])
def test_linear_rows_do_not_depend_on_batch_size(out_f: int, in_f: int) -> None:
    gen = torch.Generator().manual_seed(out_f + in_f)
    lin = Linear(torch.randn(out_f, in_f, generator=gen) / in_f**0.5)
    x = torch.randn(70, in_f, generator=gen)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(x.shape[0])])
    for rows in (2, 3, 16, 17, 33, 70):
        assert torch.equal(lin(x[:rows]), alone[:rows]), rows
    torch.testing.assert_close(lin(x), x @ lin_weight(lin), rtol=1e-5, atol=1e-5)


def lin_weight(lin: Linear) -> torch.Tensor:
    return torch.cat(lin.chunks)


@pytest.mark.parametrize("text", PROMPTS)
def test_logits_match_transformers(smollm2: LoadedModel, text: str) -> None:
    ids = smollm2.tokenizer(text)["input_ids"]
    ours = score_prompt(smollm2.weights, smollm2.config, ids)  # [n, vocab]
    with torch.inference_mode():
        ref = smollm2.hf_model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=2e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_chat_template_answers_paris(smollm2: LoadedModel, make_engine) -> None:
    ids = chat_prompt_ids(
        smollm2.tokenizer, [{"role": "user", "content": "What is the capital of France?"}]
    )
    engine = make_engine()
    engine.add_request(Request("q", tuple(ids), max_tokens=40))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            last = out
    assert last.finish_reason == "stop"
    answer = smollm2.tokenizer.decode(tokens, skip_special_tokens=True)
    assert answer.strip() == "The capital of France is Paris."
