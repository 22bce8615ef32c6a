"""Sequence-parallel decoding and prefill on real gloo process groups.

Every method of tree_decode, both rings of ring_decode and ring_attention are compared with the
float64 oracle and with single-device ta.attention over the concatenated KV, for p in
{1, 2, 3, 8}, shard lengths 0, 1, uneven (one rank holding 90%) and all-empty, B in {1, 3},
GQA and MQA, float32, bfloat16 and float16, huge logits (past onepass's window too), Sq = 1, and Sq = 4 with q_pos/kv_pos and
keys sharded
round-robin. comm_stats is checked against the paper's volumes (eq. 10 and 14) and round counts.
The p = 2 ranks also run the collectives' docstring examples (tests/helpers/doc_examples.py).

One spawn per world size runs every case (process start-up dominates the cost); each case reports
back to the parent, which asserts per case so a failure names its case.
"""

from __future__ import annotations

import functools
import hashlib
import math
import traceback
import zlib

import pytest
import torch

from helpers.doc_examples import IN_RANKS, run_examples

import treeattn as ta
from treeattn.parallel.tree_decode import ONEPASS_WINDOW

WORLD_SIZES = [1, 2, 3, 8]  # 3: not a power of two; 8: three tree rounds (5 ran too until CI neared 20 minutes)
# The volume and round counts, from the same spawns (a p missing from WORLD_SIZES would cost a spawn of
# its own running every case): 2 one tree level, 3 an incomplete tree, 8 three levels.
COMM_WORLD_SIZES = [2, 3, 8]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}

# ------------------------------------------------------------------------------ case tables


