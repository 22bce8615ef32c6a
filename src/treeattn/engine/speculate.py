"""Speculative decoding: propose tokens cheaply, verify them with one forward pass of the target.

The engine drafts on its driver (the scheduler appends each decoding sequence's drafts to its chunk)
and verifies on rank 0 in the same batched forward pass (treeattn.engine.worker.runner.RankRunner._sample);
this module holds the prompt-lookup drafter (a draft model drafts on every rank: treeattn.engine.worker.draft):

    drafter = NgramDrafter(max_ngram=3)
    draft = drafter.propose(context, k)                 # int64 (d,), d <= k: prompt lookup

Prompt lookup (n-gram drafting; Saxena 2023, as in vLLM's "ngram" and transformers'
prompt_lookup_num_tokens): find an earlier occurrence of the context's last n tokens (the longest n
that matches, from max_ngram down to min_ngram; the most recent occurrence with k tokens after it)
and propose the k tokens that followed it. It needs no draft model; it wins where the output copies spans of the context, as
answers about a long document do.

Acceptance (Leviathan et al. 2023, Chen et al. 2023), for the engine's deterministic drafters (prompt
lookup, a draft model's argmax: q one-hot at the draft x): x is kept with probability p(x) under the
target's sampling distribution p, else the token is drawn from p without x. RankRunner._sample
realizes exactly this by sampling each position as decoding would and keeping drafts while they
equal the sampled token, so speculation gives the tokens decoding without it gives, seed by seed
(greedy: accept while the draft equals the argmax, then emit the argmax).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SPECULATE_KINDS = ("ngram", "draft")
"""Speculative decoding the engine runs: "ngram", prompt lookup (NgramDrafter), and "draft", a draft
model on every rank (treeattn.engine.worker.draft)."""

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


class DraftSlots:
    """The driver's drafter for speculate="draft": it reserves the slots of k drafts per decoding
    sequence (placeholder tokens 0); the ranks' DraftRunner writes the drafted tokens into them."""

    def propose(self, context: torch.Tensor, k: int) -> torch.Tensor:
        """int64 (k,) placeholders (context: int64 (L,), unused: the draft model reads its cache)."""
        return torch.zeros(k, dtype=torch.int64)
