"""The random-weight model and prompt of the synthetic demo, shared by `treeattn demo --synthetic` (treeattn.eval.synthetic)
and `treeattn bench profile`: a Llama-shaped config (DEMO_CONFIG, LlamaConfig's keywords) and random token ids.

    model = random_model(LlamaConfig(**DEMO_CONFIG), seed=0)     # treeattn.models.llama
    prompt = synthetic_prompt(4096, DEMO_CONFIG["vocab_size"], seed=0)
"""

from __future__ import annotations

import torch

# Small enough that a 32K-token prefill takes seconds on two CPU cores, shaped like a Llama (GQA).
DEMO_CONFIG = dict(
    vocab_size=4096,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rope_theta=500000.0,
    max_position_embeddings=1 << 20,
)


def synthetic_prompt(context: int, vocab_size: int, seed: int) -> list[int]:
    """`context` token ids drawn uniformly (reproducibly) from the vocabulary."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (context,), generator=generator).tolist()
