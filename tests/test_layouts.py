"""Results are independent of memory layout: every public attention entry point x every layout class.

Each layout class holds the same logical (B, S, H, D) tensor in a different memory layout:
contiguous, stored in another dim order (transposed), sliced with step 2 in each dim (the skipped
elements are NaN, so a kernel that reads outside the view fails), stride 0 in each dim (an expanded
tensor: its values are then constant along that dim), one half of a stacked (..., D, 2) tensor, and
a narrow slice of a packed (..., 3 * D) QKV projection. q, k and v all take the layout; positions
and paged-cache tables take a step-2 slice with the sliced classes. Every result is compared with
the float64 reference on the same values (ta.reference_attention), in float32 and bfloat16.

Before the fix, the fused CPU flash kernel read a last dim of stride != 1 as if it were contiguous
and returned wrong values without an error (issue 10, item 1).
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

import treeattn as ta
from treeattn.ops import reference_attention

B, HQ, HKV, D = 2, 4, 2, 16
DTYPES = [torch.float32, torch.bfloat16]
# Relative to max(1, max |reference out|): float32 rounds in accumulation only; bfloat16 rounds the
# inputs of P @ V (fused kernels) and the output.
OUT_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
LSE_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}

LAYOUTS = [
    "contiguous",
    "stored (B, H, S, D)",  # the usual transposed cache layout
    "stored (B, S, D, H)",  # last dim strided
    "stored (D, H, S, B)",  # every dim strided
    *(f"sliced dim {d}" for d in range(4)),
    *(f"stride 0 dim {d}" for d in range(4)),
    "stacked then split",
    "packed qkv narrow",
]
STORAGE_ORDERS = {"stored (B, H, S, D)": (0, 2, 1, 3), "stored (B, S, D, H)": (0, 1, 3, 2), "stored (D, H, S, B)": (3, 2, 1, 0)}


def relayout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A tensor with t's shape in `layout` (with its values, except for the stride-0 classes, whose
    values are t's first entry along that dim, repeated)."""
    if layout == "contiguous":
        return t.contiguous()
    if layout in STORAGE_ORDERS:
        order = STORAGE_ORDERS[layout]
        inverse = [order.index(i) for i in range(4)]
        return t.permute(order).contiguous().permute(inverse)
    if layout.startswith("sliced dim"):
        d = int(layout[-1])
        shape = list(t.shape)
        shape[d] = 2 * shape[d] + 1
        big = torch.full(shape, float("nan"), dtype=t.dtype)
        index = [slice(None)] * 4
        index[d] = slice(1, None, 2)
        view = big[tuple(index)]
        view.copy_(t)
        return view
    if layout.startswith("stride 0 dim"):
        d = int(layout[-1])
        return t.narrow(d, 0, 1).expand(t.shape)
    if layout == "stacked then split":
        return torch.stack([t, torch.full_like(t, float("nan"))], dim=-1)[..., 0]
    if layout == "packed qkv narrow":
        n = t.shape[-1]
        big = torch.full((*t.shape[:-1], 3 * n), float("nan"), dtype=t.dtype)
        big[..., n : 2 * n] = t
        return big[..., n : 2 * n]
    raise AssertionError(layout)


def relayout_index(t: torch.Tensor, layout: str) -> torch.Tensor:
    """Positions, block tables, sequence lengths: a step-2 slice of a larger buffer with the sliced
    classes (the skipped entries are garbage), else t itself."""
    if not layout.startswith("sliced"):
        return t
    big = torch.full((*t.shape[:-1], 2 * t.shape[-1]), -7, dtype=t.dtype)
    big[..., ::2] = t
    return big[..., ::2]


