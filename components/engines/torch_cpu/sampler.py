"""Next-token choice: logit processors on the batch, then one draw per sequence.

``process_logits`` applies what changes the model's distribution (logit bias, the
min-tokens ban on stop tokens, presence / frequency / repetition penalties) to the whole
batch with tensor ops; ``sample_token`` then picks each sequence's token (greedy, or
temperature with top-k / min-p / top-p).  Log-probabilities are the log-softmax of the
processed logits before temperature, the distribution the request's parameters define.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .grammar import mask_logits
from .request import Sequence

TopLogprobs = tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class Sampled:
    """One sequence's new token and, when asked for, its log-probabilities."""

    token: int
    logprob: float | None = None
    top: TopLogprobs = ()


def sample_batch(logits: torch.Tensor, seqs: list[Sequence]) -> list[Sampled]:
    """Pick the next token of every sequence; ``logits`` [B, vocab] row i is seqs[i]'s.

    Called once per engine step with the rows that sample."""
    processed = process_logits(logits, seqs)
    out = []
    for row, seq in enumerate(seqs):
        req = seq.request
        token = sample_token(processed[row], req.temperature, req.top_p, seq.generator,
                             top_k=req.top_k, min_p=req.min_p)
        if req.logprobs is None:
            out.append(Sampled(token))
            continue
        lp = torch.log_softmax(processed[row].float(), dim=-1)
        out.append(Sampled(token, float(lp[token]), top_logprobs(lp, req.logprobs)))
    return out


def top_logprobs(lp: torch.Tensor, n: int) -> TopLogprobs:
    """The ``n`` most likely (token id, log-probability) pairs of ``lp`` [vocab]."""
    if n <= 0:
        return ()
    vals, ids = torch.topk(lp, n)
    return tuple(zip(ids.tolist(), vals.tolist(), strict=True))


def prompt_logprobs(logits: torch.Tensor, next_ids: list[int], n: int
                    ) -> tuple[list[float], list[TopLogprobs]]:
    """Log-probabilities of ``next_ids[i]`` under ``logits[i]`` [k, vocab] (the model's
    prediction at the position before it), with the ``n`` best alternatives each."""
    lp = torch.log_softmax(logits[: len(next_ids)].float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(next_ids, dtype=torch.long)[:, None])[:, 0]
    return chosen.tolist(), [top_logprobs(row, n) for row in lp]


def process_logits(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The batch's logits after each request's bias, min-tokens ban and penalties.

    Returns ``logits`` itself when no request asks for any of them (neutral requests
    sample exactly as before), else a float32 copy."""
    if all(s.request.neutral_logits for s in seqs):
        return logits
    out = logits.float().clone()
    vocab = out.shape[1]
    _add_bias(out, seqs)
    _ban_early_stops(out, seqs)
    constrained = [(i, s.matcher) for i, s in enumerate(seqs) if s.matcher is not None]
    if constrained:
        mask_logits(out, constrained)
    rows = [i for i, s in enumerate(seqs) if _penalised(s)]
    if rows:
        counts = _output_counts([seqs[i].output_ids for i in rows], vocab)  # [R, vocab]
        _apply_penalties(out, rows, counts, [seqs[i] for i in rows])
    return out


def _penalised(seq: Sequence) -> bool:
    r = seq.request
    return r.presence_penalty != 0 or r.frequency_penalty != 0 or r.repetition_penalty != 1.0


def _add_bias(out: torch.Tensor, seqs: list[Sequence]) -> None:
    rows, cols, vals = [], [], []
    for i, s in enumerate(seqs):
        for tok, bias in s.request.logit_bias:
            rows.append(i)
            cols.append(tok)
            vals.append(bias)
    if rows:
        out.index_put_((torch.tensor(rows), torch.tensor(cols)),
                       torch.tensor(vals, dtype=out.dtype), accumulate=True)


def _ban_early_stops(out: torch.Tensor, seqs: list[Sequence]) -> None:
    """Stop tokens cannot be sampled while a request has fewer than min_tokens outputs."""
    rows, cols = [], []
    for i, s in enumerate(seqs):
        if len(s.output_ids) < s.request.min_tokens:
            rows += [i] * len(s.stop_ids)
            cols += list(s.stop_ids)
    if rows:
        out[torch.tensor(rows), torch.tensor(cols)] = float("-inf")


def _output_counts(outputs: list[list[int]], vocab: int) -> torch.Tensor:
    """[R, vocab] occurrence counts of each row's generated tokens."""
    width = max((len(o) for o in outputs), default=0)
    ids = torch.full((len(outputs), max(width, 1)), vocab, dtype=torch.long)  # pad: column V
    for r, o in enumerate(outputs):
        if o:
            ids[r, : len(o)] = torch.tensor(o, dtype=torch.long)
    counts = torch.zeros(len(outputs), vocab + 1)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab]


def _apply_penalties(out: torch.Tensor, rows: list[int], counts: torch.Tensor,
                     seqs: list[Sequence]) -> None:
    """OpenAI's presence / frequency penalties on generated tokens and CTRL's repetition
    penalty on prompt and generated tokens, for ``rows`` of ``out`` in place."""
    idx = torch.tensor(rows)
    sub = out[idx]
    freq = torch.tensor([s.request.frequency_penalty for s in seqs])[:, None]
    pres = torch.tensor([s.request.presence_penalty for s in seqs])[:, None]
    sub -= freq * counts + pres * (counts > 0).to(sub.dtype)
    rep = torch.tensor([s.request.repetition_penalty for s in seqs])[:, None]
    if bool((rep != 1.0).any()):
        seen = counts > 0
        prompt = _output_counts([list(s.request.prompt_token_ids) for s in seqs],
                                out.shape[1]) > 0
        seen |= prompt
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalised, sub)
    out[idx] = sub


def sample_token(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None,
    *, top_k: int = 0, min_p: float = 0.0,
) -> int:
    """Pick the next token from logits [vocab]; called once per sequence per step.

    Greedy (temperature 0) is argmax, which breaks ties towards the lowest id.
    Sampling draws exactly one uniform number per token from the request's own
    generator (inverse-CDF), so the generator's state after n tokens is known:
    a decode engine that receives the first token from elsewhere skips one draw
    (``skip_draw``) and continues the same random stream.
    """
    if temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.double() / temperature, dim=-1)  # [vocab]
    sorted_probs, order = torch.sort(probs, descending=True)
    zero = torch.zeros_like(sorted_probs)
    if top_k > 0:
        sorted_probs = torch.where(torch.arange(sorted_probs.shape[0]) < top_k,
                                   sorted_probs, zero)
    if min_p > 0.0:
        sorted_probs = torch.where(sorted_probs >= min_p * sorted_probs[0], sorted_probs, zero)
    if top_p < 1.0:
        # Keep the smallest head whose mass reaches top_p (always at least one token).
        mass = sorted_probs / sorted_probs.sum() if top_k > 0 or min_p > 0.0 else sorted_probs
        before = torch.cumsum(mass, 0) - mass
        sorted_probs = torch.where(before < top_p, sorted_probs, zero)
    cdf = torch.cumsum(sorted_probs, 0)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    idx = min(int(torch.searchsorted(cdf, u, right=True)), cdf.shape[0] - 1)
    return int(order[idx])


def skip_draw(generator: torch.Generator | None) -> None:
    """Advance ``generator`` past one token's draw (the token was sampled elsewhere)."""
    torch.rand((), generator=generator, dtype=torch.float64)
