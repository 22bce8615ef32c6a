"""The engine tests' tiny Llamas and requests (speculative decoding, draft models, static steps).

Two tiny random Llamas over a 32-token vocabulary: a plain one, and a "looping" one whose attention
output is scaled down (o_proj x 0.05), so that its greedy continuations cycle for a while (prompt
lookup's drafts are then often accepted). REQUESTS: 10 (prompt, max_new_tokens); PLENTY / TIGHT:
engine options with plenty of cache or little; _greedy_alone: each request alone, greedy (ta.generate).
"""

from __future__ import annotations

import torch

import treeattn as ta
from treeattn.engine import SamplingParams
from treeattn.models.llama import LlamaConfig, random_model

VOCAB = 32
CONFIG = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, max_position_embeddings=4096)


BLOCK = 4


def _model(looping: bool = False):
    model = random_model(CONFIG, seed=3, std=0.15)
    if looping:
        with torch.no_grad():
            for layer in model.layers:
                layer.self_attn.o_proj.weight.mul_(0.05)
    return model


def _requests():
    """10 (prompt, max_new_tokens): even ones repeat a short phrase three times (prompt lookup finds
    matches at once), odd ones are random; four share a 12-token prefix (3 blocks)."""
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, VOCAB, (12,), generator=g).tolist()
    out = []
    for i in range(10):
        if i % 2 == 0:
            phrase = torch.randint(0, VOCAB, (3 + i // 2,), generator=g).tolist()
            prompt = phrase * 3
        else:
            prompt = torch.randint(0, VOCAB, (1 + (7 * i) % 19,), generator=g).tolist()
        if i % 3 == 0:
            prompt = shared + prompt
        out.append((prompt, 6 + (5 * i) % 19))
    return out


REQUESTS = _requests()
PLENTY = dict(cache_tokens=1024, block_size=BLOCK, prefill_chunk=16, max_batch_size=8)
# 2-3 requests at once; contiguous: sequences span ranks
TIGHT = dict(cache_tokens=96, block_size=BLOCK, prefill_chunk=16, max_batch_size=8)


def _greedy_alone(model) -> list[list[int]]:
    """Each request alone, greedy, without speculation (ta.generate: its own cache and decode loop),
    after checking the oracle's premise: no near-tie along the way that rounding could flip."""
    out = []
    for prompt, n in REQUESTS:
        tokens = ta.generate(model, prompt, max_new_tokens=n).generated_ids[0]
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():  # uncached: one forward over the whole sequence
            hidden = model(ids, torch.arange(ids.shape[1])[None], *_uncached(ids.shape[1]))
            top2 = model.logits(hidden[0, len(prompt) - 1 : -1]).topk(2).values
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-4
        assert top2.shape[0] == len(tokens)
        out.append(tokens)
    return out


def _uncached(length):
    from treeattn.models.attention import LocalAttention

    def store(layer, k, v):
        return k, v, torch.arange(length)[None]

    return store, LocalAttention()


SAMPLED = [SamplingParams(max_new_tokens=16, temperature=0.9, top_k=20, seed=11),
           SamplingParams(max_new_tokens=12, temperature=1.2, top_p=0.9, seed=12)]
