"""ta.attention, ta.merge_states and the energy view against a float64 naive reference."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import treeattn as ta

attention_module = importlib.import_module("treeattn.ops.attention")  # the module, not the function

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-12}


def make_qkv(B=2, Sq=1, Sk=33, Hq=8, Hkv=2, D=16, Dv=None, dtype=torch.float32, seed=0, logit_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    Dv = D if Dv is None else Dv
    q = (torch.randn(B, Sq, Hq, D, generator=g) * logit_scale).to(dtype)
    k = torch.randn(B, Sk, Hkv, D, generator=g).to(dtype)
    v = torch.randn(B, Sk, Hkv, Dv, generator=g).to(dtype)
    return q, k, v


def assert_state_close(out, lse, ref_out, ref_lse, dtype):
    tol = TOL[dtype]
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    # lse is float32 for every input dtype; compare with a relative bound on its magnitude
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=max(tol, 1e-6), atol=max(tol, 1e-5))
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol * max(1.0, ref_out.abs().max().item()))


# ---------------------------------------------------------------- attention vs the reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("Hq,Hkv", [(8, 8), (8, 2), (8, 1)])
@pytest.mark.parametrize("Sq", [1, 5])
def test_attention_matches_reference(dtype, Hq, Hkv, Sq):
    q, k, v = make_qkv(Sq=Sq, Hq=Hq, Hkv=Hkv, dtype=dtype)
    out, lse = ta.attention(q, k, v)
    assert out.dtype == dtype and out.shape == (2, Sq, Hq, 16)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) and lse.shape == (2, Hq, Sq)
    assert_state_close(out, lse, *ta.reference_attention(q, k, v), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_value_dim_differs_from_key_dim(dtype):
    q, k, v = make_qkv(D=16, Dv=24, Sq=3, dtype=dtype)
    for causal in (False, True):
        assert_state_close(*ta.attention(q, k, v, causal=causal), *ta.reference_attention(q, k, v, causal=causal), dtype)


@pytest.mark.parametrize("Hq,Hkv,Sq", [(8, 8, 1), (8, 2, 3), (8, 1, 2)])
def test_single_thread_decode_path(one_thread, Hq, Hkv, Sq):
    assert attention_module._prefer_matmul(Hq // Hkv * Sq)
    q, k, v = make_qkv(Sq=Sq, Sk=3000, Hq=Hq, Hkv=Hkv, logit_scale=3.0)
    for kwargs in ({}, {"causal": True}, {"causal": True, "window": 700}):
        assert_state_close(*ta.attention(q, k, v, **kwargs), *ta.reference_attention(q, k, v, **kwargs), torch.float32)
    empty_q_pos = torch.tensor([-5] * Sq)
    out, lse = ta.attention(q, k, v, causal=True, q_pos=empty_q_pos)
    assert torch.isneginf(lse).all() and (out == 0).all()


def test_gqa_equals_mha_with_repeated_heads():
    q, k, v = make_qkv(Hq=12, Hkv=3, Sq=4, Sk=70)
    out, lse = ta.attention(q, k, v, causal=True)
    out_mha, lse_mha = ta.attention(q, k.repeat_interleave(4, dim=2), v.repeat_interleave(4, dim=2), causal=True)
    # other matmul shapes, so other summation orders: equal up to float32 rounding (torch's defaults)
    torch.testing.assert_close(out, out_mha)
    torch.testing.assert_close(lse, lse_mha)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 1, 5, 1000])
def test_causal_and_window_with_positions(dtype, window):
    B, Sq, Sk = 2, 4, 50
    q, k, v = make_qkv(B=B, Sq=Sq, Sk=Sk, dtype=dtype, seed=3)
    g = torch.Generator().manual_seed(1)
    kv_pos = torch.stack([torch.randperm(Sk, generator=g) for _ in range(B)])  # any order, per batch row
    q_pos = torch.tensor([[10, 20, 30, 49], [0, 3, 48, 49]])
    out, lse = ta.attention(q, k, v, causal=True, q_pos=q_pos, kv_pos=kv_pos, window=window)
    ref = ta.reference_attention(q, k, v, causal=True, q_pos=q_pos, kv_pos=kv_pos, window=window)
    assert_state_close(out, lse, *ref, dtype)


def test_sliding_window_blocks_read_only_the_keys_they_see(monkeypatch):
    """A prefill chunk under a window: each block of queries reads only the span of keys it sees (fewer
    keys than its chunk: the ones before the window and after the block are left out), and the span
    may still hold masked keys (shuffled positions); the same state as the float64 reference."""
    monkeypatch.setattr(attention_module, "MASKED_CHUNK_KEYS", 16)
    monkeypatch.setattr(attention_module, "MAX_SCORE_ELEMENTS", 16 * 2 * 8)  # 8 queries a block (group 2)
    q, k, v = make_qkv(Sq=30, Sk=50, Hq=4, Hkv=2, seed=5)
    q_pos, kv_pos = torch.arange(30) + 20, torch.arange(50)
    shuffled = torch.cat((kv_pos[:25], kv_pos[25:].flip(0)))
    seen = []  # keys of each block call, whichever kernel takes it
    for name in ("_flash_block", "_matmul_attention"):
        kernel = getattr(attention_module, name)
        monkeypatch.setattr(attention_module, name, lambda q_rows, k_heads, *a, kernel=kernel: seen.append(k_heads.shape[2])
                            or kernel(q_rows, k_heads, *a))
    for kv in (kv_pos, shuffled):
        out, lse = ta.attention(q, k, v, causal=True, q_pos=q_pos, kv_pos=kv, window=6)
        assert_state_close(out, lse, *ta.reference_attention(q, k, v, causal=True, q_pos=q_pos, kv_pos=kv, window=6),
                           torch.float32)
        if kv is kv_pos:  # 8 queries and a window of 6 see at most 13 keys of a chunk of 16
            assert seen and max(seen) <= 13


@pytest.mark.parametrize("q_start,kv_start", [(0, 0), (40, 0), (45, 5), (3, 10)])
@pytest.mark.parametrize("Sq", [1, 7, 30])
def test_causal_over_contiguous_positions(monkeypatch, q_start, kv_start, Sq):
    """Contiguous positions take the mask-free block path; (3, 10) has queries before the keys."""
    monkeypatch.setattr(attention_module, "CAUSAL_QUERY_BLOCK", 8)
    q, k, v = make_qkv(Sq=Sq, Sk=37, Hq=6, Hkv=2)
    q_pos, kv_pos = torch.arange(Sq) + q_start, torch.arange(37) + kv_start
    out, lse = ta.attention(q, k, v, causal=True, q_pos=q_pos, kv_pos=kv_pos)
    ref = ta.reference_attention(q, k, v, causal=True, q_pos=q_pos, kv_pos=kv_pos)
    assert_state_close(out, lse, *ref, torch.float32)


def test_causal_without_positions_is_bottom_right_aligned():
    q, k, v = make_qkv(Sq=3, Sk=10)
    out, lse = ta.attention(q, k, v, causal=True)
    ref = ta.reference_attention(q, k, v, causal=True, q_pos=torch.tensor([7, 8, 9]), kv_pos=torch.arange(10))
    assert_state_close(out, lse, *ref, torch.float32)
    # the last query sees every key, the first sees 8 of them
    full = ta.attention(q[:, 2:], k, v)
    torch.testing.assert_close(out[:, 2:], full[0])


def test_rows_that_see_no_key_are_zero_and_minus_inf():
    q, k, v = make_qkv(Sq=3, Sk=20)
    q_pos = torch.tensor([0, 5, 100])
    kv_pos = torch.arange(20) + 10  # nothing at or before position 5
    for dtype in (torch.float32, torch.bfloat16):
        out, lse = ta.attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=True, q_pos=q_pos, kv_pos=kv_pos)
        assert torch.isneginf(lse[:, :, :2]).all() and torch.isfinite(lse[:, :, 2]).all()
        assert (out[:, :2] == 0).all() and not torch.isnan(out).any()


def test_empty_kv_is_the_identity_state():
    q, k, v = make_qkv(Sk=0)
    out, lse = ta.attention(q, k, v)
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("logit_scale", [1e4 / 4, 1e-6])
def test_huge_and_tiny_logits(logit_scale):
    q, k, v = make_qkv(Sq=2, Sk=64, logit_scale=logit_scale)
    out, lse = ta.attention(q, k, v)
    ref_out, ref_lse = ta.reference_attention(q, k, v)
    assert ref_lse.abs().max() > 1e3 if logit_scale > 1 else ref_lse.abs().max() < 10
    assert_state_close(out, lse, ref_out, ref_lse, torch.float32)


def test_chunked_paths_agree_with_reference(monkeypatch):
    """Force many key chunks and query blocks through both the fused and the matmul paths."""
    monkeypatch.setattr(attention_module, "MASKED_CHUNK_KEYS", 7)
    monkeypatch.setattr(attention_module, "MAX_SCORE_ELEMENTS", 64)
    monkeypatch.setattr(attention_module, "CAUSAL_QUERY_BLOCK", 4)
    q, k, v = make_qkv(Sq=9, Sk=61, Hq=4, Hkv=2)
    for Dv in (16, 24):  # 24: the matmul path
        vv = torch.randn(2, 61, 2, Dv)
        for kwargs in ({}, {"causal": True}, {"causal": True, "window": 9}):
            assert_state_close(*ta.attention(q, k, vv, **kwargs), *ta.reference_attention(q, k, vv, **kwargs), torch.float32)


# ---------------------------------------------------------------- merge algebra (property tests)


def split_points(draw, n_keys, n_segments):
    cuts = sorted(draw(st.lists(st.integers(0, n_keys), min_size=n_segments - 1, max_size=n_segments - 1)))
    return [0, *cuts, n_keys]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_split_merged_in_any_order_equals_whole(data):
    Sk = data.draw(st.integers(0, 40), label="Sk")
    n_segments = data.draw(st.integers(1, 6), label="segments")
    Hkv = data.draw(st.sampled_from([1, 2, 4]), label="Hkv")
    Sq = data.draw(st.sampled_from([1, 3]), label="Sq")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    q, k, v = make_qkv(B=2, Sq=Sq, Sk=Sk, Hq=4, Hkv=Hkv, D=8, seed=seed)
    bounds = split_points(data.draw, Sk, n_segments)
    states = [ta.attention(q, k[:, a:b], v[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    order = data.draw(st.permutations(range(len(states))), label="order")
    states = [states[i] for i in order]
    ref_out, ref_lse = ta.reference_attention(q, k, v)

    # all at once
    assert_state_close(*ta.merge_states_list([s[0] for s in states], [s[1] for s in states]), ref_out, ref_lse, torch.float32)
    # a random binary grouping of pairwise merges
    pool = list(states)
    while len(pool) > 1:
        i = data.draw(st.integers(0, len(pool) - 2), label="pair")
        a, b = pool[i], pool[i + 1]
        pool[i : i + 2] = [ta.merge_states(a[0], a[1], b[0], b[1])]
    assert_state_close(*pool[0], ref_out, ref_lse, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_merge_low_precision_states(dtype):
    q, k, v = make_qkv(Sq=2, Sk=90, dtype=dtype)
    states = [ta.attention(q, k[:, a : a + 30], v[:, a : a + 30]) for a in (0, 30, 60)]
    out, lse = ta.merge_states_list([s[0] for s in states], [s[1] for s in states])
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_state_close(out, lse, *ta.reference_attention(q, k, v), dtype)


def test_merge_identity_and_all_empty():
    q, k, v = make_qkv()
    out, lse = ta.attention(q, k, v)
    empty_out, empty_lse = torch.zeros_like(out), torch.full_like(lse, -math.inf)
    merged = ta.merge_states(out, lse, empty_out, empty_lse)
    torch.testing.assert_close(merged[0], out, rtol=0, atol=0)
    torch.testing.assert_close(merged[1], lse, rtol=0, atol=0)
    both_empty = ta.merge_states(empty_out, empty_lse, empty_out, empty_lse)
    assert (both_empty[0] == 0).all() and torch.isneginf(both_empty[1]).all()


def test_merge_rejects_mismatched_states():
    out, lse = torch.zeros(1, 2, 4, 8), torch.zeros(1, 4, 2)
    with pytest.raises(ValueError, match=r"lse must have shape"):
        ta.merge_states(out, lse, out, torch.zeros(1, 2, 4))
    with pytest.raises(TypeError, match="lse must be float32"):
        ta.merge_states(out, lse, out, lse.half())
    with pytest.raises(ValueError, match="differs"):
        ta.merge_states(out, lse, torch.zeros(1, 2, 4, 9), lse)
    with pytest.raises(ValueError, match="non-empty"):
        ta.merge_states_list([], [])


# ---------------------------------------------------------------- the energy view


@pytest.mark.parametrize("Hkv", [1, 2, 8])
def test_attention_is_the_gradient_of_the_energy(Hkv):
    q, k, v = make_qkv(Sq=3, Hkv=Hkv, Dv=12, dtype=torch.float64)
    out_energy = ta.attention_via_energy(q, k, v)
    out, lse = ta.attention(q, k, v)
    torch.testing.assert_close(out_energy, out, rtol=1e-10, atol=1e-10)
    zeta = torch.zeros(2, 3, 8, 12, dtype=torch.float64)
    torch.testing.assert_close(ta.energy(q, k, v, zeta), lse)


def test_energy_is_associative_over_segments():
    """F over the union of two segments is logaddexp of F over each: the reason the tree works."""
    q, k, v = make_qkv(Sk=40, dtype=torch.float64)
    zeta = torch.randn(2, 1, 8, 16, dtype=torch.float64) * 0.1
    whole = ta.energy(q, k, v, zeta)
    parts = torch.logaddexp(ta.energy(q, k[:, :13], v[:, :13], zeta), ta.energy(q, k[:, 13:], v[:, 13:], zeta))
    torch.testing.assert_close(whole, parts)


def test_energy_fp32_matches():
    q, k, v = make_qkv(Sq=2)
    torch.testing.assert_close(ta.attention_via_energy(q, k, v), ta.attention(q, k, v)[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="zeta must have shape"):
        ta.energy(q, k, v, torch.zeros(2, 2, 8, 15))


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "make, exc, pattern",
    [
        (lambda: (torch.zeros(1, 8, 16), torch.zeros(1, 4, 2, 16), torch.zeros(1, 4, 2, 16)), ValueError, r"q must have 4 dims"),
        (lambda: (torch.zeros(2, 1, 8, 16), torch.zeros(1, 4, 2, 16), torch.zeros(1, 4, 2, 16)), ValueError,
         r"batch size mismatch"),
        (lambda: (torch.zeros(1, 1, 8, 16), torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 16)), ValueError,
         r"head dim mismatch.*D=16.*D=8"),
        (lambda: (torch.zeros(1, 1, 8, 16), torch.zeros(1, 4, 3, 16), torch.zeros(1, 4, 3, 16)), ValueError,
         r"multiple of Hkv.*Hq=8.*Hkv=3"),
        (lambda: (torch.zeros(1, 1, 8, 16), torch.zeros(1, 4, 2, 16), torch.zeros(1, 5, 2, 16)), ValueError,
         r"sequence length mismatch"),
        (lambda: (torch.zeros(1, 1, 8, 16), torch.zeros(1, 4, 2, 16), torch.zeros(1, 4, 4, 16)), ValueError,
         r"kv head count mismatch"),
        (lambda: (torch.zeros(1, 1, 8, 16), torch.zeros(1, 4, 2, 16).half(), torch.zeros(1, 4, 2, 16)), TypeError, r"one dtype"),
        (lambda: (torch.zeros(1, 1, 8, 16, dtype=torch.int32),) * 3, TypeError, r"q must be float"),
    ],
)
def test_bad_shapes_and_dtypes(make, exc, pattern):
    with pytest.raises(exc, match=pattern):
        ta.attention(*make())


# Zero heads or a zero head dim: one ValueError naming the count, from every single-device entry
# point (before the check, Hq = 0 crashed the process in the fused bf16 kernel: SIGFPE).
ZERO_SIZES = {
    "Hq=0": ((1, 1, 0, 16), (1, 4, 2, 16), (1, 4, 2, 16), r"head counts must be positive, got Hq=0"),
    "Hkv=0": ((1, 1, 2, 16), (1, 4, 0, 16), (1, 4, 0, 16), r"head counts must be positive, got Hq=2 .* Hkv=0"),
    "D=0": ((1, 1, 2, 0), (1, 4, 2, 0), (1, 4, 2, 16), r"head dims must be positive, got D=0"),
    "Dv=0": ((1, 1, 2, 16), (1, 4, 2, 16), (1, 4, 2, 0), r"head dims must be positive, got D=16, Dv=0"),
}
ENTRY_POINTS = {
    "attention": lambda q, k, v: ta.attention(q, k, v),
    "attention causal": lambda q, k, v: ta.attention(q, k, v, causal=True),
    "graph_safe_attention": lambda q, k, v: ta.ops.graph_safe_attention(q, k, v),
    "attention_via_energy": lambda q, k, v: ta.attention_via_energy(q, k, v),
    "reference_attention": lambda q, k, v: ta.reference_attention(q, k, v),
    "bifurcated_attention": lambda q, k, v: ta.bifurcated_attention(q, k, v, k, v),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("case", list(ZERO_SIZES))
def test_zero_heads_or_head_dim_are_refused(case, entry, dtype):
    *shapes, pattern = ZERO_SIZES[case]
    q, k, v = (torch.zeros(shape, dtype=dtype) for shape in shapes)
    with pytest.raises(ValueError, match=pattern) as raised:
        ENTRY_POINTS[entry](q, k, v)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("B,Sq,Sk", [(0, 1, 5), (0, 100, 100), (2, 0, 5), (2, 0, 0), (2, 1, 0), (2, 100, 0)])
def test_empty_batch_queries_or_keys_give_empty_or_identity_states(B, Sq, Sk, dtype):
    """B = 0, Sq = 0 (a rank with no query) and Sk = 0 (an empty shard) are valid: the state has
    the right shapes, and rows that see no key are out = 0, lse = -inf."""
    q, k, v = make_qkv(B=B, Sq=Sq, Sk=Sk, dtype=dtype)
    calls = [lambda: ta.attention(q, k, v), lambda: ta.attention(q, k, v, causal=True),
             lambda: ta.attention(q, k, v, causal=True, window=3), lambda: ta.ops.graph_safe_attention(q, k, v)]
    for call in calls:
        out, lse = call()
        assert out.shape == (B, Sq, 8, 16) and out.dtype == dtype and lse.shape == (B, 8, Sq)
        if Sk == 0:
            assert (out == 0).all() and torch.isneginf(lse).all()


def test_window_needs_causal():
    """window=W is a causal sliding window; without causal=True it would hide only the keys far
    behind the query and leave every later key visible, so it is refused (one line, naming W)."""
    q, k, v = make_qkv(Sq=2, Sk=5)
    for fn in (ta.attention, ta.reference_attention):
        with pytest.raises(ValueError, match=r"^window=3 needs causal=True: it is a causal sliding window") as raised:
            fn(q, k, v, window=3)
        assert "\n" not in str(raised.value)
    out, lse = ta.attention(q, k, v, causal=True, window=3)  # with causal it is taken
    assert_state_close(out, lse, *ta.reference_attention(q, k, v, causal=True, window=3), torch.float32)


def test_bad_positions_and_options():
    q, k, v = make_qkv(Sq=2, Sk=5)
    with pytest.raises(TypeError, match="q_pos must hold integer"):
        ta.attention(q, k, v, causal=True, q_pos=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"kv_pos must have shape \(5,\) or \(2, 5\), got \(4,\)"):
        ta.attention(q, k, v, causal=True, kv_pos=torch.arange(4))
    with pytest.raises(ValueError, match="pass causal=True"):
        ta.attention(q, k, v, q_pos=torch.arange(2))
    with pytest.raises(ValueError, match="window must be a positive int"):
        ta.attention(q, k, v, causal=True, window=0)
    with pytest.raises(ValueError, match="scale must be finite"):
        ta.attention(q, k, v, scale=float("nan"))


# ---------------------------------------------------------------- bounded memory


def test_peak_memory_is_bounded_for_two_million_keys():
    """A 1 x 1 x 8 x 128 query against 2M keys (one KV head): extra memory far below the K/V size.

    Measured with the allocator's peak RSS delta in a child process, so the figure is the process's
    real footprint, not an estimate.
    """
    import subprocess
    import sys

    code = r"""
