"""ops.paged_decode: decode attention over blocks read in place, against a float64 reference over the
gathered keys, on the shapes that break things (no block, one visible key, GQA/MQA, uneven and
padded blocks, drafts with causal masks among them, windows, padding queries, MLA's values inside
the keys), on both paths (the compiled CPU kernel and the gathered fallback); and the engine with
the kernel against the engine without it (same greedy tokens, batches, two ranks, shared prefixes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import treeattn as ta
from treeattn.cache.sharded import INVISIBLE_POSITION
from treeattn.ops.fp8 import FP8
from treeattn.ops import paged_decode as pd

KERNEL = pd.kernel_takes(torch.float32, "cpu")
needs_kernel = pytest.mark.skipif(not KERNEL, reason="numba is not installed (scripts/install.sh installs it)")


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One torch thread in every test: the kernel's serial form (paged_cpu_kernel.attend_serial) for every case; its
    parallel form runs the same work items (_attend_range) and merge, and test_threads_run_the_serial_kernels_work_items
    checks it on one shape of each kind (each (dtype, shape) the parallel form compiles costs a fresh clone seconds of
    numba's time). Set before each test: a kernel call on 2 threads (numba.set_num_threads: OpenMP's count, which
    torch reads too) or an engine's rank in this process leaves torch on 2."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

# float32 results against a float64 reference: sums of at most a few hundred float32 products,
# in another order than the reference's, stay within ~1e-6 relative; 1e-5 leaves room for the
# exp() of float32 scores.
TOL = 1e-5


def make_case(*, B=2, Sq=1, Hq=6, Hkv=2, D=16, Dv=None, BS=8, NB=12, nb=3, lengths=None, seed=0,
              logit_scale=1.0, values_in_keys=False, q_pos=None, dtype=torch.float32):
    """A random block pool and a table of distinct blocks per sequence; sequence b holds lengths[b]
    keys at positions 0..lengths[b]-1 in its table's order, and its queries sit right after them."""
    g = torch.Generator().manual_seed(seed)
    Dv = D if Dv is None else Dv
    if values_in_keys:
        k_blocks = torch.randn(NB, BS, Hkv, D, generator=g).to(dtype)
        v_blocks = k_blocks[..., :Dv]
    else:
        k_blocks = torch.randn(NB, BS, Hkv, D, generator=g).to(dtype)
        v_blocks = torch.randn(NB, BS, Hkv, Dv, generator=g).to(dtype)
    table = torch.stack([torch.randperm(NB, generator=g)[:nb] for _ in range(B)]) if nb else torch.zeros(B, 0, dtype=torch.int64)
    lengths = lengths or [nb * BS] * B
    slot = torch.arange(nb * BS)
    kv_pos = torch.stack([torch.where(slot < n, slot, torch.full_like(slot, INVISIBLE_POSITION)) for n in lengths])
    if q_pos is None:
        q_pos = torch.stack([torch.arange(n, n + Sq) for n in lengths])
    q = (torch.randn(B, Sq, Hq, D, generator=g) * logit_scale).to(dtype)
    layout = pd.PagedDecodeLayout(table, kv_pos, q_pos, block_size=BS)
    return q, k_blocks, v_blocks, layout


def reference(q, k_blocks, v_blocks, layout, window=None):
    """float64 softmax over the gathered keys with the causal (and window) mask."""
    B, nb = layout.block_table.shape
    if nb == 0:  # no key: the merge's identity
        Sq, Hq = q.shape[1], q.shape[2]
        return torch.zeros(B, Sq, Hq, v_blocks.shape[-1], dtype=torch.float64), torch.full((B, Hq, Sq), float("-inf"),
                                                                                           dtype=torch.float64)
    k = k_blocks[layout.block_table].reshape(B, nb * layout.block_size, *k_blocks.shape[2:])
    v = v_blocks[layout.block_table].reshape(B, nb * layout.block_size, *v_blocks.shape[2:])
    return ta.reference_attention(q, k, v, causal=True, q_pos=layout.q_pos, kv_pos=layout.kv_pos, window=window)


def check(out, lse, ref_out, ref_lse):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite].double(), rtol=TOL, atol=TOL)
    torch.testing.assert_close(out.double(), ref_out.double(), rtol=TOL, atol=TOL * max(1.0, ref_out.abs().max().item()))