def layout_lengths(layout: str, p: int) -> list[int]:
    """KV tokens held by each rank (contiguous chunks in rank order)."""
    if layout == "even":
        return [4] * p
    if layout == "zero":  # rank 0 holds nothing
        return [0] + [5] * (p - 1)
    if layout == "one":
        return [1] * p
    if layout == "empty":  # no rank holds a key: every row is (0, -inf)
        return [0] * p
    if layout == "uneven":  # the last rank holds 90% of the keys
        total = 20 * p
        big = int(0.9 * total)
        rest = [(total - big) // (p - 1) + (1 if i < (total - big) % (p - 1) else 0) for i in range(p - 1)] if p > 1 else []
        return rest + [big if p > 1 else total]
    raise ValueError(layout)


LAYOUTS = ["even", "zero", "one", "uneven", "empty"]
# Shape/dtype combinations; each runs with every layout and method. "pos": Sq = 4 with positions
# ("1d": q_pos (Sq,), kv_pos (Sk,); "2d": (B, Sq), (B, Sk)) and keys dealt round-robin.
COMBOS = {
    "b1-gqa-f32": dict(B=1, Hq=4, Hkv=2, dtype=torch.float32, Sq=1, pos=None),
    "b3-mqa-bf16": dict(B=3, Hq=4, Hkv=1, dtype=torch.bfloat16, Sq=1, pos=None),
    "b3-gqa-f32-spec": dict(B=3, Hq=4, Hkv=2, dtype=torch.float32, Sq=4, pos="1d"),
    "b1-mqa-bf16-spec": dict(B=1, Hq=6, Hkv=1, dtype=torch.bfloat16, Sq=4, pos="2d"),
    "b3-gqa-f16": dict(B=3, Hq=4, Hkv=2, dtype=torch.float16, Sq=1, pos=None),
    # huge logits (|scores| in the hundreds): the merge must not overflow exp()
    "b1-mha-f32-hot": dict(B=1, Hq=2, Hkv=2, dtype=torch.float32, Sq=1, pos=None, logit_scale=100.0),
    # |scores| in the thousands: past onepass's float64 window, so it must take its fallback
    "b1-gqa-f32-blazing": dict(B=1, Hq=4, Hkv=2, dtype=torch.float32, Sq=1, pos=None, logit_scale=1000.0),
}


def methods(p: int) -> list[str]:
    found = ["allreduce", "tree", "twolevel", "onepass", "ring_kv", "ring_q"]
    # twolevel with explicit nodes: two nodes or more whenever p allows it, one rank per node for odd p
    if p % 2 == 0:
        found.append("twolevel-2")
    if p == 8:
        found.append("twolevel-4")
    if p in (3, 5):
        found.append("twolevel-1")
    return found


def decode_cases(p: int) -> list[tuple[str, str, str]]:
    """The full grid for p <= 3. For p = 5, 8 (slow on 2 cores: p processes per collective) every
    layout meets every method, with the combos rotated so each method still sees all of them."""
    if p <= 3:
        return [(layout, combo, method) for layout in LAYOUTS for combo in COMBOS for method in methods(p)]
    names = list(COMBOS)
    return [
        (layout, names[(i + j) % len(names)], method)
        for i, layout in enumerate(LAYOUTS)
        for j, method in enumerate(methods(p))
    ]


RING_ATTENTION_CASES = ["contiguous-uneven", "contiguous-zero", "striped-positions", "striped-2d-bf16", "noncausal"]


def case_ids(p: int) -> list[str]:
    ids = [f"decode/{layout}/{combo}/{method}" for layout, combo, method in decode_cases(p)]
    ids += [f"ring_attention/{name}" for name in RING_ATTENTION_CASES]
    return ids


# --------------------------------------------------------------------------- worker (ranks)


def full_problem(layout: str, combo: dict, p: int, seed: int):
    """The whole problem (same on every rank) and each rank's token indices."""
    g = torch.Generator().manual_seed(seed)
    lengths = layout_lengths(layout, p)
    N = sum(lengths)
    B, Hq, Hkv, Sq, D = combo["B"], combo["Hq"], combo["Hkv"], combo["Sq"], 16
    q = (torch.randn(B, Sq, Hq, D, generator=g) * combo.get("logit_scale", 1.0)).to(combo["dtype"])
    k = torch.randn(B, N, Hkv, D, generator=g).to(combo["dtype"])
    v = torch.randn(B, N, Hkv, D + 8, generator=g).to(combo["dtype"])  # Dv != D
    if combo["pos"] is None:
        starts = [sum(lengths[:r]) for r in range(p)]
        owned = [torch.arange(starts[r], starts[r] + lengths[r]) for r in range(p)]
    else:
        owned = [torch.arange(N)[r::p] for r in range(p)]  # round-robin
    return q, k, v, owned


def run_decode_case(rank: int, p: int, layout: str, combo_name: str, method: str):
    combo = COMBOS[combo_name]
    q, k, v, owned = full_problem(layout, combo, p, seed=zlib.crc32(f"{layout}/{combo_name}".encode()))
    N, mine = k.shape[1], owned[rank]
    kwargs, ref_kwargs = {}, {}
    if combo["pos"] is not None:
        q_pos = torch.arange(N - combo["Sq"], N)  # the draft tokens are the last Sq keys
        kv_pos = mine
        if combo["pos"] == "2d":
            q_pos, kv_pos = q_pos.expand(q.shape[0], -1), kv_pos.expand(q.shape[0], -1)
        kwargs = dict(q_pos=q_pos, kv_pos=kv_pos)
        ref_kwargs = dict(causal=True, q_pos=torch.arange(N - combo["Sq"], N), kv_pos=torch.arange(N))
    k_local, v_local = k[:, mine], v[:, mine]
    if method == "ring_kv":
        out, lse = ta.ring_decode(q, k_local, v_local, pass_kv=True, **kwargs)
    elif method == "ring_q":
        out, lse = ta.ring_decode(q, k_local, v_local, pass_kv=False, **kwargs)
    elif method.startswith("twolevel-"):
        topology = ta.Topology(ranks_per_node=int(method.split("-")[1]))
        out, lse = ta.tree_decode(q, k_local, v_local, method="twolevel", topology=topology, **kwargs)
    else:
        out, lse = ta.tree_decode(q, k_local, v_local, method=method, **kwargs)

    assert out.shape == (q.shape[0], q.shape[1], q.shape[2], v.shape[3]) and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    ref_out, ref_lse = ta.reference_attention(q, k, v, **ref_kwargs)
    single_out, single_lse = ta.attention(q, k, v, **ref_kwargs)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "rows that see no key differ"
    finite = torch.isfinite(ref_lse)
    tol = TOL[q.dtype]
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=1e-5, atol=1e-4)
    if combo.get("logit_scale") and finite.any():
        assert ref_lse[finite].abs().max() > 50, "the hot combo must produce huge logits"
        if combo["logit_scale"] >= 1000:
            assert ref_lse[finite].abs().max() > ONEPASS_WINDOW, "the blazing combo must push onepass to its fallback"
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(out.float(), single_out.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse[finite], single_lse[finite], rtol=1e-5, atol=1e-4)
    assert (out[~finite.transpose(1, 2)] == 0).all(), "a row that sees no key must be 0"
    return digest(out, lse)


