"""Speculative decoding tests' prompt and oracles: a prompt with a repeated pattern (prompt lookup
finds drafts), transformers' uncached greedy tokens, and the exact distribution of sampled
continuations with a chi-square test against it.
"""

from __future__ import annotations

import torch

from helpers.llama_checkpoints import VOCAB
from treeattn.cache import ShardedKVCache
from treeattn.engine.request import SamplingParams
from treeattn.engine.sampling import sampling_probs
from treeattn.models.attention import attention_backend
from treeattn.models.llama import LlamaConfig

NEW_TOKENS = 24
_G = torch.Generator().manual_seed(30)
_PATTERN = torch.randint(0, VOCAB, (5,), generator=_G).tolist()
PROMPT = _PATTERN + torch.randint(0, VOCAB, (4,), generator=_G).tolist() + _PATTERN + _PATTERN[:2]


def _uncached_greedy(hf, prompt, new_tokens):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


SAMPLING_VOCAB = 5
SAMPLING_CONFIG = LlamaConfig(vocab_size=SAMPLING_VOCAB, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                              num_kv_heads=1, head_dim=8)


SAMPLING_PROMPT = [0, 1, 2, 0, 1, 2, 0, 1]
SAMPLING = dict(temperature=1.0, top_k=4)


def exact_distribution(model, prompt: list[int], sampling: dict) -> dict[tuple[int, int, int], float]:
    """The exact probability of each 3-token continuation of `prompt` under `sampling`, from one
    uncached forward pass per prefix."""

    def dist_after(ids):
        cache = ShardedKVCache(num_layers=model.config.num_layers, num_kv_heads=model.config.num_kv_heads,
                               head_dim=model.config.head_dim, capacity=len(ids))
        positions = torch.arange(len(ids))
        with torch.no_grad():
            hidden = model(torch.tensor([ids]), positions[None], cache.update(cache.extend(positions)), attention_backend("local"))
            return sampling_probs(model.logits(hidden[:, -1]), SamplingParams(**sampling))[0]

    vocab = model.config.vocab_size
    exact = {}
    first = dist_after(prompt)
    for a in range(vocab):
        second = dist_after(prompt + [a])
        for b in range(vocab):
            third = dist_after(prompt + [a, b])
            for c in range(vocab):
                exact[(a, b, c)] = float(first[a] * second[b] * third[c])
    return exact


def chi_square_pvalue(counts: dict, exact: dict, n: int) -> float:
    """Chi-square p-value of n observed continuations `counts` against `exact`: cells with expected
    count >= 5 on their own, the rest pooled into one cell."""
    big = [k for k, p in exact.items() if p * n >= 5]
    observed = [counts.get(k, 0) for k in big] + [n - sum(counts.get(k, 0) for k in big)]
    expected = [exact[k] * n for k in big] + [n * (1 - sum(exact[k] for k in big))]
    from scipy import stats

    return stats.chisquare(observed, expected).pvalue