@pytest.fixture(params=["kernel", "gathered"])
def path(request, monkeypatch):
    """Run a test on the compiled kernel and on the gathered fallback."""
    if request.param == "kernel":
        if not KERNEL:
            pytest.skip("numba is not installed")
    else:
        monkeypatch.setattr(pd, "kernel_takes", lambda *args: False)
    return request.param


CASES = {
    "gqa": dict(),
    "mqa": dict(Hq=4, Hkv=1),
    "mha": dict(Hq=3, Hkv=3),
    "one key": dict(lengths=[1, 1], nb=1),
    "uneven and padded": dict(lengths=[17, 3], nb=3),
    "no block": dict(nb=0, lengths=[0, 0]),
    "drafts": dict(Sq=4, lengths=[20, 9]),
    "window": dict(Sq=3, lengths=[24, 13]),  # with WINDOWS["window"]
    "padding query": dict(Sq=2, q_pos=torch.tensor([[5, 6], [-1, -1]]), lengths=[7, 7]),
    "mla values in keys": dict(Hq=4, Hkv=1, D=24, Dv=16, values_in_keys=True),
    "value dim differs": dict(D=16, Dv=12),
    "huge logits": dict(logit_scale=300.0),
    "tiny logits": dict(logit_scale=1e-6),
    "long": dict(B=1, NB=40, nb=33, BS=16, D=64, lengths=[33 * 16 - 5]),  # the heads of "head dim 64, window": one compile
    # a head dim the kernel compiles as a constant (64: paged_cpu_kernel.head_dim_tag) and models' larger ones
    "head dim 64, window": dict(Sq=3, D=64, lengths=[24, 13]),
    "head dim 256, drafts": dict(Hq=4, Hkv=1, Sq=2, D=256, lengths=[20, 9]),
}


WINDOWS = {"window": 5, "head dim 64, window": 7}  # the layer's sliding window of these cases


@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_reference(case, path):
    q, kb, vb, layout = make_case(**CASES[case])
    window = WINDOWS.get(case)
    out, lse = pd.paged_decode_attention(q, kb, vb, layout, window=window)
    assert out.shape == (*q.shape[:3], vb.shape[-1]) and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    check(out, lse, *reference(q, kb, vb, layout, window))


def test_rows_that_see_nothing_are_zero_and_minus_inf(path):
    q, kb, vb, layout = make_case(**CASES["padding query"])
    out, lse = pd.paged_decode_attention(q, kb, vb, layout)
    assert torch.isneginf(lse[1]).all() and torch.equal(out[1], torch.zeros_like(out[1]))
    q, kb, vb, layout = make_case(**CASES["no block"])
    out, lse = pd.paged_decode_attention(q, kb, vb, layout)
    assert torch.isneginf(lse).all() and not out.any()


@needs_kernel
@pytest.mark.parametrize("case, kv_dtype", [("gqa", torch.float32), ("head dim 64, window", torch.float16),
                                            ("head dim 256, drafts", torch.bfloat16), ("mla values in keys", FP8)])