def run_ring_attention_case(rank: int, p: int, name: str):
    g = torch.Generator().manual_seed(7)
    B, Hq, Hkv, D = (3, 4, 2, 16) if "bf16" not in name else (1, 4, 1, 16)
    dtype = torch.bfloat16 if "bf16" in name else torch.float32
    lengths = layout_lengths("uneven" if "uneven" in name else "zero" if "zero" in name else "even", p)
    N = sum(lengths)
    q = torch.randn(B, N, Hq, D, generator=g).to(dtype)
    k = torch.randn(B, N, Hkv, D, generator=g).to(dtype)
    v = torch.randn(B, N, Hkv, D, generator=g).to(dtype)
    causal = name != "noncausal"
    ref_out, ref_lse = ta.reference_attention(q, k, v, causal=causal)  # token i at position i
    if name.startswith("striped"):
        mine = torch.arange(N)[rank::p]
        pos = mine.expand(B, -1) if "2d" in name else mine
        out, lse = ta.ring_attention(q[:, mine], k[:, mine], v[:, mine], q_pos=pos, kv_pos=pos)
    else:
        start = sum(lengths[:rank])
        mine = torch.arange(start, start + lengths[rank])
        out, lse = ta.ring_attention(q[:, mine], k[:, mine], v[:, mine], causal=causal)
    tol = TOL[dtype]
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.double(), ref_out[:, mine], rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), ref_lse[:, :, mine], rtol=1e-5, atol=1e-4)
    return None


def digest(out: torch.Tensor, lse: torch.Tensor) -> str:
    h = hashlib.sha1(out.float().contiguous().numpy().tobytes())
    h.update(lse.contiguous().numpy().tobytes())
    return h.hexdigest()


def comm_cases(rank: int, p: int) -> dict:
    """Run each op once inside comm_stats (check_inputs=False: only the algorithm's traffic)."""
    g = torch.Generator().manual_seed(3)
    b, Hq, D, t = 2, 4, 16, 6  # MHA (Hkv = Hq) as in the paper's d = Hq * D
    q = torch.randn(b, 1, Hq, D, generator=g)
    k = torch.randn(b, t, Hq, D, generator=g)
    v = torch.randn(b, t, Hq, D, generator=g)
    runs = {
        "allreduce": lambda: ta.tree_decode(q, k, v, method="allreduce", check_inputs=False),
        "onepass": lambda: ta.tree_decode(q, k, v, method="onepass", check_inputs=False),
        "tree": lambda: ta.tree_decode(q, k, v, method="tree", check_inputs=False),
        "twolevel": lambda: ta.tree_decode(q, k, v, method="twolevel", topology=ta.Topology(2 if p % 2 == 0 else 1),
                                           check_inputs=False),
        "ring_kv": lambda: ta.ring_decode(q, k, v, pass_kv=True, check_inputs=False),
        "ring_q": lambda: ta.ring_decode(q, k, v, pass_kv=False, check_inputs=False),
        "checked": lambda: ta.tree_decode(q, k, v, method="allreduce"),
    }
    stats = {}
    for name, run in runs.items():
        with ta.comm_stats() as recorded:
            run()
        stats[name] = recorded.as_dict()
    return stats


def nested_spawn_case(rank: int, p: int):
    """Inside an initialized group, spawn runs fn in this process (the torchrun path)."""
    results = ta.spawn(_echo_rank, p)
    assert results[rank] == ("echo", rank, p)
    assert all(r is None for i, r in enumerate(results) if i != rank)


