"""treeattn.linear on one device: linear_attention against the float64 naive reference.

Tolerances: every feature map here is >= 0, so the denominator is a sum of non-negative terms and
the numerator's error is bounded by the same sum times max|v|; in float32 both carry a relative
error of at most ~(S + F) * eps32 (sequential sums; a chunk's matmuls add F terms), and the output
is a convex combination of v rows. So |out - ref| <= c * (S + F) * eps32 * max|v|, plus the final
rounding to q.dtype (eps of that dtype times max|out|).
"""

from __future__ import annotations

import pytest
import torch

import treeattn as ta
from treeattn.linear import HedgehogFeatureMap, LinearAttentionState, linear_attention, reference_linear_attention

EPS = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -10, torch.float64: 2.0 ** -52}


def tolerance(dtype: torch.dtype, S: int, F: int, v: torch.Tensor) -> float:
    vmax = max(v.abs().max().item(), 1e-30) if v.numel() else 1.0
    acc_eps = EPS[torch.float64] if dtype == torch.float64 else EPS[torch.float32]
    return 4 * (S + F) * acc_eps * vmax + 2 * EPS[dtype] * vmax


def make(B, S, Hq, Hkv, D, Dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, Hq, D, generator=g).to(dtype)
    k = torch.randn(B, S, Hkv, D, generator=g).to(dtype)
    v = torch.randn(B, S, Hkv, Dv, generator=g).to(dtype)
    return q, k, v


def feature_maps(Hkv, D):
    hedgehog = HedgehogFeatureMap(Hkv, D, feature_dim=6)
    with torch.no_grad():  # not the identity start: a map with real weights and bias
        hedgehog.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
        hedgehog.bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
    pair = (HedgehogFeatureMap(Hkv, D, feature_dim=3), HedgehogFeatureMap(Hkv, D, feature_dim=3))
    with torch.no_grad():  # separate query and key maps (LoLCATs), different weights
        pair[1].weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(3))
    return {"elu": "elu", "relu": "relu", "hedgehog": hedgehog, "hedgehog-pair": pair}


@pytest.mark.parametrize("dtype, heads", [
    (torch.float32, (4, 2)), (torch.float32, (3, 1)), (torch.float32, (2, 2)),
    (torch.bfloat16, (4, 2)), (torch.float16, (3, 1)), (torch.float64, (4, 2)),
], ids=["f32-gqa", "f32-mqa", "f32-mha", "bf16-gqa", "f16-mqa", "f64-gqa"])
def test_matches_float64_reference(dtype, heads):
    Hq, Hkv = heads
    D, Dv = 8, 5
    for name, fm in feature_maps(Hkv, D).items():
        for causal in (True, False):
            for B, S, chunk in ((2, 37, 8), (1, 5, 64), (1, 16, 1), (3, 1, 4)):
                q, k, v = make(B, S, Hq, Hkv, D, Dv, dtype, seed=S)
                out = linear_attention(q, k, v, feature_map=fm, causal=causal, chunk=chunk)
                ref = reference_linear_attention(q, k, v, feature_map=fm, causal=causal)
                assert out.shape == (B, S, Hq, Dv) and out.dtype == dtype
                err = (out.double() - ref).abs().max().item()
                assert err <= tolerance(dtype, S, 2 * D, v), (name, causal, B, S, chunk, err)


def test_state_continues_prefill_into_decode():
    """Prefill returns the state; one-token steps from it give the full causal outputs, and the
    returned state is the state of every key (the same as one call over the whole sequence)."""
    q, k, v = make(2, 20, 4, 2, 8, 8, torch.float32)
    fm = feature_maps(2, 8)["hedgehog"]
    full, full_state = linear_attention(q, k, v, feature_map=fm, return_state=True)
    out, state = linear_attention(q[:, :13], k[:, :13], v[:, :13], feature_map=fm, return_state=True, chunk=4)
    steps = [out]
    for t in range(13, 20):
        step, state = linear_attention(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], feature_map=fm,
                                       initial_state=state, return_state=True)
        steps.append(step)
    ref = reference_linear_attention(q, k, v, feature_map=fm)
    tol = tolerance(torch.float32, 20, 16, v)
    assert (torch.cat(steps, dim=1).double() - ref).abs().max().item() <= tol
    assert (full.double() - ref).abs().max().item() <= tol
    assert isinstance(state, LinearAttentionState) and state.kv.shape == (2, 2, 12, 8) and state.kv.dtype == torch.float32
    assert torch.allclose(state.kv, full_state.kv, atol=1e-4) and torch.allclose(state.k_sum, full_state.k_sum, atol=1e-4)
    # the state is O(1) in the sequence: the same size after 13 and after 20 tokens
    assert state.nbytes == LinearAttentionState.zeros(2, 2, 12, 8).nbytes


