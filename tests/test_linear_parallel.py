"""treeattn.linear across ranks, on real gloo process groups, against the float64 reference.

Rank r holds the r-th contiguous chunk of one sequence; every rank must get its chunk's outputs of
causal (or non-causal) linear attention over the whole sequence, and the state of the whole
sequence, from which it decodes a next token with no communication. p = 1..5; chunks even,
uneven, with empty ranks, all empty; GQA and MQA; float32 and bfloat16; elu, relu and Hedgehog
maps; both state exchanges (all-gather, scan). One spawn of 5 ranks runs every case, p < 5 on the
sub-group of the first p ranks (process start-up dominates the cost), and reports back; the parent
asserts per case. Tolerances as in test_linear.py (sums of non-negative kernel values
in float32, plus the final rounding to the input dtype).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import treeattn as ta
from treeattn.linear import HedgehogFeatureMap, reference_linear_attention

EPS = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -8}
LAYOUTS = {
    "even": lambda p: [3] * p,
    "uneven": lambda p: [[0, 7, 1, 12, 2][r] if p > 1 else 9 for r in range(p)],
    "last-empty": lambda p: [5] * (p - 1) + [0] if p > 1 else [0],
    "empty": lambda p: [0] * p,
}
COMBOS = {  # (feature map, dtype, causal, Hq, Hkv)
    "elu-f32-gqa": ("elu", torch.float32, True, 4, 2),
    "relu-bf16-mqa": ("relu", torch.bfloat16, True, 2, 1),
    "hedgehog-f32-gqa": ("hedgehog", torch.float32, True, 4, 2),
    "hedgehog-bf16-mha": ("hedgehog", torch.bfloat16, True, 2, 2),
    "elu-f32-gqa-noncausal": ("elu", torch.float32, False, 4, 2),
}
D, Dv, B = 8, 4, 2


def feature_map(name: str, Hkv: int):
    if name != "hedgehog":
        return name
    fm = HedgehogFeatureMap(Hkv, D, feature_dim=5)
    with torch.no_grad():
        fm.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(11))
        fm.bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(12))
    return fm


def tolerance(dtype, S, F, v) -> float:
    vmax = v.abs().max().item() if v.numel() else 1.0
    return 4 * (S + F) * EPS[torch.float32] * vmax + 2 * EPS[dtype] * vmax


def run_cases(rank: int, world: int, group) -> list[tuple[str, float, float]]:
    """Every case on the `world` ranks of `group` (this rank is its `rank`)."""
    results = []
    for i, (layout, lengths_of) in enumerate(LAYOUTS.items()):
        lengths = lengths_of(world)
        S, start = sum(lengths), sum(lengths[:rank])
        mine = slice(start, start + lengths[rank])
        for j, (combo, (fm_name, dtype, causal, Hq, Hkv)) in enumerate(COMBOS.items()):
            for method in [("allgather", "scan")[(i + j) % 2]]:  # each layout and combo meets both methods
                case = f"p={world} {layout} {combo} {method}"
                g = torch.Generator().manual_seed(S + Hq)
                q = torch.randn(B, S + 1, Hq, D, generator=g).to(dtype)  # the last token is decoded afterwards
                k = torch.randn(B, S + 1, Hkv, D, generator=g).to(dtype)
                v = torch.randn(B, S + 1, Hkv, Dv, generator=g).to(dtype)
                fm = feature_map(fm_name, Hkv)
                out, state = ta.linear_attention(q[:, mine], k[:, mine], v[:, mine], feature_map=fm, causal=causal,
                                                 group=group, method=method, return_state=True, chunk=4)
                ref = reference_linear_attention(q[:, :S], k[:, :S], v[:, :S], feature_map=fm, causal=causal)
                tol = tolerance(dtype, S, 2 * D, v)
                assert out.dtype == dtype and out.shape == (B, lengths[rank], Hq, Dv), case
                results.append((case, (out.double() - ref[:, mine]).abs().max().item() if out.numel() else 0.0, tol))
                # decode the next token from the total state: identical on every rank, no communication
                with ta.comm_stats() as stats:
                    step = ta.linear_attention(q[:, S:], k[:, S:], v[:, S:], feature_map=fm, initial_state=state)
                assert stats.bytes_sent == 0 and stats.calls == 0, case
                ref_step = reference_linear_attention(q, k, v, feature_map=fm)[:, S:]
                results.append((case + " decode", (step.double() - ref_step).abs().max().item(), tol))
    return results


def disagreeing_inputs(rank: int, group) -> list[str]:
    """Ranks that disagree raise the same ValueError on every rank instead of hanging (2 ranks)."""
    messages = []
    q = torch.randn(1, 3, 2, D, dtype=torch.bfloat16 if rank == 1 else torch.float32)
    for call in (
        lambda: ta.linear_attention(q, q[:, :, :1], q[:, :, :1], group=group),  # dtype differs on rank 1
        lambda: ta.linear_attention(q.float(), q.float()[:, :, :1], q.float()[:, :, :1], group=group,
                                    method="scan" if rank == 0 else "allgather"),
        lambda: ta.linear_attention(q.float() if rank == 0 else q.float()[0], q.float()[:, :, :1], q.float()[:, :, :1],
                                    group=group),  # rank 1's q is 3-d
    ):
        try:
            call()
            messages.append("no error")
        except ValueError as exc:
            messages.append(str(exc))
    return messages


WORLDS = [1, 2, 3, 4, 5]


def every_case(rank: int, world_size: int) -> dict:
    """One spawn for every p (process start-up dominates): p -> this rank's cases on the first p ranks
    (the ranks past p skip them), and "disagree" -> the disagreements on the first 2 ranks."""
    groups = {p: dist.new_group(list(range(p))) for p in WORLDS[:-1]}  # every rank creates every group, in order
    groups[world_size] = dist.group.WORLD
    # the largest p first: a rank done with its groups then waits for nothing in a collective
    out = {p: run_cases(rank, p, groups[p]) for p in reversed(WORLDS) if rank < p}
    out["disagree"] = disagreeing_inputs(rank, groups[2]) if rank < 2 else None
    return out


@pytest.fixture(scope="module")
def outcomes() -> list[dict]:
    return ta.spawn(every_case, WORLDS[-1], timeout=120)


@pytest.mark.parametrize("world", WORLDS)
def test_sharded_linear_attention_matches_reference(world, outcomes):
    results = [ranks[world] for ranks in outcomes[:world]]
    assert all(world not in ranks for ranks in outcomes[world:])
    failures = [(rank, case, err, tol) for rank, rows in enumerate(results) for case, err, tol in rows if not err <= tol]
    assert not failures, failures[:5]
    assert all(len(rows) == 2 * len(LAYOUTS) * len(COMBOS) for rows in results)


def test_disagreeing_ranks_raise_the_same_error(outcomes):
    rank0, rank1 = (ranks["disagree"] for ranks in outcomes[:2])
    assert "every rank must pass the same dtype" in rank0[0] and rank0[0] == rank1[0]
    assert "every rank must pass the same method" in rank0[1] and rank0[1] == rank1[1]
    assert rank1[2].startswith("q must have 4 dims") and "rank(s) [1] rejected their local inputs" in rank0[2]
