"""Sampling the next token from logits: greedy, temperature, min-p, top-k, top-p, with logit_bias and
presence / frequency / repetition penalties (the engine's and ta.generate's).

    token = sample(logits, SamplingParams(temperature=0.8, top_p=0.9), generator)   # int64 (B,): the request's SamplingParams
    token = sample(logits, params, generator, prompt_ids=prompt, output_ids=output)  # penalties read the request's tokens

vLLM's order: logit_bias is added, then the penalties (repetition over the prompt's and the output's
tokens: a positive logit divided by it, a negative one multiplied; frequency times each token's count
in the output, presence once per token the output holds, both subtracted), all in float64
(adjust_logits). temperature 0 is then greedy (argmax, no draw). Otherwise logits / temperature, then
min-p (tokens below min_p times the top probability dropped), then top-k (0: every token), then top-p
(nucleus; 1: every token), then exactly one uniform draw per row from the CPU generator: the same
seed gives the same stream of draws whatever else runs.

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


def adjust_logits(logits: torch.Tensor, params: SamplingParams, prompt_ids=(), output_ids=()) -> torch.Tensor:
    """logits (B, V) with params' logit_bias and penalties applied (vLLM's order and semantics), float64
    on the CPU; the logits themselves (float32) when params sets none. prompt_ids, output_ids: the
    request's prompt and its generated tokens so far (sequences of ints, the same for every row).

    Example::

        >>> import torch, treeattn as ta
        >>> from treeattn.engine.worker.sampling import adjust_logits
        >>> logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
        >>> params = ta.SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, logit_bias={3: 1.0})
        >>> adjust_logits(logits, params, prompt_ids=[0], output_ids=[1, 1]).tolist()   # 2/2, -1*2 - 2*0.5, 0.5, 1 + 1
        [[1.0, -3.0, 0.5, 2.0]]
    """
    logits = logits.float().cpu()
    if not params.logit_bias and not params.penalized:
        return logits
    logits = logits.double()
    vocab = logits.shape[-1]
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.int64)
        logits[:, ids] += torch.tensor([b for _, b in params.logit_bias], dtype=torch.float64)
    if params.penalized:
        counts = torch.bincount(torch.as_tensor(list(output_ids), dtype=torch.int64), minlength=vocab)[:vocab].double()
        if params.repetition_penalty != 1:
            seen = counts > 0
            seen[torch.as_tensor(list(prompt_ids), dtype=torch.int64)] = True
            penalized = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
            logits = torch.where(seen, penalized, logits)
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).double()
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator, *, prompt_ids=(),
           output_ids=()) -> torch.Tensor:
    """Pick the next token of each row.

    Args:
        logits: (B, V) float32.
        params: the request's SamplingParams (temperature, top_k, top_p, min_p, logit_bias and the
            penalties; the rest is not read here).
        generator: CPU torch.Generator; exactly one uniform draw per row is taken from it when
            temperature > 0 (none for greedy), so the same seed gives the same stream of draws.
        prompt_ids, output_ids: the request's prompt and generated tokens so far (read only when a
            penalty is set: repetition reads both, presence and frequency the output).

    Returns:
        int64 (B,) token ids on the CPU.
    """
    logits = adjust_logits(logits, params, prompt_ids, output_ids)
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    cdf = sampling_probs(logits, params).cumsum(dim=-1)
    draw = torch.rand(logits.shape[0], 1, generator=generator, dtype=torch.float64) * cdf[:, -1:]
    return torch.searchsorted(cdf, draw, right=True).squeeze(-1).clamp(max=logits.shape[-1] - 1)


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sample() draws from, for temperature > 0: float64 (B, V) on the CPU from
    logits (B, V) (adjust_logits' already): logits / temperature, then min-p, then top-k, then top-p, then softmax."""
    logits = logits.double().cpu()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature  # <= 0; the maxima stay 0
    if params.min_p > 0:  # p < min_p * p_max, i.e. exp(logit) < min_p (the maxima are 0): vLLM's rule, in float64
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
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


def share_maxima(logits: torch.Tensor, offset: int) -> torch.Tensor:
    """What one rank's share of a split vocabulary tells about each row's argmax: float64 (rows, 3) on
    logits' device, from logits (rows, n) of token ids offset..offset + n - 1: the row's largest value,
    the id of its first occurrence, and 1.0 if the row's values are all finite (else 0.0). An empty
    share (n = 0) gives -inf, offset, 1.0: it never wins a finite row. split_argmax combines the ranks'.

    Example::

        >>> import torch
        >>> from treeattn.engine.worker.sampling import share_maxima
        >>> share_maxima(torch.tensor([[1.0, 3.0, 3.0], [0.0, float("nan"), 2.0]]), offset=6).tolist()
        [[3.0, 7.0, 1.0], [nan, 7.0, 0.0]]
    """
    out = torch.empty(logits.shape[0], 3, dtype=torch.float64, device=logits.device)
    if logits.shape[-1] == 0:
        out[:, 0], out[:, 1], out[:, 2] = float("-inf"), offset, 1.0
        return out
    # the first occurrence of the row's maximum (a NaN's where there is one); on the CPU numpy's, vectorized: 10 us
    # over Gemma 3's half vocabulary where torch.argmax took 200 (and aminmax along a dim 310 where amax, amin take 10)
    if logits.device.type == "cpu":
        index = torch.from_numpy(logits.float().numpy().argmax(axis=-1))
    else:
        index = logits.argmax(dim=-1)
    low, high = logits.amin(dim=-1), logits.amax(dim=-1)  # a NaN makes both NaN, an infinity one of them
    out[:, 0] = high  # the value at `index` where the row is finite
    out[:, 1] = index + offset
    out[:, 2] = torch.isfinite(low) & torch.isfinite(high)
    return out


def split_argmax(maxima: torch.Tensor) -> list[int | None]:
    """Each row's greedy token from every rank's share_maxima, stacked (ranks, rows, 3) in rank order
    (rank r's share holds the ids before rank r + 1's): exactly torch.argmax over the whole row (the
    largest value, ties to the smallest id: the first rank that holds it, its first occurrence there),
    or None where any share of the row holds a value that is not finite.

    Example::

        >>> import torch
        >>> from treeattn.engine.worker.sampling import share_maxima, split_argmax
        >>> logits = torch.tensor([[1.0, 5.0, 2.0, 5.0, 0.0], [1.0, 2.0, 3.0, float("inf"), 0.0]])
        >>> split_argmax(torch.stack([share_maxima(logits[:, :3], 0), share_maxima(logits[:, 3:], 3)]))
        [1, None]
    """
    finite = (maxima[..., 2] == 1).all(dim=0)
    best = maxima[..., 0].argmax(dim=0)  # the first rank whose maximum is the row's: the smallest id
    ids = maxima[..., 1].gather(0, best[None])[0]
    return [int(i) if ok else None for i, ok in zip(ids.tolist(), finite.tolist())]
