"""Next-token choice for one sequence: greedy, or temperature / top-p sampling."""

from __future__ import annotations

import torch


def sample_token(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
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
    if top_p < 1.0:
        # Keep the smallest head whose mass reaches top_p (always at least one token).
        before = torch.cumsum(sorted_probs, 0) - sorted_probs
        sorted_probs = torch.where(before < top_p, sorted_probs, torch.zeros_like(sorted_probs))
    cdf = torch.cumsum(sorted_probs, 0)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    idx = min(int(torch.searchsorted(cdf, u, right=True)), cdf.shape[0] - 1)
    return int(order[idx])


def skip_draw(generator: torch.Generator | None) -> None:
    """Advance ``generator`` past one token's draw (the token was sampled elsewhere)."""
    torch.rand((), generator=generator, dtype=torch.float64)
