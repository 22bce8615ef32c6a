"""Speculative decoding: propose tokens cheaply, verify them with one forward pass of the target.

Two pieces, both pure functions of host tensors (the decode loop in treeattn.generate runs the
verification forward pass over the sharded cache and rolls the cache back):

    drafter = NgramDrafter(max_ngram=3)
    draft = drafter.propose(context, k)                 # int64 (d,), d <= k: prompt lookup
    accepted, next_token = accept(probs, draft, u, r)   # the rule of speculative sampling (q: one-hot)
    accepted, next_token = accept(probs, draft, u, r, proposal=q)   # a draft model's q

Prompt lookup (n-gram drafting; Saxena 2023, as in vLLM's "ngram" and transformers'
prompt_lookup_num_tokens): find an earlier occurrence of the context's last n tokens (the longest n
that matches, from max_ngram down to min_ngram; the most recent occurrence with k tokens after it)
and propose the k tokens that followed it. It needs no draft model; it wins where the output copies spans of the context, as
answers about a long document do.

Acceptance (Leviathan et al. 2023, Chen et al. 2023): the drafter proposed x from its distribution q
(a draft model's, after the same temperature/top-k/top-p; prompt lookup is deterministic: q one-hot at
x). x is accepted with probability min(1, p(x) / q(x)) under the target's sampling distribution p; on
the first rejection the token is drawn from the residual max(0, p - q), normalized (for a one-hot q:
p with x removed). If every draft is accepted, a bonus token is drawn from the target's distribution
after the last one. The tokens produced are then distributed exactly as tokens drawn one by one from
p. Greedy decoding (p one-hot at the argmax, and a greedy drafter: q one-hot) makes this exact
matching: accept while the draft equals the argmax, then emit the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SPECULATE_KINDS = ("ngram", "draft")  # "draft": a draft model (treeattn.draft_model)

MAX_DRAFT_TOKENS = 16


@dataclass(frozen=True)
class NgramDrafter:
    """Prompt-lookup drafting.

    Attributes:
        max_ngram: longest suffix of the context looked up.
        min_ngram: shortest suffix looked up (1: a single repeated token is enough to propose).
    """

    max_ngram: int = 3
    min_ngram: int = 1

    def propose(self, context: torch.Tensor, k: int) -> torch.Tensor:
        """Up to k tokens that followed an earlier occurrence of the context's longest matching
        suffix: the most recent occurrence followed by k tokens, else the earliest (the longest
        continuation; a match near the end, in a repetitive tail, is followed by few tokens).

        Args:
            context: int64 (L,) token ids on the CPU: the prompt and every token generated so far.
            k: the most tokens to propose, >= 0.

        Returns:
            int64 (d,) with 0 <= d <= k (empty when no suffix of min_ngram tokens recurs).
        """
        length = context.numel()
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            suffix = context[length - n:]
            windows = context[: length - 1].unfold(0, n, 1)  # every n-gram that ends before the last token
            starts = (windows == suffix).all(dim=1).nonzero().flatten() + n  # where each match's continuation starts
            if starts.numel():
                full = starts[starts + k <= length]
                start = int(full[-1]) if full.numel() else int(starts[0])
                return context[start: start + k].clone()
        return context[:0].clone()


def accept(probs: torch.Tensor, draft: torch.Tensor, uniforms: torch.Tensor, residual_draw: float,
           proposal: torch.Tensor | None = None) -> tuple[int, int]:
    """The speculative-sampling rule for one sequence.

    Args:
        probs: float64 (d + 1, V): the target's sampling distribution (after temperature, top-k,
            top-p) at each drafted position and after the last one; one-hot rows for greedy.
        draft: int64 (d,) drafted tokens; draft[i] is proposed where probs[i] predicts.
        uniforms: float64 (d,) draws in [0, 1): draft[i] is accepted iff
            uniforms[i] < probs[i, draft[i]] / proposal[i, draft[i]].
        residual_draw: one draw in [0, 1) for the token after the accepted drafts (the residual
            distribution on a rejection, probs[d] when all are accepted).
        proposal: float64 (d, V): the distribution q each draft was drawn from; None for a
            deterministic drafter (q one-hot at the draft: prompt lookup, a greedy draft model).

    Returns:
        (accepted, next_token): the number of leading drafts accepted, and the token that follows them.
    """
    d = draft.numel()

    def q(i: int) -> torch.Tensor:  # float64 (V,): the proposal of draft i
        if proposal is not None:
            return proposal[i]
        return torch.zeros_like(probs[i]).index_fill_(0, draft[i: i + 1], 1.0)

    accepted = 0
    while accepted < d:
        x = int(draft[accepted])
        # u < min(1, p(x) / q(x)), written without the division (q(x) = 0 accepts: p/q is infinite)
        if not float(uniforms[accepted]) * float(q(accepted)[x]) < float(probs[accepted, x]):
            break
        accepted += 1
    p = probs[accepted]
    if accepted < d:
        residual = (p - q(accepted)).clamp(min=0.0)  # max(0, p - q)
        if float(residual.sum()) > 0:  # p == q rejects with probability 0; rounding may still get here
            p = residual
    return accepted, draw(p, residual_draw)


def draw(weights: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from non-negative float64 (V,) weights (not necessarily normalized), u in [0, 1)."""
    cdf = weights.cumsum(dim=0)
    index = torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype), right=True)
    return int(index.clamp(max=weights.numel() - 1))
