"""ta.sharded_bifurcated_attention on real gloo groups of p = 1, 2, 3 ranks.

One spawn of 3 ranks runs every case: the world group is p = 3, and subgroups of ranks [0] and
[0, 1] give p = 1 and p = 2 (which also exercises an explicit, non-default group). Each rank
returns its states; the parent compares them with float64 attention over each sample's
[context, decoded] K/V and checks that all ranks hold the same result.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

import treeattn as ta

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}
HEADS = {"MHA": (8, 8), "GQA": (8, 2), "MQA": (8, 1)}
METHODS = ("allreduce", "tree", "twolevel")
MC = 29  # context length, split unevenly (empty shards included) across the ranks


def exact_cases():
    """(n, heads, dtype, Md): the issue's grid."""
    return list(itertools.product([1, 2, 17], list(HEADS), [torch.float32, torch.bfloat16], [0, 1, 100]))


def shard_bounds(p: int, case_index: int) -> list[tuple[int, int]]:
    """Uneven contiguous shards of the MC context positions, rotating with the case; for p = 3
    every third case has an empty shard."""
    cuts = {1: [[]], 2: [[0], [11], [29]], 3: [[0, 7], [5, 5], [13, 29]]}[p]
    c = cuts[case_index % len(cuts)]
    edges = [0, *c, MC]
    return list(zip(edges[:-1], edges[1:]))


def make_case(n, heads, dtype, Md, Sq=1, seed=0):
    Hq, Hkv = HEADS[heads]
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    D = 16
    return randn(n, Sq, Hq, D), randn(1, MC, Hkv, D), randn(1, MC, Hkv, D), randn(n, Md, Hkv, D), randn(n, Md, Hkv, D)


def positioned_case(seed):
    """Sq = 3 speculative queries with explicit positions; sample 1's queries start inside the context."""
    q, ck, cv, dk, dv = make_case(2, "GQA", torch.float32, 4, Sq=3, seed=seed)
    q_pos = torch.tensor([[MC + 1, MC + 2, MC + 3], [MC - 5, MC + 2, MC + 3]])
    return q, ck, cv, dk, dv, q_pos, torch.arange(MC), torch.arange(4) + MC


def run_cases(rank, world_size):
    torch.set_num_threads(1)  # 3 ranks share 2 cores
    groups = {1: dist.new_group([0]), 2: dist.new_group([0, 1]), 3: None}
    results = {}
    for p, group in groups.items():
        if rank >= p:
            continue
        for i, (n, heads, dtype, Md) in enumerate(exact_cases()):
            q, ck, cv, dk, dv = make_case(n, heads, dtype, Md, seed=i)
            lo, hi = shard_bounds(p, i)[rank]
            method = METHODS[i % 3] if p == 3 else METHODS[i % 2]
            topology = ta.Topology(ranks_per_node=1 + 2 * (i % 2)) if method == "twolevel" else None  # p = 3: 1 or 3 per node
            results[(p, "grid", i)] = ta.sharded_bifurcated_attention(
                q, ck[:, lo:hi], cv[:, lo:hi], dk, dv, group=group, method=method, topology=topology
            )
        for i in range(3):
            q, ck, cv, dk, dv, q_pos, context_pos, decode_pos = positioned_case(seed=100 + i)
            lo, hi = shard_bounds(p, i)[rank]
            results[(p, "positions", i)] = ta.sharded_bifurcated_attention(
                q, ck[:, lo:hi], cv[:, lo:hi], dk, dv, group=group, q_pos=q_pos,
                context_pos=context_pos[lo:hi], decode_pos=decode_pos, method=METHODS[i % 2],
            )
        # Sq = 2 without positions: the queries are the last 2 decoded tokens
        q, ck, cv, dk, dv = make_case(3, "MQA", torch.float32, 5, Sq=2, seed=7)
        lo, hi = shard_bounds(p, 1)[rank]
        results[(p, "speculative", 0)] = ta.sharded_bifurcated_attention(q, ck[:, lo:hi], cv[:, lo:hi], dk, dv, group=group)

    # bad input on the world group: every rank must raise, none may hang
    errors = {}
    q, ck, cv, dk, dv = make_case(2, "GQA", torch.float32, 3)
    lo, hi = shard_bounds(3, 0)[rank]
    shard_k, shard_v = ck[:, lo:hi], cv[:, lo:hi]
    short = 2 if rank == 1 else 3
    bad_inputs = {
        "Md differs on rank 1": (q, shard_k, shard_v, dk[:, :short], dv[:, :short], {}),
        "dtype on rank 2": (q, shard_k, shard_v, dk.bfloat16() if rank == 2 else dk, dv, {}),
        "q_pos without context_pos": (q, shard_k, shard_v, dk, dv, {"q_pos": torch.tensor([40])}),
        "Sq > Md + 1 without positions": (q.expand(2, 5, -1, -1), shard_k, shard_v, dk, dv, {}),
        "n = 0": (q[:0], shard_k, shard_v, dk[:0], dv[:0], {}),
    }
    for name, (*tensors, kwargs) in bad_inputs.items():
        try:
            ta.sharded_bifurcated_attention(*tensors, **kwargs)
            errors[name] = None
        except (ValueError, TypeError) as exc:
            errors[name] = (type(exc).__name__, str(exc))
    return results, errors


