"""The prefill tests' tiny Llama and requests (split and ring prefill steps), and its uncached greedy tokens."""

from __future__ import annotations

import torch

from treeattn.models.attention import LocalAttention
from treeattn.models.llama import LlamaConfig, random_model

CONFIG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, max_position_embeddings=4096)


SPLIT_MIN = 2  # tokens per rank: steps of >= 2p tokens split in these tests
OPTIONS = dict(block_size=4, cache_tokens=1024, prefill_chunk=16, max_batch_size=8, timeout_s=60)


def _model():
    return random_model(CONFIG, seed=3, std=0.15)


def _requests() -> list[tuple[list[int], int]]:
    """12 (prompt, max_new_tokens): the even ones share a 31-token prefix; lengths 3 to 44."""
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(0, 128, (31,), generator=g).tolist()
    out = []
    for i in range(12):
        n = 2 + (5 * i) % 12
        prompt = shared + torch.randint(0, 128, (n,),
                                        generator=g).tolist() if i % 2 == 0 else torch.randint(0, 128, (n + 1,),
                                                                                               generator=g).tolist()
        out.append((prompt, 2 + i % 5))
    return out


REQUESTS = _requests()


def _uncached_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens recomputed with a full forward pass over all tokens per new token (no cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            length = len(ids)
            logits = model.logits(model(torch.tensor([ids]), torch.arange(length)[None],
                                        lambda layer, k, v: (k, v, torch.arange(length)[None]), LocalAttention())[0, -1])
            top2 = logits.topk(2).values
            assert top2[0] - top2[1] > 1e-4, "near-tie in the oracle: choose another seed"
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]