def _echo_rank(rank, world_size):
    return ("echo", rank, world_size)


def worker(rank: int, p: int) -> dict:
    torch.set_num_threads(1)
    report = {"cases": {}, "comm": None}

    def record(case_id, fn):
        try:
            report["cases"][case_id] = ("ok", fn())
        except Exception:  # noqa: BLE001 -- reported per case to the parent
            report["cases"][case_id] = ("error", traceback.format_exc())

    for layout, combo, method in decode_cases(p):
        record(f"decode/{layout}/{combo}/{method}", functools.partial(run_decode_case, rank, p, layout, combo, method))
    for name in RING_ATTENTION_CASES:
        record(f"ring_attention/{name}", functools.partial(run_ring_attention_case, rank, p, name))
    record("nested_spawn", functools.partial(nested_spawn_case, rank, p))
    report["comm"] = comm_cases(rank, p)
    if p == 2:  # the collectives' docstring examples are written for these ranks: group=None, the world
        report["doc_examples"] = run_examples(IN_RANKS)
    return report


# ---------------------------------------------------------------------------- parent (pytest)


@functools.lru_cache(maxsize=None)
def reports(p: int) -> list[dict]:
    return ta.spawn(worker, p, timeout=60)


@pytest.mark.parametrize("p", WORLD_SIZES)
def test_cases_exact_and_identical_on_every_rank(p):
    per_rank = reports(p)
    failures = []
    for case_id in case_ids(p) + ["nested_spawn"]:
        outcomes = [r["cases"][case_id] for r in per_rank]
        errors = [f"rank {i}: {o[1]}" for i, o in enumerate(outcomes) if o[0] != "ok"]
        if errors:
            failures.append(f"{case_id}\n" + "\n".join(errors))
        elif case_id.startswith("decode/") and len({o[1] for o in outcomes}) != 1:
            failures.append(f"{case_id}: out/lse differ between ranks")
    assert not failures, f"{len(failures)} of {len(case_ids(p)) + 1} cases failed:\n" + "\n\n".join(failures[:5])


def test_collectives_docstring_examples_run_on_two_ranks():
    """The examples in the docstrings of tree_decode, ring_decode, ring_attention, comm_stats and
    sharded_bifurcated_attention (tests/test_docstring_examples.py runs every other name's) run on
    these 2 gloo ranks and show what they say."""
    for rank, report in enumerate(reports(2)):
        missing, failures = report["doc_examples"]
        assert not missing, f"rank {rank}: no example in {missing}"
        assert not failures, f"rank {rank}: {failures}"


def test_case_table_covers_the_issue():
    """The grid above is what the issue asks for; guard it against silent shrinking."""
    lengths = {layout: layout_lengths(layout, 5) for layout in LAYOUTS}
    assert 0 in lengths["zero"] and set(lengths["one"]) == {1} and set(lengths["empty"]) == {0}
    assert max(lengths["uneven"]) >= 0.9 * sum(lengths["uneven"])
    combos = COMBOS.values()
    assert {c["B"] for c in combos} == {1, 3} and {c["Hkv"] for c in combos} == {1, 2}
    assert {c["dtype"] for c in combos} == {torch.float32, torch.bfloat16, torch.float16} and {c["Sq"] for c in combos} == {1, 4}


ITEM = 4  # float32 bytes


@pytest.mark.parametrize("p", COMM_WORLD_SIZES)
def test_allreduce_volume_is_eq14(p):
    """Two allreduces of b*Hq (max) and b*d + b*Hq (packed sums) elements: eq. 13's b*d + 2*b*Hq
    elements, sent as 2 (p-1)/p of that under comm_stats' allreduce convention (eq. 12, 14)."""
    b, Hq, D = 2, 4, 16
    d = Hq * D
    for stats in (r["comm"]["allreduce"] for r in reports(p)):
        op = stats["by_op"]["allreduce"]
        assert op["calls"] == 2 and op["rounds"] == 2
        assert op["payload_bytes"] == (b * d + 2 * b * Hq) * ITEM
        assert op["bytes_sent"] == pytest.approx(2 * (p - 1) / p * (b * d + 2 * b * Hq) * ITEM)
        assert stats["rounds"] == 2 and stats["by_op"]["p2p"]["calls"] == 0  # nothing else moved


