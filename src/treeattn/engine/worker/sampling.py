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

    Only the columns a bias or a penalty touches are computed (the request's tokens, not the vocabulary), with
    the arithmetic every column would get: x / r or x * r, then (x - frequency * count) - presence.

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
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.int64)
        logits[:, ids] += torch.tensor([b for _, b in params.logit_bias], dtype=torch.float64)
    if params.penalized:
        output = torch.as_tensor(list(output_ids), dtype=torch.int64)
        output = output[output < logits.shape[-1]]  # an id past the logits' vocabulary has no column to penalize
        if params.repetition_penalty != 1:
            seen = torch.unique(torch.cat([output, torch.as_tensor(list(prompt_ids), dtype=torch.int64)]))
            x = logits[:, seen]
            logits[:, seen] = torch.where(x > 0, x / params.repetition_penalty, x * params.repetition_penalty)
        if params.frequency_penalty != 0 or params.presence_penalty != 0:
            ids, counts = torch.unique(output, return_counts=True)
            x = logits[:, ids] - params.frequency_penalty * counts.double()
            logits[:, ids] = x - params.presence_penalty
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
        int64 (B,) token ids on the CPU: the first id (in vocabulary order) whose cumulative probability
        exceeds the row's draw times the total, i.e. inverse-CDF sampling of sampling_probs' distribution.
    """
    logits = adjust_logits(logits, params, prompt_ids, output_ids)
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    draws = torch.rand(logits.shape[0], generator=generator, dtype=torch.float64).tolist()
    tokens = []
    for row, u in zip(logits.double(), draws):
        ids, probs = kept_distribution(row, params)
        cdf = probs.cumsum(dim=0)  # in id order: the vocabulary's cdf at the kept ids (the others add 0)
        at = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))
        tokens.append(int(ids[min(at, len(ids) - 1)]))
    return torch.tensor(tokens, dtype=torch.int64)


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sample() draws from, for temperature > 0: float64 (B, V) on the CPU from
    logits (B, V) (adjust_logits' already): logits / temperature, then min-p, then top-k, then top-p, then softmax
    (kept_distribution's, zero outside the kept tokens)."""
    logits = logits.double().cpu()
    probs = torch.zeros_like(logits)
    for row, out in zip(logits, probs):
        ids, kept = kept_distribution(row, params)
        out[ids] = kept
    return probs


def kept_distribution(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens one row's sampling can pick and their probabilities: (ids, probs), int64 ids in ascending order
    and float64 probs summing to 1, from logits (V,) (adjust_logits' row) for temperature > 0.

    (logits - max) / temperature, then min-p (tokens whose probability is below min_p times the top one dropped),
    then top-k (0: every token; ties with the k-th kept), then top-p (the most likely tokens, ties in id order,
    while the mass before each is below top_p; the most likely always kept), then softmax over what is left. Top-p
    looks only at the tokens that can be in the nucleus: the most likely 256, then 1,024, ... until their mass
    reaches top_p. With chat's settings a token of Gemma 3's 262,144 logits cost 53 ms of CPU when top-p sorted
    every logit, 9 ms this way (SmolLM2's 49,152: 6.9 -> 1.7; Intel Xeon under load, benchmarks/engine/sampling_cost.py,
    raw docs/data/sampling/).

    Example::

        >>> import torch, treeattn as ta
        >>> from treeattn.engine.worker.sampling import kept_distribution
        >>> ids, probs = kept_distribution(torch.tensor([0.0, 3.0, 2.0, -9.0]), ta.SamplingParams(temperature=1.0, top_p=0.9))
        >>> ids.tolist(), [round(p, 4) for p in probs.tolist()]
        ([1, 2], [0.7311, 0.2689])
    """
    z = (logits.double().cpu() - logits.max()) / params.temperature  # <= 0; the maxima stay 0
    if params.min_p > 0:  # p < min_p * p_max, i.e. exp(z) < min_p (the maxima are 0): vLLM's rule, in float64
        probs = torch.softmax(z, dim=0)
        z = z.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if 0 < params.top_k < z.shape[0]:
        kth = torch.topk(z, params.top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    ids = _nucleus(z, params.top_p) if params.top_p < 1 else torch.nonzero(z > float("-inf")).squeeze(1)
    return ids, torch.softmax(z[ids], dim=0)


def _nucleus(z: torch.Tensor, top_p: float) -> torch.Tensor:
    """The ids (ascending) top-p keeps of z (V,) (-inf: already dropped): in the order of z descending, ties by id
    (a stable sort), each token whose mass before it is below top_p. Sorts the most likely 256 tokens, then 1,024,
    ... (every token tied with the last of them too), until their mass reaches top_p; all of z past V / 8."""
    total = torch.exp(z).sum()  # the softmax's denominator (the maximum's term is 1, a dropped token's 0)
    k = min(256, z.shape[0])
    while True:
        if k > z.shape[0] // 8:
            near = torch.arange(z.shape[0])
        else:  # every token at least the k-th largest: the ties at the edge included, so this is a prefix of the order
            near = torch.nonzero(z >= torch.topk(z, k).values[-1]).squeeze(1)
        order = near[torch.sort(z[near], descending=True, stable=True).indices]
        probs = torch.exp(z[order]) / total
        before = probs.cumsum(dim=0) - probs
        if len(near) == z.shape[0] or float(before[-1] + probs[-1]) >= top_p:
            keep = (before < top_p) & (z[order] > float("-inf"))
            keep[0] = True  # the most likely token is always kept
            return torch.sort(order[keep]).values
        k *= 4


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
