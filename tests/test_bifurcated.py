"""ta.bifurcated_attention against float64 attention over each sample's [context, decoded] K/V."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import treeattn as ta

bifurcated_module = importlib.import_module("treeattn.ops.bifurcated")

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float64: 1e-12}
HEADS = {"MHA": (8, 8), "GQA": (8, 2), "MQA": (8, 1)}


def make_inputs(n=3, Sq=1, Hq=8, Hkv=2, D=16, Mc=37, Md=5, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    return randn(n, Sq, Hq, D), randn(1, Mc, Hkv, D), randn(1, Mc, Hkv, D), randn(n, Md, Hkv, D), randn(n, Md, Hkv, D)


def concatenated(context_k, context_v, decode_k, decode_v):
    """The plain batch: each sample's own copy of the context followed by its decoded K/V."""
    n = decode_k.shape[0]
    keys = torch.cat([context_k.expand(n, -1, -1, -1), decode_k], dim=1)
    values = torch.cat([context_v.expand(n, -1, -1, -1), decode_v], dim=1)
    return keys, values


def assert_state_close(out, lse, ref_out, ref_lse, dtype):
    tol = TOL[dtype]
    assert out.dtype == dtype and out.shape == ref_out.shape
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) and lse.shape == ref_lse.shape
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=max(tol, 1e-6), atol=max(tol, 1e-5))
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol * max(1.0, ref_out.abs().max().item()))


# ---------------------------------------------------------------- exactness


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("n", [1, 2, 17])
def test_matches_plain_attention_over_concatenated_kv(n, heads, dtype):
    Hq, Hkv = HEADS[heads]
    for Md in (0, 1, 100):
        q, ck, cv, dk, dv = make_inputs(n=n, Hq=Hq, Hkv=Hkv, Md=Md, dtype=dtype, seed=Md)
        ref = ta.reference_attention(q, *concatenated(ck, cv, dk, dv), causal=True)
        for mode in ("bifurcated", "batched", "auto"):
            out, lse = ta.bifurcated_attention(q, ck, cv, dk, dv, mode=mode)
            assert_state_close(out, lse, *ref, dtype)


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("Md", [0, 1, 100])
def test_speculative_queries_are_causal_within_the_decoded_part(heads, Md):
    # Sq = 4 query tokens are the last 4 keys of each sample; for Md < 3 some of them sit inside
    # the context and must not see all of it.
    Hq, Hkv = HEADS[heads]
    q, ck, cv, dk, dv = make_inputs(n=5, Sq=4, Hq=Hq, Hkv=Hkv, Md=Md, seed=7)
    ref = ta.reference_attention(q, *concatenated(ck, cv, dk, dv), causal=True)
    for mode in ("bifurcated", "batched"):
        assert_state_close(*ta.bifurcated_attention(q, ck, cv, dk, dv, mode=mode), *ref, torch.float32)
        Mc = ck.shape[1]
        q_pos = torch.arange(4) + Mc + Md - 4  # the same layout, spelled out with positions
        assert_state_close(*ta.bifurcated_attention(q, ck, cv, dk, dv, q_pos=q_pos, mode=mode), *ref, torch.float32)


def test_per_sample_positions_hide_padding_of_ragged_samples():
    # Three samples decoded 6, 2 and 0 tokens; padded to Md = 6. Padding positions lie beyond every
    # query, so each sample must equal attention over its own unpadded [context, decoded].
    Mc, Md, Sq, lengths = 11, 6, 2, [6, 2, 0]
    q, ck, cv, dk, dv = make_inputs(n=3, Sq=Sq, Mc=Mc, Md=Md, seed=3)
    pad = torch.iinfo(torch.int64).max
    decode_pos = torch.tensor([[Mc + j if j < m else pad for j in range(Md)] for m in lengths])
    # the queries are each sample's last Sq tokens (for the sample with 0 decoded tokens: the
    # context's last Sq positions, i.e. it re-reads the context like a prefill tail)
    q_pos = torch.stack([torch.arange(Sq) + Mc + m - Sq for m in lengths])
    for mode in ("bifurcated", "batched"):
        out, lse = ta.bifurcated_attention(q, ck, cv, dk, dv, q_pos=q_pos, decode_pos=decode_pos, mode=mode)
        for b, m in enumerate(lengths):
            keys, values = concatenated(ck, cv, dk[b : b + 1, :m], dv[b : b + 1, :m])
            ref = ta.reference_attention(q[b : b + 1], keys, values, causal=True)
            assert_state_close(out[b : b + 1], lse[b : b + 1], *ref, torch.float32)