@pytest.mark.parametrize("p", COMM_WORLD_SIZES)
def test_onepass_is_one_allreduce(p):
    """onepass on ordinary logits: one Allreduce(sum) of the float64 [numerator, denominator, flag]
    buffer, b*d + b*Hq + 1 elements, and nothing else."""
    b, Hq, D = 2, 4, 16
    for stats in (r["comm"]["onepass"] for r in reports(p)):
        op = stats["by_op"]["allreduce"]
        assert op["calls"] == 1 and stats["rounds"] == 1
        assert op["payload_bytes"] == (b * Hq * D + b * Hq + 1) * 8


@pytest.mark.parametrize("p", COMM_WORLD_SIZES)
def test_ring_pass_kv_volume_is_eq10(p):
    """Each of the p - 1 ring steps moves a 2*b*t*d-element K/V block per rank: 2*b*t*d*p in all."""
    b, Hq, D, t = 2, 4, 16, 6
    d = Hq * D
    sent = [r["comm"]["ring_kv"]["by_op"]["p2p"] for r in reports(p)]
    for op in sent:
        assert op["rounds"] == p - 1
        assert op["messages"] == 2 * (p - 1)  # K and V
        assert op["bytes_sent"] == (p - 1) * 2 * b * t * d * ITEM
    assert sum(op["bytes_sent"] for op in sent) / (p - 1) == 2 * b * t * d * p * ITEM
    # the shard lengths are gathered once (receivers size their buffers)
    assert all(r["comm"]["ring_kv"]["by_op"]["allgather"]["calls"] == 1 for r in reports(p))


@pytest.mark.parametrize("p", COMM_WORLD_SIZES)
def test_tree_rounds_are_2_ceil_log2_p(p):
    b, Hq, D = 2, 4, 16
    state_bytes = (b * Hq * D + b * Hq) * ITEM
    ops = [r["comm"]["tree"]["by_op"]["p2p"] for r in reports(p)]
    assert ops[0]["rounds"] == 2 * math.ceil(math.log2(p))  # the root takes part in every round
    assert max(op["rounds"] for op in ops) == 2 * math.ceil(math.log2(p))
    assert sum(op["messages"] for op in ops) == 2 * (p - 1)  # every tree edge once up, once down
    assert sum(op["bytes_sent"] for op in ops) == 2 * (p - 1) * state_bytes
    assert all(r["comm"]["tree"]["rounds"] == op["rounds"] for r, op in zip(reports(p), ops))  # p2p only


@pytest.mark.parametrize("p", COMM_WORLD_SIZES)
def test_ring_pass_q_rounds_and_volume(p):
    b, Hq, D = 2, 4, 16
    state_bytes = (b * Hq * D + b * Hq) * ITEM
    for r in reports(p):
        op = r["comm"]["ring_q"]["by_op"]["p2p"]
        assert op["rounds"] == p - 1 and op["messages"] == p - 1
        assert op["bytes_sent"] == (p - 1) * state_bytes
        assert r["comm"]["ring_q"]["rounds"] == p - 1


@pytest.mark.parametrize("p", COMM_WORLD_SIZES)
def test_twolevel_only_leaders_cross_nodes(p):
    k = 2 if p % 2 == 0 else 1
    nodes = p // k
    for rank, r in enumerate(reports(p)):
        by_op = r["comm"]["twolevel"]["by_op"]
        leader = rank % k == 0
        assert by_op["allreduce"]["calls"] == (2 if leader and nodes > 1 else 0)
        assert by_op["broadcast"]["calls"] == (1 if k > 1 else 0)


@pytest.mark.parametrize("p", [2, 3])
def test_input_check_is_one_small_allgather(p):
    for r in reports(p):
        gathered = r["comm"]["checked"]["by_op"]["allgather"]
        assert gathered["calls"] == 1 and gathered["payload_bytes"] < 256