def randn(shape, seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def qkv(Sq: int, Sk: int, dtype, layout: str, seed: int = 0, batch: int = B):
    q = relayout(randn((batch, Sq, HQ, D), seed, dtype), layout)
    k = relayout(randn((batch, Sk, HKV, D), seed + 1, dtype), layout)
    v = relayout(randn((batch, Sk, HKV, D), seed + 2, dtype), layout)
    return q, k, v


def assert_matches(out, lse, ref_out, ref_lse, dtype):
    assert out.dtype == dtype and out.shape == ref_out.shape and lse.shape == ref_lse.shape
    out, lse, ref_out, ref_lse = out.cpu().double(), lse.cpu().double(), ref_out.cpu().double(), ref_lse.cpu().double()
    scale = max(1.0, ref_out.abs().max().item())
    torch.testing.assert_close(out, ref_out, rtol=0, atol=OUT_TOL[dtype] * scale)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=LSE_TOL[dtype] * max(1.0, ref_lse.abs().max().item()))


def reference(q, k, v, **kwargs):
    return reference_attention(q.contiguous(), k.contiguous(), v.contiguous(), **kwargs)


# ------------------------------------------------------------------------- single process


def attention_decode(dtype, layout):
    q, k, v = qkv(1, 37, dtype, layout)
    return ta.attention(q, k, v), reference(q, k, v)


def attention_prefill(dtype, layout):
    """Unmasked, 80 query rows per KV head: the fused kernel in float32 too."""
    q, k, v = qkv(40, 33, dtype, layout)
    return ta.attention(q, k, v), reference(q, k, v)


def attention_causal_prefill(dtype, layout):
    """Causal over contiguous positions: the fused kernel's own causal blocks."""
    q, k, v = qkv(40, 40, dtype, layout)
    return ta.attention(q, k, v, causal=True), reference(q, k, v, causal=True)


def attention_positions_window(dtype, layout):
    """Masked by shuffled positions and a window: the masked (chunked) path, prefill-sized."""
    q, k, v = qkv(40, 45, dtype, layout)
    q_pos = relayout_index(torch.arange(40) + 5, layout)
    kv_pos = relayout_index(torch.randperm(45, generator=torch.Generator().manual_seed(3)), layout)
    kwargs = dict(causal=True, q_pos=q_pos, kv_pos=kv_pos, window=9)
    return ta.attention(q, k, v, **kwargs), reference(q, k, v, **kwargs)


def attention_decode_positions(dtype, layout):
    q, k, v = qkv(3, 37, dtype, layout)
    q_pos = relayout_index(torch.tensor([20, 30, 40]), layout)
    kv_pos = relayout_index(torch.randperm(37, generator=torch.Generator().manual_seed(4)), layout)
    kwargs = dict(causal=True, q_pos=q_pos, kv_pos=kv_pos)
    return ta.attention(q, k, v, **kwargs), reference(q, k, v, **kwargs)


def graph_safe(dtype, layout):
    q, k, v = qkv(2, 37, dtype, layout)
    q_pos = relayout_index(torch.tensor([10, 30]), layout)
    kv_pos = relayout_index(torch.arange(37), layout)
    out = ta.ops.graph_safe_attention(q, k, v, q_pos=q_pos, kv_pos=kv_pos)
    return out, reference(q, k, v, causal=True, q_pos=q_pos, kv_pos=kv_pos)


def attention_via_energy(dtype, layout):
    q, k, v = qkv(2, 21, dtype, layout)
    ref_out, ref_lse = reference(q, k, v)
    return (ta.attention_via_energy(q, k, v), ta.energy(q, k, v, torch.zeros_like(ref_out, dtype=q.dtype))), (ref_out, ref_lse)


def bifurcated(mode):
    def run(dtype, layout):
        q, decode_k, decode_v = qkv(1, 5, dtype, layout, batch=3)
        _, context_k, context_v = qkv(1, 40, dtype, layout, seed=7, batch=1)
        out = ta.bifurcated_attention(q, context_k, context_v, decode_k, decode_v, mode=mode)
        k = torch.cat([context_k.expand(3, -1, -1, -1), decode_k], dim=1)
        v = torch.cat([context_v.expand(3, -1, -1, -1), decode_v], dim=1)
        return out, reference(q, k, v)

    return run