def test_explicit_context_positions_and_rows_that_see_nothing():
    # Context at positions 100..109, decoded at 200..202; query 0 at position 50 sees no key.
    q, ck, cv, dk, dv = make_inputs(n=2, Sq=3, Mc=10, Md=3, seed=5)
    context_pos = torch.arange(10) + 100
    decode_pos = torch.arange(3) + 200
    q_pos = torch.tensor([[50, 105, 201], [201, 202, 300]])
    keys, values = concatenated(ck, cv, dk, dv)
    kv_pos = torch.cat([context_pos, decode_pos])
    ref = ta.reference_attention(q, keys, values, causal=True, q_pos=q_pos, kv_pos=kv_pos.expand(2, -1))
    assert torch.isneginf(ref[1][0, :, 0]).all()
    for mode in ("bifurcated", "batched"):
        out, lse = ta.bifurcated_attention(q, ck, cv, dk, dv, q_pos=q_pos, context_pos=context_pos, decode_pos=decode_pos,
                                           mode=mode)
        assert_state_close(out, lse, *ref, torch.float32)
        assert (out[0, 0] == 0).all()


def test_empty_context_and_empty_decode_give_the_identity_state():
    q, ck, cv, dk, dv = make_inputs(n=2, Mc=0, Md=0)
    for mode in ("bifurcated", "batched"):
        out, lse = ta.bifurcated_attention(q, ck, cv, dk, dv, mode=mode)
        assert (out == 0).all() and torch.isneginf(lse).all()
    q, ck, cv, dk, dv = make_inputs(n=2, Mc=0, Md=4)
    ref = ta.reference_attention(q, dk, dv)
    assert_state_close(*ta.bifurcated_attention(q, ck, cv, dk, dv, mode="bifurcated"), *ref, torch.float32)


@pytest.mark.parametrize("logit_scale", [1e-4, 30.0])
def test_huge_and_tiny_logits(logit_scale):
    q, ck, cv, dk, dv = make_inputs(n=4, Md=9, seed=11)
    q = q * logit_scale
    ref = ta.reference_attention(q, *concatenated(ck, cv, dk, dv), causal=True)
    assert_state_close(*ta.bifurcated_attention(q, ck, cv, dk, dv, mode="bifurcated"), *ref, torch.float32)


def test_float64_and_value_dim_and_scale():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, 2, 4, 8, generator=g, dtype=torch.float64)
    ck, cv = torch.randn(1, 9, 2, 8, generator=g, dtype=torch.float64), torch.randn(1, 9, 2, 12, generator=g, dtype=torch.float64)
    dk, dv = torch.randn(3, 4, 2, 8, generator=g, dtype=torch.float64), torch.randn(3, 4, 2, 12, generator=g, dtype=torch.float64)
    ref = ta.reference_attention(q, *concatenated(ck, cv, dk, dv), causal=True, scale=0.3)
    assert_state_close(*ta.bifurcated_attention(q, ck, cv, dk, dv, scale=0.3, mode="bifurcated"), *ref, torch.float64)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 6),
    Sq=st.integers(1, 4),
    Mc=st.integers(0, 40),
    Md=st.integers(0, 12),
    group=st.sampled_from([1, 2, 4]),
    Hkv=st.integers(1, 2),
    seed=st.integers(0, 2**16),
)
def test_bifurcated_equals_batched_on_random_shapes(n, Sq, Mc, Md, group, Hkv, seed):
    q, ck, cv, dk, dv = make_inputs(n=n, Sq=Sq, Hq=group * Hkv, Hkv=Hkv, D=8, Mc=Mc, Md=Md, seed=seed)
    ref = ta.reference_attention(q, *concatenated(ck, cv, dk, dv), causal=True)
    assert_state_close(*ta.bifurcated_attention(q, ck, cv, dk, dv, mode="bifurcated"), *ref, torch.float32)
    assert_state_close(*ta.bifurcated_attention(q, ck, cv, dk, dv, mode="batched"), *ref, torch.float32)


