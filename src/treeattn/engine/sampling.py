"""Sampling the next token from logits: greedy, temperature, top-k, top-p (the engine's and ta.generate's).

    token = sample(logits, SamplingParams(temperature=0.8, top_p=0.9), generator)   # int64 (B,): the request's SamplingParams

temperature 0 is greedy (argmax, no draw). Otherwise logits / temperature, then top-k (0: every
token), then top-p (nucleus; 1: every token), then exactly one uniform draw per row from the CPU generator: the same seed gives the
same stream of draws whatever else runs.

The distribution is computed in float64 from (logits - max) / temperature, so that no temperature,
however small, overflows to inf - inf = NaN: a temperature of 1e-40 leaves the most likely token
(ties: each of them) with all the mass, i.e. the answer greedy gives. top_p keeps the most likely
token whatever its value (1e-50 included), so a tiny top_p answers the argmax too.
"""

from __future__ import annotations

import torch

from treeattn.engine.request import SamplingParams


def chosen_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """float64 (B,) log-softmax of logits (B, V) at tokens int64 (B,): logit - logsumexp, without
    materializing the log-softmax of the whole vocabulary."""
    logits = logits.cpu().double()
    return logits.gather(1, tokens[:, None].cpu()).squeeze(1) - torch.logsumexp(logits, dim=-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """Pick the next token of each row.

    Args:
        logits: (B, V) float32.
        params: the request's SamplingParams (temperature, top_k, top_p; the rest is not read here).
        generator: CPU torch.Generator; exactly one uniform draw per row is taken from it when
            temperature > 0 (none for greedy), so the same seed gives the same stream of draws.

    Returns:
        int64 (B,) token ids on the CPU.
    """
    logits = logits.float().cpu()
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    cdf = sampling_probs(logits, params).cumsum(dim=-1)
    draw = torch.rand(logits.shape[0], 1, generator=generator, dtype=torch.float64) * cdf[:, -1:]
    return torch.searchsorted(cdf, draw, right=True).squeeze(-1).clamp(max=logits.shape[-1] - 1)


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sample() draws from, for temperature > 0: float64 (B, V) on the CPU from
    logits (B, V): logits / temperature, then top-k, then top-p, then softmax."""
    logits = logits.double().cpu()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature  # <= 0; the maxima stay 0
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the more likely tokens
        drop_sorted = mass_before >= params.top_p
        drop_sorted[:, 0] = False  # the most likely token is always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.softmax(logits, dim=-1).double()
