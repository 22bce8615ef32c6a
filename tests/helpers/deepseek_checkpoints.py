"""Tiny random-weight DeepSeek-V2/V3 checkpoints written by transformers, and their uncached greedy tokens (the oracle).

    make_checkpoint("v3", directory)         # also "v3-flat", "v2", "v2-greedy"
    uncached_greedy(hf, PROMPT)
"""

from __future__ import annotations

import torch

from conftest import skip_unless_installed  # noqa: E402

skip_unless_installed("transformers")  # imported where used: the ranks that import this module need none of it

VOCAB = 96
NEW_TOKENS = 10
PROMPT = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(3)).tolist()
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
              num_attention_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
              n_routed_experts=8, num_experts_per_tok=3, first_k_dense_replace=1, max_position_embeddings=64)


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 0.7}


ARCHS = {
    "v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
           dict(q_lora_rank=24, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, rope_parameters=YARN)),
    "v3-flat": ("DeepseekV3Config", "DeepseekV3ForCausalLM",  # no q compression, rotate-half RoPE, unnormalized weights
                dict(q_lora_rank=None, n_shared_experts=2, n_group=2, topk_group=1, norm_topk_prob=False, rope_interleave=False)),
    "v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
           dict(q_lora_rank=None, n_shared_experts=2, n_group=4, topk_group=2, topk_method="group_limited_greedy",
                routed_scaling_factor=1.5, rope_parameters=YARN)),
    "v2-greedy": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(q_lora_rank=20, n_shared_experts=1, topk_method="greedy")),
}


def make_checkpoint(arch: str, directory, seed: int = 0):
    """A random transformers DeepSeek model of `arch` saved to `directory`; returns it. Weights at
    std 0.2 (the default 0.02 gives near-uniform logits whose argmax rounding could flip), router
    correction biases nonzero."""
    import transformers

    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    hf = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**COMMON, **extra)).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if not name.endswith("norm.weight"):
                param.normal_(0.0, 0.2)
        for module in hf.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0.0, 0.1)
    hf.save_pretrained(directory)
    return hf


def uncached_greedy(hf, prompt, new_tokens=NEW_TOKENS) -> list[int]:
    """transformers' greedy tokens recomputed with a full forward pass per new token (no cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = hf(torch.tensor([ids]), use_cache=False).logits[0, -1]
            top2 = logits.topk(2).values
            assert top2[0] - top2[1] > 1e-4, "near-tie in the oracle: choose another seed"
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]