# ---------------------------------------------------------------- the context is read once


def test_context_is_attended_once_for_all_samples(monkeypatch):
    """The context K/V goes into exactly one attention call, unexpanded, with the n samples folded
    into that call's query rows; the plain batch instead hands attention n copies."""
    calls = []
    real_attention = bifurcated_module.attention

    def recording_attention(q, k, v, **kwargs):
        calls.append((tuple(q.shape), k))
        return real_attention(q, k, v, **kwargs)

    monkeypatch.setattr(bifurcated_module, "attention", recording_attention)
    n, Sq = 17, 2
    q, ck, cv, dk, dv = make_inputs(n=n, Sq=Sq, Md=3)
    ta.bifurcated_attention(q, ck, cv, dk, dv, mode="bifurcated")
    context_calls = [(q_shape, k) for q_shape, k in calls if k.shape[1] == ck.shape[1]]
    assert len(context_calls) == 1
    q_shape, k = context_calls[0]
    assert q_shape == (1, n * Sq, 8, 16) and k.shape == ck.shape and k.data_ptr() == ck.data_ptr()

    calls.clear()
    ta.bifurcated_attention(q, ck, cv, dk, dv, mode="batched")
    assert len(calls) == 1 and calls[0][1].shape == (n, ck.shape[1] + 3, 2, 16)


# ---------------------------------------------------------------- the auto switch