def test_threads_run_the_serial_kernels_work_items(case, kv_dtype):
    """The parallel kernel (paged_cpu_kernel.attend_parallel, 2 threads) over the same block ranges as the serial
    one: the same state bit for bit, on each kind of compiled shape (no tiles, score and value tiles at head dim
    64, value tiles at 256) and each kind of block (float32, 16-bit, fp8 with scales)."""
    from treeattn.ops import paged_cpu_kernel as kernel
    from treeattn.ops.fp8 import dequantize_fp8

    q, kb, vb, layout = make_case(**CASES[case])
    scales = (kernel.NO_SCALES, kernel.NO_SCALES)
    if kv_dtype == FP8:
        kb, vb, ks, vs = _fp8_blocks(kb, vb, CASES[case].get("values_in_keys", False))
        scales = (ks.numpy(), vs.numpy())
        want = reference(q.double(), dequantize_fp8(kb, ks).double(), dequantize_fp8(vb, vs).double(), layout, WINDOWS.get(case))
    else:
        kb, vb = kb.to(kv_dtype), vb.to(kv_dtype)
        want = reference(q.double(), kb.double(), vb.double(), layout, WINDOWS.get(case))
    bits = {torch.float32: torch.float32, torch.bfloat16: torch.uint16, torch.float16: torch.int16, FP8: torch.uint8}[kv_dtype]
    B, Sq, Hq, D = q.shape
    Hkv, dv = kb.shape[2], vb.shape[-1]
    lay = pd.PagedDecodeLayout(layout.block_table, layout.kv_pos, layout.q_pos, block_size=layout.block_size, threads=2)
    table, kv_pos, row_seq, q_pos, splits = lay._kernel_arrays()
    assert B * Sq * splits > 1  # work items for both threads
    states = []
    for threads in (1, 2):
        out = np.empty((B * Sq, Hkv, Hq // Hkv, dv), dtype=np.float32)
        lse = np.empty((B * Sq, Hkv, Hq // Hkv), dtype=np.float32)
        v_store = kb if CASES[case].get("values_in_keys") else vb  # MLA: the values are the keys' first dv channels
        kernel.attend(threads, q.reshape(B * Sq, Hkv, Hq // Hkv, D).numpy(), kb.view(bits).numpy(), v_store.view(bits).numpy(),
                      *scales, dv, D**-0.5, table, kv_pos, row_seq, q_pos, WINDOWS.get(case) or 0, splits, out, lse)
        states.append((out, lse))
    for serial, parallel in zip(*states):
        assert np.array_equal(serial, parallel, equal_nan=True)
    out, lse = states[1]
    check(torch.from_numpy(out).reshape(B, Sq, Hq, dv), torch.from_numpy(lse).reshape(B, Sq, Hq).transpose(1, 2), *want)


@needs_kernel
def test_kernel_splits_and_threads_do_not_change_the_state(monkeypatch):
    """One range per row or many (flash-decoding splits), one thread or two: the same state up to
    float32 rounding of the merge."""
    q, kb, vb, layout = make_case(B=1, NB=30, nb=25, lengths=[25 * 8 - 3])
    ref = reference(q, kb, vb, layout)
    for threads in (1, 2, 7):
        lay = pd.PagedDecodeLayout(layout.block_table, layout.kv_pos, layout.q_pos, block_size=8, threads=threads)
        check(*pd.paged_decode_attention(q, kb, vb, lay), *ref)
        assert lay._kernel_arrays()[4] == (1 if threads == 1 else min(25, threads))


@needs_kernel
@pytest.mark.parametrize("case", ["long", "head dim 64, window"])
def test_constant_head_dims_give_the_state_of_dims_read_from_shapes(case, monkeypatch):
    """The kernel compiles head dim 64 as a constant (paged_cpu_kernel.head_dim_tag): the same state as
    its loops over dims read from the arrays' shapes (dims=()), up to float32 rounding, and a NaN in a
    query still makes its row NaN."""
    from treeattn.ops import paged_cpu_kernel

    q, kb, vb, layout = make_case(**CASES[case])
    q[0, 0, 0, 0] = float("nan")
    window = WINDOWS.get(case)
    assert len(paged_cpu_kernel.head_dim_tag(q.shape[-1], vb.shape[-1])) == q.shape[-1] // 16
    constant = pd.paged_decode_attention(q, kb, vb, layout, window=window)
    monkeypatch.setattr(paged_cpu_kernel, "head_dim_tag", lambda head_dim, dv: ())
    generic = pd.paged_decode_attention(q, kb, vb, layout, window=window)
    for got, want in zip(constant, generic):
        assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(got).any()
        torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("case", ["gqa", "uneven and padded", "drafts", "window", "mla values in keys", "huge logits", "long",
                                  "head dim 64, window", "head dim 256, drafts"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_stored_16_bit_blocks_match_float64_on_the_stored_values(case, kv_dtype, path):
    """A 16-bit cache (--kv-cache-dtype) with float32 queries: read as stored and accumulated in
    float32, so the result is the float64 reference over the dequantized (stored) blocks up to
    float32 rounding (every bfloat16/float16 is exactly a float32: TOL, as for float32 blocks)."""
    q, kb, vb, layout = make_case(**CASES[case])
    kb16 = kb.to(kv_dtype)
    vb16 = kb16[..., : vb.shape[-1]] if CASES[case].get("values_in_keys") else vb.to(kv_dtype)
    window = WINDOWS.get(case)
    out, lse = pd.paged_decode_attention(q, kb16, vb16, layout, window=window)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    check(out, lse, *reference(q.double(), kb16.double(), vb16.double(), layout, window))



@needs_kernel
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tiles_with_partial_tiles_and_nan_in_hidden_slots(kv_dtype):
    """The score tiles (paged_cpu_kernel._score_tile: float16 blocks, head dim 64; 2-key tiles) and the value
    tiles (_value_tile: 4 keys, float32 and 16-bit blocks) over blocks of 7 keys (the keys after the last whole
    tile by the key-by-key loops), padded slots holding NaN (never visible: their scores -inf, their values
    never summed), with and without a window that hides part of a tile, against the float64 reference over the
    stored blocks (the heads of "head dim 64, window": the same compiled kernels)."""
    from treeattn.ops import paged_cpu_kernel

    assert paged_cpu_kernel.tile_shape(2, 3) == (2, 2) and paged_cpu_kernel.head_shape_tag(2, 3)[0] == (0, 0)
    q, kb, vb, layout = make_case(B=1, D=64, BS=7, NB=8, nb=4, lengths=[24])
    kb16, vb16 = kb.to(kv_dtype), vb.to(kv_dtype)
    want = [reference(q.double(), kb16.double(), vb16.double(), layout, window) for window in (None, 10)]
    for slot in range(24, 4 * 7):  # slots past the sequence's length: not visible
        blk = layout.block_table[0, slot // 7]
        kb16[blk, slot % 7] = float("nan")
        vb16[blk, slot % 7] = float("nan")
    for window, ref in zip((None, 10), want):
        check(*pd.paged_decode_attention(q, kb16, vb16, layout, window=window), *ref)


@needs_kernel
@pytest.mark.parametrize("dtype", [np.float32, np.uint16, np.int16])
def test_value_tile_sums_every_query_head_and_channel_chunk(dtype):
    """paged_cpu_kernel._value_tile alone: 6 query heads (two passes of at most 4 over the keys), channels 64..127
    of value rows 144 wide (values inside wider rows, as MLA's keys), the tile at keys 4..7; against float64."""
    from numba import njit

    from treeattn.ops import paged_cpu_kernel as kernel

    @njit
    def tile(acc, h, d0, vb, t0, scores):
        kernel._value_tile(acc, h, d0, vb, t0, scores, (0, 0, 0, 0, 0, 0))

    rng = np.random.default_rng(0)
    acc = rng.standard_normal((2, 6, 128)).astype(np.float32)
    scores = rng.random((2, 6, 9)).astype(np.float32)
    values = torch.from_numpy(rng.standard_normal((9, 2, 144)).astype(np.float32))
    stored = {np.float32: values, np.uint16: values.to(torch.bfloat16), np.int16: values.to(torch.float16)}[dtype]
    want = acc.astype(np.float64)
    want[1, :, 64:] += np.einsum("gt,td->gd", scores[1, :, 4:8].astype(np.float64), stored[4:8, 1, 64:128].double().numpy())
    tile(acc, 1, 64, stored.view({np.float32: torch.float32, np.uint16: torch.uint16, np.int16: torch.int16}[dtype]).numpy(),
         4, scores)
    np.testing.assert_allclose(acc, want, rtol=1e-5, atol=1e-5)


def test_kernel_widens_every_16_bit_pattern_exactly():
    """The kernel's widening of a 16-bit element in registers (bfloat16 by a shift, float16 by LLVM's
    fpext where the CPU has F16C, else in integers) gives torch's own conversion of every one of the
    65536 patterns: zeros, subnormals, normals, infinities of both signs, NaNs as NaNs."""
    if not KERNEL:
        pytest.skip("numba is not installed")
    from numba import njit

    from treeattn.ops.paged_cpu_kernel import _float16_bits_to_float32_in_integers, _wide

    @njit
    def widen(bits):
        out = np.empty(bits.shape, dtype=np.float32)
        for i in range(bits.shape[0]):
            out[i] = _wide(bits[i])
        return out

    @njit
    def widen_in_integers(bits):  # the kernel's float16 path on a CPU without F16C (issue 46)
        out = np.empty(bits.shape, dtype=np.float32)
        for i in range(bits.shape[0]):
            out[i] = _float16_bits_to_float32_in_integers(bits[i])
        return out

    patterns = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    for dtype, bits, convert in ((torch.bfloat16, torch.uint16, widen), (torch.float16, torch.int16, widen),
                                 (torch.float16, torch.int16, widen_in_integers)):
        expected = patterns.view(dtype).float()
        got = torch.from_numpy(convert(patterns.view(dtype).view(bits).numpy()))
        assert torch.equal(torch.isnan(got), torch.isnan(expected))
        assert torch.equal(got[~torch.isnan(got)], expected[~torch.isnan(expected)])
        assert torch.equal(torch.signbit(got), torch.signbit(expected))


def _fp8_blocks(kb, vb, values_in_keys=False, seed=0):
    """kb, vb as an fp8 cache stores them: codes and a scale per (block, slot, head), the rows' magnitudes
    spread over 2**-8 .. 2**8; MLA's values are the keys' first channels (and share their scales)."""
    from treeattn.ops.fp8 import quantize_fp8

    g = torch.Generator().manual_seed(seed)
    spread = lambda x: x * torch.exp2(torch.randint(-8, 9, x.shape[:-1], generator=g).float())[..., None]  # noqa: E731
    kc, ks = quantize_fp8(spread(kb))
    if values_in_keys:
        return kc, kc[..., : vb.shape[-1]], ks, ks
    vc, vs = quantize_fp8(spread(vb))
    return kc, vc, ks, vs


@pytest.mark.parametrize("case", ["gqa", "uneven and padded", "drafts", "window", "mla values in keys", "huge logits", "long",
                                  "head dim 64, window", "head dim 256, drafts"])
def test_stored_fp8_blocks_match_float64_on_the_dequantized_values(case, path):
    """An fp8 cache (codes + a power-of-two scale per key and head) with float32 queries: the kernel
    dequantizes each block with its scales (into its scratch block), as the gathered path does; both give the float64
    reference over codes * scales up to float32 rounding (the dequantization is exact: TOL)."""
    from treeattn.ops.fp8 import dequantize_fp8

    q, kb, vb, layout = make_case(**CASES[case])
    kc, vc, ks, vs = _fp8_blocks(kb, vb, CASES[case].get("values_in_keys", False))
    window = WINDOWS.get(case)
    out, lse = pd.paged_decode_attention(q, kc, vc, layout, window=window, k_scales=ks, v_scales=vs)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    check(out, lse, *reference(q.double(), dequantize_fp8(kc, ks).double(), dequantize_fp8(vc, vs).double(), layout, window))


def test_kernels_read_every_fp8_code_exactly(monkeypatch):
    """One visible key (softmax weight exactly 1): the output is that key's value row, 256 channels holding
    the 256 e4m3 codes times a scale; the CPU kernel (and, through its interpreter, the Triton kernel)
    give codes * scale bit for bit: zeros, subnormals, normals of both signs, NaNs as NaNs (a zero's
    sign is the float32 accumulator's: 0 + -0 is 0)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    vc = torch.zeros(2, 4, 1, 256, dtype=torch.float8_e4m3fn)
    vc[1, 0, 0] = codes
    kc = torch.zeros_like(vc)
    scales = torch.full((2, 4, 1), 2.0**-5)
    layout = pd.PagedDecodeLayout(torch.tensor([[1]]), torch.tensor([[0, INVISIBLE_POSITION, INVISIBLE_POSITION,
                                                                      INVISIBLE_POSITION]]),
                                  torch.tensor([[3]]), block_size=4)
    expected = codes.float() * 2.0**-5
    q = torch.randn(1, 1, 2, 256)
    kernels = ["cpu"] if KERNEL else []
    try:
        from conftest import interpreted_triton_decode

        td = interpreted_triton_decode()
        kernels.append("triton")
    except pytest.skip.Exception:
        pass
    for kernel in kernels:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(pd, "_triton_kernel", lambda q: td if kernel == "triton" else None)
            out, lse = pd.paged_decode_attention(q, kc, vc, layout, k_scales=scales, v_scales=scales)
        for row in out[0, 0]:
            assert torch.equal(torch.isnan(row), torch.isnan(expected)), kernel
            assert torch.equal(row[~torch.isnan(row)], expected[~torch.isnan(expected)]), kernel
        torch.testing.assert_close(lse, torch.zeros(1, 2, 1))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes(dtype):
    """float64 gathers; bfloat16 queries over bfloat16 blocks (a bfloat16 model) take the kernel."""
    q, kb, vb, layout = make_case(dtype=dtype)
    out, lse = pd.paged_decode_attention(q, kb, vb, layout)
    ref_out, ref_lse = reference(q.double(), kb.double(), vb.double(), layout)
    tol = 1e-12 if dtype == torch.float64 else 1.6e-2  # bf16: inputs and output rounded to 8 bits
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol * ref_out.abs().max().item())
    torch.testing.assert_close(lse.double(), ref_lse, rtol=tol, atol=tol)


def test_bad_input_names_the_argument():
    q, kb, vb, layout = make_case()
    table, kv_pos, q_pos = layout.block_table, layout.kv_pos, layout.q_pos
    with pytest.raises(TypeError, match="block_table must be a 2-D int64"):
        pd.PagedDecodeLayout(table.int(), kv_pos, q_pos, block_size=8)
    with pytest.raises(ValueError, match="kv_pos must have shape"):
        pd.PagedDecodeLayout(table, kv_pos[:, 1:], q_pos, block_size=8)
    with pytest.raises(ValueError, match="block_size must be"):
        pd.PagedDecodeLayout(table, kv_pos, q_pos, block_size=0)
    with pytest.raises(ValueError, match="block_table must hold block ids >= 0"):
        pd.PagedDecodeLayout(table - 100, kv_pos, q_pos, block_size=8)
    with pytest.raises(ValueError, match="q must have shape"):
        pd.paged_decode_attention(q[:1], kb, vb, layout)
    with pytest.raises(ValueError, match="must be < NB"):
        pd.paged_decode_attention(q, kb[:2], vb[:2], layout)
    with pytest.raises(TypeError, match="the blocks of one dtype"):
        pd.paged_decode_attention(q, kb, vb.double(), layout)
    kc, vc, ks, vs = _fp8_blocks(kb, vb)
    with pytest.raises(TypeError, match=r"k_scales must be a float32 tensor of shape \(NB, BS, Hkv\)"):
        pd.paged_decode_attention(q, kc, vc, layout)  # fp8 codes without their scales
    with pytest.raises(TypeError, match=r"v_scales must be a float32 tensor"):
        pd.paged_decode_attention(q, kc, vc, layout, k_scales=ks, v_scales=vs[:, :1])
    with pytest.raises(TypeError, match="k_scales and v_scales go with float8_e4m3fn blocks only"):
        pd.paged_decode_attention(q, kb, vb, layout, k_scales=ks, v_scales=vs)


# ---------------------------------------------------------------- the engine with and without the kernel


def _engine_tokens(model, prompts, *, nproc=1, paged=True, max_new_tokens=5):
    from treeattn.engine.worker import batch as engine_batch

    saved = engine_batch.kernel_takes
    if not paged:
        engine_batch.kernel_takes = lambda *args: False
    try:
        with ta.Engine(model, nproc=nproc, decode="tree", max_batch_size=4, block_size=8, prefix_cache=True) as engine:
            return [r.token_ids for r in engine.generate(prompts, max_new_tokens=max_new_tokens, temperature=0.0)]
    finally:
        engine_batch.kernel_takes = saved


@needs_kernel
@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_layer_call_is_the_kernel_call_bit_for_bit(case, dtype):
    """layer_call, checked once, runs every layer of a step (block pools of one shape and dtype) with
    the bits of attend_blocks (the per-call path it replaces in the engine) and of paged_decode_attention."""
    from treeattn.ops.cpu_decode import attend_blocks

    layers = [make_case(**CASES[case], seed=seed, dtype=dtype) for seed in (0, 1)]
    q0, k0, v0, layout = layers[0]
    call = pd.layer_call(q0, k0, v0, layout)
    assert call is not None
    window = WINDOWS.get(case)
    values_in_keys = CASES[case].get("values_in_keys", False)
    for q, k, v, _ in layers:  # the second layer's tensors through the first layer's call
        out, lse = call(q, k, v, window)
        old = attend_blocks(q, k, k if values_in_keys else v, v.shape[-1], layout._kernel_arrays(), threads=layout.threads,
                            scale=q.shape[-1] ** -0.5, window=window)
        for new_t, old_t, full in zip((out, lse), old, pd.paged_decode_attention(q, k, v, layout, window=window)):
            assert new_t.dtype == old_t.dtype == full.dtype and new_t.shape == old_t.shape and new_t.is_contiguous()
            assert torch.equal(new_t, old_t) and torch.equal(new_t, full)


@needs_kernel
@pytest.mark.parametrize("case", list(CASES))
def test_layer_call_keeps_the_blocks_views_it_is_given_a_dict_for(case):
    """With views (a cache's kernel_views), a call keeps each blocks tensor's numpy views for the next call with the
    same tensors, and a call with other tensors makes theirs: the bits of a call without views every time."""
    layers = [make_case(**CASES[case], seed=seed) for seed in (0, 1)]
    q0, k0, v0, layout = layers[0]
    views = {}
    kept, fresh = pd.layer_call(q0, k0, v0, layout, views=views), pd.layer_call(q0, k0, v0, layout)
    window = WINDOWS.get(case)
    for _ in range(2):
        for q, k, v, _ in layers:
            for a, b in zip(kept(q, k, v, window), fresh(q, k, v, window)):
                assert torch.equal(a, b)
    assert sorted(views) == sorted(id(k) for _, k, _, _ in layers) and fresh.views is None


def test_a_paged_caches_layer_views_are_made_once():
    """PagedKVCache.blocks and block_scales give the same view tensors at every call (the paged kernel's numpy views of
    them are kept by tensor), and write() stores through the same views, for float32 and fp8 arenas."""
    from treeattn.cache.paged import PagedKVCache
    from treeattn.ops.fp8 import FP8

    for dtype in (torch.float32, FP8):
        cache = PagedKVCache(num_layers=2, num_kv_heads=1, head_dim=4, num_blocks=2, block_size=2, dtype=dtype)
        first = [cache.blocks(i) for i in range(2)], [cache.block_scales(i) for i in range(2)]
        k = torch.randn(1, 1, 4)
        cache.write(1, torch.tensor([3]), k, -k)
        again = [cache.blocks(i) for i in range(2)], [cache.block_scales(i) for i in range(2)]
        assert all(a is b for pairs in zip(*first, *again) for a, b in zip(pairs[:2], pairs[2:]) if a is not None)
        stored = cache.stored(k)
        assert torch.equal(cache.gather(1, torch.tensor([[1]]))[0][0, 1], stored[0]) and first[0][1][0].data_ptr() != 0


def test_layer_call_is_none_where_the_kernel_does_not_run(monkeypatch):
    """No CPU kernel for these tensors (here: kernel_takes says no): layer_call gives None, the caller
    keeps paged_decode_attention; bad input raises as paged_decode_attention does."""
    q, k, v, layout = make_case()
    with pytest.raises(ValueError, match="q must have shape"):
        pd.layer_call(q[:1], k, v, layout)
    monkeypatch.setattr(pd, "kernel_takes", lambda *args: False)
    assert pd.layer_call(q, k, v, layout) is None


def test_engine_same_tokens_with_and_without_the_kernel():
    """A batch of decoding sequences of different lengths, two of them sharing a 24-token prefix
    (shared_prefix reads it once): the same greedy tokens with the paged kernel, on one process and
    on two ranks, as with the gathered / run-by-run reads on one process."""
    from treeattn.models.llama import LlamaConfig, random_model

    model = random_model(LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=64, num_layers=2, num_heads=6,
                                     num_kv_heads=2, head_dim=8, max_position_embeddings=512), seed=3)
    doc = list(range(5, 29))
    prompts = [doc + [40, 41], doc + [50], list(range(30, 33)), list(range(7, 70))]
    without = _engine_tokens(model, prompts, paged=False)
    assert _engine_tokens(model, prompts, paged=True) == without
    assert _engine_tokens(model, prompts, paged=True, nproc=2) == without  # two ranks: each reads its blocks, tree combine


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "gathered"])
@pytest.mark.parametrize("tokens, in_order", [([(1,), (1,), (1,)], True), ([(1, 2), (3, 4), (5, 6)], True),
                                              ([(1,), (1, 2, 3), (1,)], False), ([(1,), (1,), (1, 2, 3, 4)], False)],
                         ids=["decode", "drafts alike", "drafts unlike", "with a prefill"])
def test_engine_step_in_row_order_is_viewed_not_regrouped(tokens, in_order, kernel, monkeypatch):
    """A step whose rows form one group in order (decode steps, drafts of one length) attends a view
    of its queries and returns the group's output as the step's; it gives bit for bit what regrouping
    (index the rows, scatter the output back) gives, on the paged kernel and on the gathered read.
    Steps with padded rows or a prefill chunk regroup. Every new key is stored without a row gather."""
    from treeattn.cache.blocks import BlockRef
    from treeattn.cache.paged import PagedKVCache
    from treeattn.engine.worker import batch as engine_batch
    from treeattn.engine.scheduler import Chunk, StepPlan
    from treeattn.models.attention import LocalAttention

    if kernel and not KERNEL:
        pytest.skip("numba is not installed")
    if not kernel:
        monkeypatch.setattr(engine_batch, "kernel_takes", lambda *args: False)
    g = torch.Generator().manual_seed(0)
    cache = PagedKVCache(num_layers=1, num_kv_heads=2, head_dim=8, num_blocks=12, block_size=4)
    cache.arena.copy_(torch.randn(cache.arena.shape, generator=g))
    chunks = tuple(Chunk(s, t, start, tuple(BlockRef(0, 4 * s + b) for b in range(4)), None, len(t) - 1 if len(t) < 4 else 0)
                   for s, (t, start) in enumerate(zip(tokens, (9, 5, 2))))
    T = sum(len(t) for t in tokens)
    q = torch.randn(1, T, 4, 8, generator=g)
    k_new, v_new = torch.randn(1, T, 2, 8, generator=g), torch.randn(1, T, 2, 8, generator=g)
    outs = []
    for regroup in (False, True):
        batch = engine_batch.PagedBatch(StepPlan(chunks), 0, cache, LocalAttention(), combine=(None, "allreduce", 1))
        assert batch._in_order == in_order and batch._store_all and (batch.groups[0].paged is not None) == kernel
        batch._in_order = batch._in_order and not regroup
        k, v, pos = batch.kv_store(0, k_new, v_new)
        outs.append(batch.attend(q, k, v, q_pos=None, kv_pos=pos, window=None))
    assert outs[0].shape == (1, T, 4, 8) and torch.equal(outs[0], outs[1])
    keys, values = cache.blocks(0)
    row = 0
    for c in chunks:  # against float64 over what the cache holds, the new keys included
        n, end = len(c.tokens), c.start + len(c.tokens)
        ids = torch.tensor([ref.index for ref in c.blocks])
        expected, _ = ta.reference_attention(q[:, row : row + n].double(), keys[ids].flatten(0, 1)[None, :end].double(),
                                             values[ids].flatten(0, 1)[None, :end].double(), causal=True,
                                             q_pos=torch.arange(c.start, end)[None], kv_pos=torch.arange(end)[None])
        torch.testing.assert_close(outs[0][:, row : row + n].double(), expected, rtol=TOL, atol=TOL)
        row += n


@pytest.mark.parametrize("fp8", [False, True], ids=["same-dtype", "fp8"])
@pytest.mark.parametrize("case", ["drafts", "mla values in keys"])
def test_cuda_branch_through_the_triton_interpreter(case, fp8, monkeypatch):
    """The CUDA branch (the Triton paged kernel through the table, the static step's kernel), run
    by Triton's interpreter on CPU tensors when there is no GPU; also over fp8 blocks and their
    scales (float32 queries: the reference is float64 over the dequantized blocks)."""
    from conftest import HAS_CUDA, interpreted_triton_decode

    td = interpreted_triton_decode()
    device = "cuda" if HAS_CUDA else "cpu"
    monkeypatch.setattr(pd, "_triton_kernel", lambda q: td)
    params = dict(CASES[case])
    if case == "mla values in keys":
        params.update(D=32, Dv=16)  # the kernel takes power-of-two head dims
    q, kb, vb, layout = make_case(**params)
    scales = {}
    if fp8:
        from treeattn.ops.fp8 import dequantize_fp8

        kb, vb, ks, vs = _fp8_blocks(kb, vb, case == "mla values in keys")
        scales = dict(k_scales=ks.to(device), v_scales=vs.to(device))
        ref = reference(q.double(), dequantize_fp8(kb, ks).double(), dequantize_fp8(vb, vs).double(), layout)
    else:
        ref = reference(q, kb, vb, layout)
    layout = pd.PagedDecodeLayout(*(t.to(device) for t in (layout.block_table, layout.kv_pos, layout.q_pos)),
                                  block_size=layout.block_size)
    out, lse = pd.paged_decode_attention(q.to(device), kb.to(device), vb.to(device), layout, **scales)
    check(out.cpu(), lse.cpu(), *ref)


def test_the_kernels_exp_is_within_two_ulp_of_float64_and_keeps_nan():
    """paged_cpu_kernel._exp_shifted, the softmax's exp: float32 operations that vectorize."""
    import numpy as np

    from treeattn.ops import paged_cpu_kernel

    g = np.random.default_rng(0)
    x = np.concatenate([-g.random(20000, dtype=np.float32) * 90, np.float32([0.0, -1e-30, -87.0, -87.01, -1e4, -np.inf, np.nan])])
    shift = np.float32(2.5)
    got = (x + shift).astype(np.float32)
    paged_cpu_kernel._exp_shifted(got, shift, np.empty(got.shape[0], dtype=np.int32))
    a = (x + shift).astype(np.float32) - shift  # what the kernel exponentiates: (x + shift) - shift in float32
    ref = np.exp(a.astype(np.float64))
    normal = (a >= -87.0) & np.isfinite(a)
    assert (np.abs(got[normal] - ref[normal]) <= 2 * 2.0**-24 * ref[normal]).all()
    assert (got[(a < -87.0)] == 0).all()  # far below any block maximum's exp (1): 0, as -inf
    assert np.isnan(got[np.isnan(a)]).all()