def test_initial_state_against_reference_non_causal():
    q, k, v = make(1, 9, 2, 1, 4, 3, torch.float64)
    q0, k0, v0 = make(1, 6, 2, 1, 4, 3, torch.float64, seed=7)
    _, state = linear_attention(q0, k0, v0, return_state=True)
    out = linear_attention(q, k, v, causal=False, initial_state=state)
    ref = reference_linear_attention(q, k, v, causal=False, initial_state=state)
    assert (out - ref).abs().max().item() < 1e-12


def test_rows_that_see_nothing_are_zero_not_nan():
    q, k, v = make(1, 6, 2, 2, 4, 4, torch.float32)
    q = -q.abs() - 0.1  # relu(q) == 0: every denominator is 0
    out = linear_attention(q, k, v, feature_map="relu")
    assert torch.equal(out, torch.zeros_like(out))
    empty = linear_attention(*make(2, 0, 2, 1, 4, 3, torch.bfloat16), causal=True)
    assert empty.shape == (2, 0, 2, 3) and empty.dtype == torch.bfloat16
    nobatch, state = linear_attention(*make(0, 3, 2, 1, 4, 3, torch.float32), return_state=True)
    assert nobatch.shape == (0, 3, 2, 3) and state.kv.shape == (0, 1, 4, 3)


def test_hedgehog_map_shapes_grouping_and_training():
    fm = HedgehogFeatureMap(2, 8, feature_dim=5)
    x = torch.randn(3, 4, 6, 8)  # 6 heads: groups of 3 share a map
    phi = fm(x)
    assert phi.shape == (3, 4, 6, 10) and phi.dtype == torch.float32
    assert torch.allclose(phi.sum(-1), torch.ones(3, 4, 6)) and (phi > 0).all()
    # query head 4 uses map 1: the same as feeding that head to the 2-head map as KV head 1
    alone = fm(torch.stack([x[:, :, 0], x[:, :, 4]], dim=2))
    assert torch.allclose(phi[:, :, 4], alone[:, :, 1]) and torch.allclose(phi[:, :, 0], alone[:, :, 0])
    # the weights get gradients through linear_attention (the attention-transfer training needs it)
    q, k, v = make(1, 10, 6, 2, 8, 4, torch.float32)
    linear_attention(q, k, v, feature_map=fm, chunk=3).square().sum().backward()
    assert fm.weight.grad is not None and fm.weight.grad.abs().sum() > 0 and fm.bias.grad.abs().sum() > 0


def test_exported_at_top_level():
    assert ta.linear_attention is linear_attention


@pytest.mark.parametrize("call, match", [
    (lambda q, k, v: linear_attention(q[0], k, v), r"^q must have 4 dims"),
    (lambda q, k, v: linear_attention(q, k[:, :, :1].expand(-1, -1, 3, -1), v), r"Hkv"),
    (lambda q, k, v: linear_attention(q, k[:, :3], v[:, :3]), r"^q and k must have the same sequence length"),
    (lambda q, k, v: linear_attention(q, k, v, feature_map="softmax"), r"^feature_map must be one of"),
    (lambda q, k, v: linear_attention(q, k, v, feature_map=3), r"^feature_map must be one of"),
    (lambda q, k, v: linear_attention(q, k, v, feature_map=HedgehogFeatureMap(2, 5)), r"head_dim=5"),
    (lambda q, k, v: linear_attention(q, k, v, feature_map=HedgehogFeatureMap(3, 4)), r"multiple of num_heads=3"),
    (lambda q, k, v: linear_attention(q, k, v, causal=1), r"^causal must be a bool"),
    (lambda q, k, v: linear_attention(q, k, v, chunk=0), r"^chunk must be a positive int"),
    (lambda q, k, v: linear_attention(q, k, v, method="ring"), r"^method must be one of"),
    (lambda q, k, v: linear_attention(q, k, v, initial_state=LinearAttentionState.zeros(1, 2, 4, 5)),
     r"^initial_state.kv must have shape"),
    (lambda q, k, v: linear_attention(q, k, v, initial_state=torch.zeros(3)), r"^initial_state must be a LinearAttentionState"),
    (lambda q, k, v: linear_attention(q, k.double(), v), r"share one dtype"),
    (lambda q, k, v: linear_attention(q.int(), k, v), r"^q must be float"),
])
def test_bad_input_one_line_naming_the_argument(call, match):
    q, k, v = make(1, 5, 4, 2, 4, 3, torch.float32)
    with pytest.raises((ValueError, TypeError), match=match) as info:
        call(q, k, v)
    assert "\n" not in str(info.value)
