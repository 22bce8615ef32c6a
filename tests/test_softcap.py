"""Logit soft-capping (Gemma 2): every score s = scale * q.k becomes c * tanh(s / c).

The merge of (out, lse) states holds for any score function, so capping is applied where scores
are formed and everything downstream is unchanged. Checked against the float64 reference on every
single-device path (unmasked, masked chunks, causal prefill, one-thread decode), the graph-safe
path, and across ranks: tree_decode (allreduce, tree), ring_decode (both rings) and ring_attention
with a sliding window, on real gloo groups.
"""

from __future__ import annotations

import pytest
import torch

import treeattn as ta
from treeattn.ops import reference_attention
from treeattn.ops.graph_safe import graph_safe_attention

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float64: 1e-12}


def make_qkv(B=2, Sq=1, Sk=300, Hq=4, Hkv=2, D=16, dtype=torch.float32, seed=0, logit_scale=3.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, Sq, Hq, D, generator=g) * logit_scale).to(dtype)
    k = (torch.randn(B, Sk, Hkv, D, generator=g) * logit_scale).to(dtype)
    v = torch.randn(B, Sk, Hkv, D, generator=g).to(dtype)
    return q, k, v


def assert_state(out, lse, ref_out, ref_lse, dtype):
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), ref_out, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("Sq,causal,window", [(1, False, None), (5, True, None), (5, True, 7), (40, True, None)])
def test_attention_softcap_matches_reference(dtype, Sq, causal, window):
    q, k, v = make_qkv(Sq=Sq, dtype=dtype, seed=Sq)
    Sk = k.shape[1]
    kwargs = dict(causal=causal, window=window, softcap=2.5)
    if causal:
        kwargs.update(q_pos=torch.arange(Sk - Sq, Sk), kv_pos=torch.arange(Sk))
    out, lse = ta.attention(q, k, v, **kwargs)
    ref_out, ref_lse = reference_attention(q, k, v, **kwargs)
    assert_state(out, lse, ref_out, ref_lse, dtype)
    uncapped, _ = reference_attention(q, k, v, **{**kwargs, "softcap": None})
    assert (uncapped - ref_out).abs().max() > 0.1, "the capping must change the result on these logits"


def test_softcap_on_the_one_thread_decode_path():
    q, k, v = make_qkv(Sq=2, Hq=8, Hkv=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out, lse = ta.attention(q, k, v, softcap=1.5)
    finally:
        torch.set_num_threads(threads)
    assert_state(out, lse, *reference_attention(q, k, v, softcap=1.5), torch.float32)


def test_graph_safe_attention_takes_softcap():
    q, k, v = make_qkv(Sq=1)
    q_pos, kv_pos = torch.tensor([250]), torch.arange(300)
    out, lse = graph_safe_attention(q, k, v, q_pos=q_pos, kv_pos=kv_pos, softcap=4.0)
    ref = reference_attention(q, k, v, causal=True, q_pos=q_pos, kv_pos=kv_pos, softcap=4.0)
    assert_state(out, lse, *ref, torch.float32)


def test_huge_scores_are_capped_not_overflowed():
    q, k, v = make_qkv(Sq=1, logit_scale=1e3)
    out, lse = ta.attention(q, k, v, softcap=30.0)
    assert torch.isfinite(out).all() and (lse.abs() <= 30.0 + torch.log(torch.tensor(300.0)) + 1e-3).all()
    assert_state(out, lse, *reference_attention(q, k, v, softcap=30.0), torch.float32)


@pytest.mark.parametrize("bad,exc", [(0.0, ValueError), (-1.0, ValueError), (float("inf"), ValueError), ("50", TypeError),
                                     (True, TypeError)])
def test_bad_softcap_is_rejected(bad, exc):
    q, k, v = make_qkv(Sq=1, Sk=4)
    with pytest.raises(exc, match="softcap"):
        ta.attention(q, k, v, softcap=bad)


# ------------------------------------------------------------------------ across ranks


def _sharded_softcap_cases(rank: int, p: int) -> dict:
    """Every distributed method with a softcap (and ring_attention with a window) on this rank's
    contiguous shard; each case's max error against the float64 reference."""
    errors = {}
    q, k, v = make_qkv(B=2, Sq=1, Sk=7 * p + 2, seed=11)
    N = k.shape[1]
    bounds = [round(N * r / p) for r in range(p + 1)]
    mine = torch.arange(bounds[rank], bounds[rank + 1])
    k_local, v_local = k[:, mine], v[:, mine]
    ref_out, ref_lse = reference_attention(q, k, v, softcap=3.0)
    for name, call in {
        "tree_decode/allreduce": lambda: ta.tree_decode(q, k_local, v_local, softcap=3.0, method="allreduce"),
        "tree_decode/onepass": lambda: ta.tree_decode(q, k_local, v_local, softcap=3.0),
        "tree_decode/tree": lambda: ta.tree_decode(q, k_local, v_local, softcap=3.0, method="tree"),
        "ring_decode/kv": lambda: ta.ring_decode(q, k_local, v_local, softcap=3.0),
        "ring_decode/q": lambda: ta.ring_decode(q, k_local, v_local, softcap=3.0, pass_kv=False),
    }.items():
        out, lse = call()
        errors[name] = max((out.double() - ref_out).abs().max().item(), (lse.double() - ref_lse).abs().max().item())
    # prefill: this rank's query chunk against every rank's keys, causal with a window of 5
    q_all, _, _ = make_qkv(B=2, Sq=N, Sk=1, seed=12)
    positions = torch.arange(N)
    ref_out, ref_lse = reference_attention(q_all, k, v, causal=True, q_pos=positions, kv_pos=positions, window=5, softcap=3.0)
    out, lse = ta.ring_attention(q_all[:, mine], k_local, v_local, q_pos=mine, kv_pos=mine, window=5, softcap=3.0)
    errors["ring_attention/window"] = max(
        (out.double() - ref_out[:, mine]).abs().max().item(), (lse.double() - ref_lse[:, :, mine]).abs().max().item()
    )
    # ranks that disagree on the softcap all raise the same error instead of hanging
    try:
        ta.tree_decode(q, k_local, v_local, softcap=3.0 if rank else 2.0)
        errors["disagreement"] = "no error"
    except ValueError as exc:
        errors["disagreement"] = "softcap" in str(exc)
    return errors


@pytest.mark.parametrize("p", [1, 3])
def test_distributed_methods_take_softcap(p):
    for rank, errors in enumerate(ta.spawn(_sharded_softcap_cases, p)):
        disagreement = errors.pop("disagreement")
        assert disagreement is True or p == 1, f"rank {rank}: disagreeing softcaps gave {disagreement!r}"
        for name, error in errors.items():
            assert error < 1e-5, f"rank {rank} {name}: max error {error}"
