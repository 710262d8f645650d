"""The torch engine's sampler on synthetic logits: each parameter changes the distribution
as specified, neutral parameters change nothing, log-probabilities are log-softmax."""

from __future__ import annotations

import pytest
import torch

from splitserve.components.engines.torch_cpu.request import Request, Sequence
from splitserve.components.engines.torch_cpu.sampler import (
    process_logits,
    prompt_logprobs,
    sample_batch,
    sample_token,
)

pytestmark = pytest.mark.unit

VOCAB = 12
EOS = 11


def seq(output: list[int] = (), prompt: tuple[int, ...] = (1, 2, 3), seed: int | None = None,
        **params) -> Sequence:
    req = Request("r", prompt, max_tokens=64, seed=seed, **params)
    gen = None
    if req.temperature > 0:
        gen = torch.Generator()
        gen.manual_seed(seed if seed is not None else 0)
    s = Sequence(req, 0, frozenset({EOS}), gen)
    s.output_ids = list(output)
    return s


def logits(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def fresh() -> torch.Tensor:
    torch.manual_seed(7)
    return torch.randn(2, VOCAB)


def test_neutral_parameters_return_the_logits_unchanged():
    x = fresh()
    assert process_logits(x, [seq(), seq(temperature=0.7, top_p=0.9)]) is x
    greedy = sample_batch(x, [seq(), seq()])
    assert [g.token for g in greedy] == torch.argmax(x, dim=1).tolist()
    assert all(g.logprob is None for g in greedy)


def test_logit_bias_adds_to_the_named_tokens_only():
    x = fresh()
    out = process_logits(x, [seq(logit_bias=((3, 5.0), (4, -100.0))), seq()])
    expected = x[0].clone()
    expected[3] += 5.0
    expected[4] -= 100.0
    assert torch.allclose(out[0], expected)
    assert torch.equal(out[1], x[1])
    # a strongly banned token is never picked, even when it was the argmax
    top = int(torch.argmax(x[0]))
    picks = sample_batch(x, [seq(logit_bias=((top, -100.0),)), seq()])
    assert picks[0].token != top


def test_presence_and_frequency_penalties_follow_openai():
    x = fresh()
    out_ids = [5, 5, 5, 6]
    out = process_logits(x[:1], [seq(out_ids, presence_penalty=0.5, frequency_penalty=0.25)])
    expected = x[0].clone()
    expected[5] -= 3 * 0.25 + 0.5
    expected[6] -= 1 * 0.25 + 0.5
    assert torch.allclose(out[0], expected)
    # prompt tokens are not penalised by presence / frequency
    assert out[0, 1] == x[0, 1]


def test_repetition_penalty_covers_prompt_and_output():
    x = logits([2.0, -2.0, 4.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    out = process_logits(x, [seq([2], prompt=(0, 1), repetition_penalty=2.0)])
    assert out[0, :5].tolist() == [1.0, -4.0, 2.0, 1.0, 0.5]


def test_min_tokens_bans_stop_tokens_until_reached():
    x = torch.zeros(1, VOCAB)
    x[0, EOS] = 10.0
    early = sample_batch(x, [seq([4, 4], min_tokens=3)])[0]
    assert early.token != EOS
    assert sample_batch(x, [seq([4, 4, 4], min_tokens=3)])[0].token == EOS


@pytest.mark.parametrize("top_k, allowed", [(1, {0}), (3, {0, 1, 2})])
def test_top_k_keeps_the_k_most_likely(top_k, allowed):
    x = logits([5.0, 4.0, 3.0] + [0.0] * (VOCAB - 3))
    gen = torch.Generator()
    gen.manual_seed(1)
    got = {sample_token(x[0], 1.0, 1.0, gen, top_k=top_k) for _ in range(300)}
    assert got <= allowed and (top_k == 1 or len(got) > 1)


def test_min_p_drops_tokens_below_the_fraction_of_the_best():
    # probabilities ~ e^3 : e^2.5 : e^0 ... ; min_p 0.5 keeps only the first two
    x = logits([3.0, 2.5] + [0.0] * (VOCAB - 2))
    gen = torch.Generator()
    gen.manual_seed(2)
    got = {sample_token(x[0], 1.0, 1.0, gen, min_p=0.5) for _ in range(300)}
    assert got == {0, 1}


def test_seeded_sampling_repeats_and_draws_once_per_token():
    x = fresh()
    a = [sample_batch(x, [seq(seed=5, temperature=1.0, presence_penalty=0.1)])[0].token
         for _ in range(1)]
    b = [sample_batch(x, [seq(seed=5, temperature=1.0, presence_penalty=0.1)])[0].token
         for _ in range(1)]
    assert a == b
    s = seq(seed=9, temperature=1.0)
    sample_batch(x[:1], [s])
    g = torch.Generator()
    g.manual_seed(9)
    torch.rand((), generator=g, dtype=torch.float64)
    assert torch.equal(s.generator.get_state(), g.get_state())


def test_logprobs_are_log_softmax_of_the_processed_logits():
    x = fresh()
    s = seq(logprobs=3, logit_bias=((2, 1.5),))
    picked = sample_batch(x[:1], [s])[0]
    ref = torch.log_softmax(process_logits(x[:1], [s])[0], dim=-1)
    assert picked.token == int(torch.argmax(ref))
    assert picked.logprob == pytest.approx(float(ref[picked.token]))
    best = torch.topk(ref, 3)
    assert [t for t, _ in picked.top] == best.indices.tolist()
    assert [v for _, v in picked.top] == pytest.approx(best.values.tolist())
    # temperature does not change the reported distribution
    hot = sample_batch(x[:1], [seq(logprobs=0, temperature=1.5, seed=1)])[0]
    assert hot.logprob == pytest.approx(float(torch.log_softmax(x[0], -1)[hot.token]))
    assert hot.top == ()


def test_prompt_logprobs_score_each_next_token():
    x = fresh()
    lps, tops = prompt_logprobs(x, [4, 7], 2)
    ref = torch.log_softmax(x, dim=-1)
    assert lps == pytest.approx([float(ref[0, 4]), float(ref[1, 7])])
    assert [t for t, _ in tops[1]] == torch.topk(ref[1], 2).indices.tolist()


@pytest.mark.parametrize("bad", [dict(top_k=-1), dict(min_p=1.5), dict(repetition_penalty=0),
                                 dict(min_tokens=-1), dict(logprobs=-1)])
def test_invalid_sampling_values_are_refused(bad):
    with pytest.raises(ValueError):
        Request("r", (1,), **bad)