import resource, torch, treeattn as ta
torch.manual_seed(0)
Sk = 2 * 1024 * 1024
q = torch.randn(1, 1, 8, 128)
k = torch.randn(1, 4096, 1, 128).repeat(1, Sk // 4096, 1, 1)  # MQA: 1 GiB per tensor
v = torch.randn(1, 4096, 1, 128).repeat(1, Sk // 4096, 1, 1)
for kwargs in ({}, {"causal": True}):  # warm up kernels and thread pools
    ta.attention(q, k[:, :9000], v[:, :9000], **kwargs)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out, lse = ta.attention(q, k, v)
for kwargs in ({"causal": True}, {"causal": True, "window": 4096}):
    ta.attention(q, k, v, **kwargs)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    extra_bytes = int(result.stdout.strip().splitlines()[-1])
    kv_bytes = 2 * 2 * 1024 * 1024 * 128 * 4  # K and V: 2 GiB
    assert extra_bytes < 64 * 1024 * 1024, f"attention over 2M keys grew the peak RSS by {extra_bytes / 2**20:.1f} MiB"
    assert extra_bytes < kv_bytes / 32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("offset", [0, 300])
def test_gpu_causal_prefill_uses_the_fused_flash_kernel(offset, monkeypatch):
    calls = []
    real = attention_module._cuda_flash
    monkeypatch.setattr(attention_module, "_cuda_flash", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    g = torch.Generator().manual_seed(0)
    Sq, Sk = 700, 700 + offset
    q = torch.randn(2, Sq, 8, 64, generator=g)
    k = torch.randn(2, Sk, 2, 64, generator=g)
    v = torch.randn(2, Sk, 2, 64, generator=g)
    out, lse = ta.attention(q.cuda().bfloat16(), k.cuda().bfloat16(), v.cuda().bfloat16(), causal=True)
    ref_out, ref_lse = ta.reference_attention(q.bfloat16().double(), k.bfloat16().double(), v.bfloat16().double(), causal=True)
    assert calls, "the fused CUDA flash kernel was not used"
    rel = (out.double().cpu() - ref_out).norm() / ref_out.norm()
    assert rel < 1e-2
    torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=2e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_sized_cpu_calls_run_the_compiled_kernel_and_match_float64(dtype, monkeypatch):
    """ops.attention sends decode-sized CPU calls (<= cpu_decode.MAX_QUERIES queries) to the
    compiled kernel, over any layout of K/V (a transposed view is made contiguous, never read
    wrongly); float64, a softcap, more queries or a query position below 0 keep the matmul path."""
    pytest.importorskip("numba")
    from treeattn.ops import cpu_decode

    calls = []
    real = cpu_decode.attend_blocks
    monkeypatch.setattr(cpu_decode, "attend_blocks", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 16, generator=g).to(dtype)
    k = torch.randn(2, 2, 300, 16, generator=g).to(dtype).transpose(1, 2)  # (B, Sk, Hkv, D), not contiguous
    v = torch.randn(2, 300, 2, 8, generator=g).to(dtype)
    kv_pos = torch.randperm(300, generator=g)
    cases = [dict(), dict(causal=True), dict(causal=True, q_pos=torch.tensor([[299, 10, 150, 0], [3, 4, 5, 6]]), kv_pos=kv_pos,
                                             window=40)]
    for kw in cases:
        out, lse = ta.attention(q, k, v, **kw)
        out64, lse64 = ta.attention(q.double(), k.double(), v.double(), **kw)
        tol = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16: the output's own rounding
        assert (out.double() - out64).abs().max() < tol
        assert torch.equal(lse.isinf(), lse64.isinf()) and (lse.double() - lse64).nan_to_num(0, 0, 0).abs().max() < 1e-5
    assert len(calls) == len(cases)
    for kw in (dict(softcap=30.0), dict(causal=True, q_pos=torch.tensor([-1, 0, 1, 2]))):
        ta.attention(q, k, v, **kw)
    ta.attention(q.double(), k.double(), v.double())
    ta.attention(torch.randn(1, cpu_decode.MAX_QUERIES + 1, 6, 16).to(dtype), k[:1], v[:1])
    out, _ = ta.attention(q.detach().requires_grad_(), k, v)  # autograd records it: the differentiable path
    out.float().sum().backward()
    assert len(calls) == len(cases)


def test_non_finite_inputs_never_become_a_finite_output_on_the_cpu_kernel():
    """A NaN (or inf) in the query or in keys makes the kernel's scores NaN: the row's output and
    lse are NaN, never the zeros of a row that saw no key (the engine then names the layer)."""
    pytest.importorskip("numba")
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 1, 4, 8, generator=g), torch.randn(1, 40, 2, 8, generator=g), torch.randn(1, 40, 2, 8, generator=g)
    nan_key = k.clone()
    nan_key[0, 3] = float("nan")
    for qq, kk, vv in ((q * float("nan"), k, v), (q, k * float("nan"), v), (q, nan_key, v), (q * float("inf"), k, v),
                       (q, k, v * float("nan"))):
        out, _ = ta.attention(qq, kk, vv)
        assert out.isnan().all()


def test_optional_kernels_load_or_fall_back(monkeypatch, caplog):
    """ops.kernels: each optional kernel imports (numba is a dependency here), an unknown name is
    refused in one line, and a missing dependency gives None (the callers' torch path), logged."""
    import logging
    import sys

    from treeattn.ops.kernels import optional_kernel

    assert optional_kernel("paged_cpu_kernel").__name__ == "treeattn.ops.paged_cpu_kernel"
    assert optional_kernel("packed_cpu_kernel").__name__ == "treeattn.ops.packed_cpu_kernel"
    with pytest.raises(ValueError, match="name must be one of"):
        optional_kernel("cuda_magic")
    monkeypatch.setitem(sys.modules, "numba", None)  # import numba now raises ImportError
    monkeypatch.delitem(sys.modules, "treeattn.ops.packed_cpu_kernel")
    optional_kernel.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="treeattn.ops.kernels"):
            assert optional_kernel("packed_cpu_kernel") is None
        assert "packed_cpu_kernel unavailable" in caplog.text
    finally:
        optional_kernel.cache_clear()