SINGLE = {
    "attention decode": attention_decode,
    "attention prefill": attention_prefill,
    "attention causal prefill": attention_causal_prefill,
    "attention positions+window": attention_positions_window,
    "attention decode positions": attention_decode_positions,
    "graph_safe_attention": graph_safe,
    "attention_via_energy": attention_via_energy,
    "bifurcated_attention bifurcated": bifurcated("bifurcated"),
    "bifurcated_attention batched": bifurcated("batched"),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("entry", list(SINGLE))
def test_single_device_entry_points(entry, layout, dtype):
    (out, lse), (ref_out, ref_lse) = SINGLE[entry](dtype, layout)
    assert_matches(out, lse, ref_out, ref_lse, dtype)


# ------------------------------------------------------------------------- Triton kernels


@pytest.fixture(scope="module")
def triton_decode():
    """The Triton kernel module: compiled on CUDA, else under Triton's interpreter (as in
    tests/test_triton_decode.py, which documents why the variable stays set)."""
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton")
    td = importlib.import_module("treeattn.ops.triton_decode")
    if not torch.cuda.is_available() and not td._INTERPRETED:
        td = importlib.reload(td)
    return td


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_decode_kernel(triton_decode, layout, dtype):
    q, k, v = qkv(2, 37, dtype, layout)
    q_pos = relayout_index(torch.tensor([20, 36]), layout)
    kv_pos = relayout_index(torch.arange(37), layout)
    out, lse = triton_decode.decode_attention(q, k, v, causal=True, q_pos=q_pos, kv_pos=kv_pos, num_splits=2)
    assert_matches(out, lse, *reference(q, k, v, causal=True, q_pos=q_pos, kv_pos=kv_pos), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_paged_kernel(triton_decode, layout, dtype):
    """Pools, block table and sequence lengths in every layout class."""
    block_size, num_blocks = 8, 6
    q = relayout(randn((B, 1, HQ, D), 0, dtype), layout)
    k_pool = relayout(randn((num_blocks, block_size, HKV, D), 1, dtype), layout)
    v_pool = relayout(randn((num_blocks, block_size, HKV, D), 2, dtype), layout)
    table = relayout_index(torch.tensor([[4, 0, 2], [5, 1, 3]], dtype=torch.int32), layout)
    seq_lens = relayout_index(torch.tensor([19, 24], dtype=torch.int32), layout)
    out, lse = triton_decode.paged_decode_attention(q, k_pool, v_pool, table, seq_lens, num_splits=2)
    refs = []
    for b in range(B):
        n = int(seq_lens[b])
        keys = k_pool[table[b].long()].reshape(1, -1, HKV, D)[:, :n]
        values = v_pool[table[b].long()].reshape(1, -1, HKV, D)[:, :n]
        refs.append(reference(q[b : b + 1], keys, values))
    ref_out, ref_lse = torch.cat([r[0] for r in refs]), torch.cat([r[1] for r in refs])
    assert_matches(out, lse, ref_out, ref_lse, dtype)


# ------------------------------------------------------------------------- across ranks

P = 2
SHARD_LENGTHS = (23, 17)


def distributed_cases(rank: int):
    """entry -> fn(dtype, layout) -> ((out, lse) on this rank, float64 reference)."""

    def shards(dtype, layout, Sq, seed=0):
        q = relayout(randn((B, Sq, HQ, D), seed, dtype), layout)
        ks = [relayout(randn((B, n, HKV, D), seed + 10 + r, dtype), layout) for r, n in enumerate(SHARD_LENGTHS)]
        vs = [relayout(randn((B, n, HKV, D), seed + 20 + r, dtype), layout) for r, n in enumerate(SHARD_LENGTHS)]
        return q, ks, vs

    def tree(method):
        def run(dtype, layout):
            q, ks, vs = shards(dtype, layout, 1)
            out = ta.tree_decode(q, ks[rank], vs[rank], method=method, topology=ta.Topology(1))
            return out, reference(q, torch.cat(ks, 1), torch.cat(vs, 1))
        return run

    def ring(pass_kv):
        def run(dtype, layout):
            q, ks, vs = shards(dtype, layout, 3)
            offsets = [0, SHARD_LENGTHS[0]]
            kv_pos = [relayout_index(torch.arange(n) + o, layout) for n, o in zip(SHARD_LENGTHS, offsets)]
            q_pos = relayout_index(torch.tensor([12, 25, 39]), layout)
            out = ta.ring_decode(q, ks[rank], vs[rank], q_pos=q_pos, kv_pos=kv_pos[rank], pass_kv=pass_kv)
            ref = reference(q, torch.cat(ks, 1), torch.cat(vs, 1), causal=True, q_pos=q_pos, kv_pos=torch.cat(kv_pos))
            return out, ref
        return run

    def ring_attention(dtype, layout):
        qs = [relayout(randn((B, n, HQ, D), 30 + r, dtype), layout) for r, n in enumerate(SHARD_LENGTHS)]
        _, ks, vs = shards(dtype, layout, 1)
        out = ta.ring_attention(qs[rank], ks[rank], vs[rank], causal=True)
        ref_out, ref_lse = reference(torch.cat(qs, 1), torch.cat(ks, 1), torch.cat(vs, 1), causal=True)
        mine = slice(sum(SHARD_LENGTHS[:rank]), sum(SHARD_LENGTHS[: rank + 1]))
        return out, (ref_out[:, mine], ref_lse[:, :, mine])

    def sharded_bifurcated(dtype, layout):
        q, decode_k, decode_v = qkv(1, 5, dtype, layout, seed=40, batch=3)
        _, ks, vs = shards(dtype, layout, 1)
        context_k, context_v = [t[:1] for t in ks], [t[:1] for t in vs]
        out = ta.sharded_bifurcated_attention(q, context_k[rank], context_v[rank], decode_k, decode_v)
        k = torch.cat([torch.cat(context_k, 1).expand(3, -1, -1, -1), decode_k], dim=1)
        v = torch.cat([torch.cat(context_v, 1).expand(3, -1, -1, -1), decode_v], dim=1)
        return out, reference(q, k, v)

    return {
        "tree_decode allreduce": tree("allreduce"),
        "tree_decode tree": tree("tree"),
        "tree_decode twolevel": tree("twolevel"),
        "ring_decode pass-KV": ring(True),
        "ring_decode pass-Q": ring(False),
        "ring_attention": ring_attention,
        "sharded_bifurcated_attention": sharded_bifurcated,
    }


def distributed_worker(rank: int, world: int) -> dict:
    """Every distributed entry x layout x dtype on this rank: the assertion error, or None."""
    torch.set_num_threads(1)
    failures = {}
    for entry, run in distributed_cases(rank).items():
        for layout in LAYOUTS:
            for dtype in DTYPES:
                (out, lse), (ref_out, ref_lse) = run(dtype, layout)
                try:
                    assert_matches(out, lse, ref_out, ref_lse, dtype)
                    failures[entry, layout, str(dtype)] = None
                except AssertionError as exc:
                    failures[entry, layout, str(dtype)] = str(exc).splitlines()[0:4]
    return failures


@pytest.fixture(scope="module")
def distributed_results():
    return ta.spawn(distributed_worker, P, timeout=120)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("entry", list(distributed_cases(0)))
def test_distributed_entry_points(distributed_results, entry, layout, dtype):
    for rank, results in enumerate(distributed_results):
        assert results[entry, layout, str(dtype)] is None, f"rank {rank}: {results[entry, layout, str(dtype)]}"