def concatenated(ck, cv, dk, dv):
    n = dk.shape[0]
    return torch.cat([ck.expand(n, -1, -1, -1), dk], 1), torch.cat([cv.expand(n, -1, -1, -1), dv], 1)


def assert_state_close(out, lse, ref_out, ref_lse, dtype):
    tol = TOL[dtype]
    assert out.dtype == dtype and out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=max(tol, 1e-6), atol=max(tol, 1e-5))
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol * max(1.0, ref_out.abs().max().item()))


@pytest.fixture(scope="module")
def spawned():
    return ta.spawn(run_cases, 3, timeout=60)


def test_sharded_matches_attention_over_concatenated_kv(spawned):
    references = {}
    for i, (n, heads, dtype, Md) in enumerate(exact_cases()):
        q, ck, cv, dk, dv = make_case(n, heads, dtype, Md, seed=i)
        references[("grid", i)] = (ta.reference_attention(q, *concatenated(ck, cv, dk, dv), causal=True), dtype)
    for i in range(3):
        q, ck, cv, dk, dv, q_pos, context_pos, decode_pos = positioned_case(seed=100 + i)
        kv_pos = torch.cat([context_pos, decode_pos]).expand(2, -1)
        ref = ta.reference_attention(q, *concatenated(ck, cv, dk, dv), causal=True, q_pos=q_pos, kv_pos=kv_pos)
        references[("positions", i)] = (ref, torch.float32)
    q, ck, cv, dk, dv = make_case(3, "MQA", torch.float32, 5, Sq=2, seed=7)
    references[("speculative", 0)] = (ta.reference_attention(q, *concatenated(ck, cv, dk, dv), causal=True), torch.float32)

    checked = 0
    for p in (1, 2, 3):
        for key, (ref, dtype) in references.items():
            states = [spawned[rank][0][(p, *key)] for rank in range(p)]
            assert_state_close(*states[0], *ref, dtype)
            for out, lse in states[1:]:  # every rank holds the same result
                assert torch.equal(out, states[0][0]) and torch.equal(lse, states[0][1])
            checked += 1
    assert checked == 3 * (len(exact_cases()) + 4)


def test_sharded_bad_input_raises_on_every_rank(spawned):
    errors = [spawned[rank][1] for rank in range(3)]
    md = [e["Md differs on rank 1"] for e in errors]
    assert all(kind == "ValueError" and "every rank must pass the same Md" in msg and "rank 1: 2" in msg for kind, msg in md)
    dtype = [e["dtype on rank 2"] for e in errors]
    assert dtype[2][0] == "TypeError" and "decode_k must have the dtype of q" in dtype[2][1]
    assert all(kind == "ValueError" and "rank(s) [2] rejected" in msg for kind, msg in dtype[:2])
    for e in errors:
        kind, msg = e["q_pos without context_pos"]
        assert kind == "ValueError" and "also needs context_pos and decode_pos" in msg
        kind, msg = e["Sq > Md + 1 without positions"]
        assert kind == "ValueError" and "Sq <= Md + 1" in msg
        kind, msg = e["n = 0"]
        assert kind == "ValueError" and "n >= 1" in msg