def test_auto_switch_follows_the_measured_threshold(monkeypatch):
    threshold = bifurcated_module.AUTO_BATCHED_MAX_CONTEXT_ELEMENTS
    assert threshold > 0, "the switch threshold must be measured and filled in"
    # the rule is a threshold on the context elements a plain batch reads per step
    D, Hkv = 16, 2
    small_n, small_Mc = 1, 1
    assert small_n * small_Mc * Hkv * D <= threshold
    assert not bifurcated_module.use_bifurcated(small_n, small_Mc, Hkv, D)
    big_Mc = threshold // (Hkv * D) + 1
    assert bifurcated_module.use_bifurcated(1, big_Mc, Hkv, D)
    assert bifurcated_module.use_bifurcated(4, big_Mc // 4 + 1, Hkv, D)
    # and "auto" dispatches to the mode the rule names
    seen = []
    for name in ("_bifurcated", "_batched"):
        real = getattr(bifurcated_module, name)
        monkeypatch.setattr(bifurcated_module, name, lambda *a, _n=name, _f=real: seen.append(_n) or _f(*a))
    q, ck, cv, dk, dv = make_inputs(n=1, Hkv=Hkv, D=D, Mc=small_Mc, Md=2)
    ta.bifurcated_attention(q, ck, cv, dk, dv)
    q, ck, cv, dk, dv = make_inputs(n=1, Hkv=Hkv, D=D, Mc=big_Mc, Md=2)
    ta.bifurcated_attention(q, ck, cv, dk, dv)
    assert seen == ["_batched", "_bifurcated"]


# ---------------------------------------------------------------- bad input


def _bad(**changes):
    q, ck, cv, dk, dv = make_inputs(n=3, Md=4)
    args = {"q": q, "context_k": ck, "context_v": cv, "decode_k": dk, "decode_v": dv}
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "changes, exc, pattern",
    [
        ({"q": torch.randn(0, 1, 8, 16)}, ValueError, r"q must hold at least one sample.*n >= 1.*\(0, 1, 8, 16\)"),
        ({"decode_k": torch.randn(0, 4, 2, 16), "decode_v": torch.randn(0, 4, 2, 16), "q": torch.randn(0, 1, 8, 16)}, ValueError,
         "n >= 1"),
        ({"decode_k": torch.randn(3, 4, 4, 16), "decode_v": torch.randn(3, 4, 4, 16)}, ValueError,
         r"decode_k must have the KV head count of context_k \(Hkv = 2\), got Hkv = 4"),
        ({"context_v": torch.randn(1, 37, 1, 16)}, ValueError, r"context_v must have the KV head count of context_k"),
        ({"decode_k": torch.randn(3, 4, 2, 16, dtype=torch.bfloat16)}, TypeError,
         r"decode_k must have the dtype of q \(torch.float32\), got torch.bfloat16"),
        ({"context_k": torch.randn(1, 37, 2, 16, dtype=torch.float64)}, TypeError, r"context_k must have the dtype of q"),
        ({"decode_v": torch.randn(3, 5, 2, 16)}, ValueError,
         r"decode_k and decode_v must have one decoded length, got Md = 4 and 5"),
        ({"context_v": torch.randn(1, 36, 2, 16)}, ValueError, r"context_k and context_v must have one length"),
        ({"decode_k": [torch.randn(4, 2, 16), torch.randn(6, 2, 16), torch.randn(1, 2, 16)]}, TypeError,
         r"decode_k must be one tensor \(n, Md, Hkv, D\).*\(4, 2, 16\), \(6, 2, 16\).*q_pos and decode_pos"),
        ({"context_k": torch.randn(3, 37, 2, 16), "context_v": torch.randn(3, 37, 2, 16)}, ValueError,
         r"context_k must have batch 1"),
        ({"decode_k": torch.randn(2, 4, 2, 16), "decode_v": torch.randn(2, 4, 2, 16)}, ValueError,
         r"decode_k must have one row per sample, n = 3"),
        ({"q": torch.randn(3, 1, 7, 16)}, ValueError, r"Hq must be a multiple of Hkv"),
        ({"decode_k": torch.randn(3, 4, 2, 8)}, ValueError, r"decode_k must have the head dim of q \(D = 16\)"),
        ({"decode_v": torch.randn(3, 4, 2, 8)}, ValueError, r"decode_v must have the value head dim of context_v"),
        ({"context_k": torch.randn(37, 2, 16)}, ValueError, r"context_k must have 4 dims \(1, Mc, Hkv, D\)"),
        ({"q": torch.ones(3, 1, 8, 16, dtype=torch.int64)}, TypeError, r"q must be float32"),
    ],
)
def test_bad_input_names_the_argument(changes, exc, pattern):
    with pytest.raises(exc, match=pattern):
        ta.bifurcated_attention(**_bad(**changes))


def test_bad_positions_and_mode():
    args = _bad()
    with pytest.raises(ValueError, match="decode_pos was given without q_pos"):
        ta.bifurcated_attention(**args, decode_pos=torch.arange(4))
    with pytest.raises(ValueError, match="context_pos was given without q_pos"):
        ta.bifurcated_attention(**args, context_pos=torch.arange(37))
    with pytest.raises(ValueError, match=r"decode_pos must have shape \(4,\) or \(3, 4\)"):
        ta.bifurcated_attention(**args, q_pos=torch.tensor([100]), decode_pos=torch.arange(5))
    with pytest.raises(ValueError, match=r"context_pos must have shape \(37,\) or \(1, 37\)"):
        ta.bifurcated_attention(**args, q_pos=torch.tensor([100]), context_pos=torch.arange(37).expand(3, -1))
    with pytest.raises(TypeError, match="q_pos must hold integer positions"):
        ta.bifurcated_attention(**args, q_pos=torch.tensor([1.0]))
    with pytest.raises(ValueError, match="mode must be one of"):
        ta.bifurcated_attention(**args, mode="fast")
