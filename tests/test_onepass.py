"""tree_decode(method="onepass"): one collective in the common case, and a fallback that every
rank takes together, decided from the reduced buffer alone.

The exactness grid (p in {1, 2, 3, 5, 8}, empty/uneven shards, GQA/MQA, bf16/fp16, Sq = 4 with
positions, logits hot and past the window) is in test_parallel_decode.py with the other methods.
Here: the fallback when only ONE rank's state leaves the window (the others must follow it,
not hang), when every state underflows, the round counts of each path, and the bad inputs.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import treeattn as ta
from treeattn.parallel.tree_decode import ONEPASS_WINDOW

P = 3


def _problem(case: str, p: int):
    g = torch.Generator().manual_seed(11)
    B, Hq, Hkv, D, per_rank = 2, 4, 2, 16, 5
    q = torch.randn(B, 1, Hq, D, generator=g)
    k = torch.randn(B, per_rank * p, Hkv, D, generator=g)
    v = torch.randn(B, per_rank * p, Hkv, D, generator=g)
    if case == "one-rank-hot":  # only rank 1's keys give |scores| in the thousands
        k[:, per_rank : 2 * per_rank] *= 2000.0
    elif case == "all-underflow":  # every score about -2000: exp(lse) underflows even in float64
        q = q.abs() * 100.0
        k = -k.abs() * 100.0 / D**0.5
    return q, k, v, per_rank


def _run(rank: int, p: int, case: str):
    q, k, v, per_rank = _problem(case, p)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    with ta.comm_stats() as stats:
        out, lse = ta.tree_decode(q, k[:, mine], v[:, mine], method="onepass", check_inputs=False)
    ref_out, ref_lse = ta.reference_attention(q, k, v)
    torch.testing.assert_close(out.double(), ref_out, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-4)
    local_lse = ta.attention(q, k[:, mine], v[:, mine])[1]
    return {"rounds": stats.rounds, "calls": stats.by_op["allreduce"].calls,
            "outside": bool((local_lse.abs() > ONEPASS_WINDOW).any()), "ref_lse_max": float(ref_lse.abs().max())}


def _errors(rank: int, p: int):
    q, k, v, per_rank = _problem("common", p)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    found = {}
    try:  # a rank that asks for another method: every rank raises the same error, none hangs
        ta.tree_decode(q, k[:, mine], v[:, mine], method="onepass" if rank else "allreduce")
    except ValueError as exc:
        found["mismatch"] = str(exc)
    try:
        ta.tree_decode(q, k[:, mine], v[:, mine], method="onepass", check_inputs=False, graph_safe=True)
    except ValueError as exc:
        found["graph_safe"] = str(exc)
    return found


def _combine_states(rank: int) -> dict:
    """The states rank `rank` hands onepass_combine in _kernel_and_torch, by case and dtype: float32
    and float64, a row this rank does not see (lse = -inf), a hot rank (the fallback), a NaN state
    (the fallback, which keeps the NaN). Seeded by the rank alone, so the test can rebuild every rank's."""
    g = torch.Generator().manual_seed(100 + rank)
    states = {}
    for case in ("common", "hot", "nan"):
        for dtype in (torch.float32, torch.float64):
            out = torch.randn(2, 3, 4, 8, generator=g, dtype=dtype)
            lse = (torch.randn(2, 4, 3, generator=g) * 5).to(dtype)
            lse[0, 1, rank % 3] = float("-inf")  # each rank misses another row; row (0, 1, 0) is missed by rank 0 only
            out[0, rank % 3, 1] = 0.0
            if case == "hot" and rank == 1:
                lse[1, 2, 0] = 2 * ONEPASS_WINDOW
            if case == "nan" and rank == 2:
                out[1, 0, 0, 0] = float("nan")
            states[f"{case} {dtype}"] = (out, lse)
    return states


def _kernel_and_torch(rank: int, p: int) -> dict:
    """onepass_combine through the compiled CPU kernel and through torch (the kernel switched off), on
    the same states (_combine_states)."""
    td = importlib.import_module("treeattn.parallel.tree_decode")  # the module (the package exports its function)

    found = {}
    for name, (out, lse) in _combine_states(rank).items():
        assert td._combine_kernel(out, lse) is not None
        compiled = td.onepass_combine(out, lse, None if p == 1 else torch.distributed.group.WORLD)
        kernel, td._combine_kernel = td._combine_kernel, lambda out, lse: None
        try:
            eager = td.onepass_combine(out, lse, torch.distributed.group.WORLD)
        finally:
            td._combine_kernel = kernel
        found[name] = (compiled, eager)
    return found


def _worker(rank: int, p: int):
    torch.set_num_threads(1)
    return ({case: _run(rank, p, case) for case in ("common", "one-rank-hot", "all-underflow")}
            | {"errors": _errors(rank, p), "kernel": _kernel_and_torch(rank, p)})


@pytest.fixture(scope="module")
def reports():
    return ta.spawn(_worker, P, timeout=60)


def test_common_case_is_one_round(reports):
    for r in reports:
        assert r["common"]["rounds"] == 1 and r["common"]["calls"] == 1


def test_one_hot_rank_sends_every_rank_to_the_fallback(reports):
    hot = [r["one-rank-hot"] for r in reports]
    assert [h["outside"] for h in hot] == [False, True, False]  # only rank 1 saw a state outside the window
    assert all(h["rounds"] == 3 and h["calls"] == 3 for h in hot)  # all three took onepass + the two of allreduce


def test_underflow_takes_the_fallback(reports):
    for r in reports:
        case = r["all-underflow"]
        assert case["ref_lse_max"] > ONEPASS_WINDOW and case["rounds"] == 3


def test_bad_inputs_raise_on_every_rank(reports):
    messages = [r["errors"]["mismatch"] for r in reports]
    assert len(set(messages)) == 1 and "method" in messages[0] and "'onepass'" in messages[0]
    assert all("graph_safe" in r["errors"]["graph_safe"] and "onepass" in r["errors"]["graph_safe"] for r in reports)


def _combine_tolerance(states: list, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """How far two correct implementations of onepass's combine may lie apart, element by element,
    on the ranks' `states` [(out, lse), ...]: a bound from float64 rounding, not a chosen tolerance.

    The kernel and torch do the same operations in the same order (float64 exp of each lse, the
    product with out, one all-reduce summing the same buffer, the division, the log, one cast), but
    their exp and log are different functions: libm's in the compiled kernel, torch's vectorized
    ones (SLEEF) or libm's in torch, chosen by the host's CPU capability. Each is within 1 ulp
    (<= 2u relative, u = 2^-53), products and quotients round by u, a sum over P ranks by
    gamma_{P-1}. With w_r = exp(lse_r), D = sum w_r and M = sum |out_r| w_r / D (>= |out|), each
    path's out lies within e = (2P + 5) u M of the exact merge and its lse within
    (P + 2) u + 2 u |lse|; two paths lie within twice that, plus float32's rounding of each (u32 = 2^-24
    relative) when the states are float32. A row no rank sees (D = 0) must agree exactly (0, -inf)."""
    u, u32, P = 2.0**-53, 2.0**-24, len(states)
    weights = torch.stack([lse.double().exp() for _, lse in states])  # (P, B, Hq, Sq)
    magnitude = torch.stack([out.double().abs() * w.transpose(1, 2).unsqueeze(-1) for (out, _), w in zip(states, weights)])
    total = weights.sum(0)
    seen = total > 0
    scale = magnitude.sum(0) / torch.where(seen, total, torch.ones_like(total)).transpose(1, 2).unsqueeze(-1)  # M
    lse = torch.where(seen, total.log(), torch.zeros_like(total))
    out_error, lse_error = (2 * P + 5) * u * scale, (P + 2) * u + 2 * u * lse.abs()
    out_tol, lse_tol = 2 * out_error, 2 * lse_error
    if dtype == torch.float32:
        out_tol, lse_tol = out_tol + 2 * u32 * (scale + out_error), lse_tol + 2 * u32 * (lse.abs() + lse_error)
    return out_tol, torch.where(seen, lse_tol, torch.zeros_like(lse_tol))


def test_compiled_combine_agrees_with_torchs_to_rounding(reports):
    """The CPU kernel (ops.combine_cpu_kernel) and the torch path agree within float64 rounding
    (_combine_tolerance) in the one-pass case, on every host whatever its exp and log; the fallbacks
    (a hot rank, a NaN) are torch's own code on both paths, so the same bits, and the NaN stays."""
    states = [_combine_states(rank) for rank in range(P)]
    for r in reports:
        for name, ((out, lse), (out_ref, lse_ref)) in r["kernel"].items():
            assert out.dtype == out_ref.dtype and lse.dtype == lse_ref.dtype, name
            if name.startswith("common"):
                out_tol, lse_tol = _combine_tolerance([s[name] for s in states], out.dtype)
                assert ((out.double() - out_ref.double()).abs() <= out_tol).all(), name
                assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref)), name  # the rows no rank sees
                finite = torch.isfinite(lse_ref)
                assert ((lse.double() - lse_ref.double())[finite].abs() <= lse_tol[finite]).all(), name
            else:  # the fallback: allreduce_combine on both paths
                torch.testing.assert_close(out, out_ref, rtol=0, atol=0, equal_nan=True, msg=name)
                torch.testing.assert_close(lse, lse_ref, rtol=0, atol=0, equal_nan=True, msg=name)
            assert torch.equal(out.nan_to_num(), reports[0]["kernel"][name][0][0].nan_to_num()), name  # every rank alike
            assert torch.equal(lse.nan_to_num(), reports[0]["kernel"][name][0][1].nan_to_num()), name
    assert torch.isnan(reports[0]["kernel"]["nan torch.float32"][0][0]).any()  # a NaN is never hidden


def test_combine_tolerance_is_rounding_sized():
    """The bound above is a few dozen float64 ulps of the merged values' scale: it cannot hide a
    wrong merge, e.g. one rank's state counted twice."""
    states = [_combine_states(rank)["common torch.float64"] for rank in range(P)]
    out_tol, _ = _combine_tolerance(states, torch.float64)

    def merge(states):
        weights = [lse.double().exp() for _, lse in states]
        numerator = sum(o.double() * w.transpose(1, 2).unsqueeze(-1) for (o, _), w in zip(states, weights))
        return numerator / sum(weights).clamp_min(1e-300).transpose(1, 2).unsqueeze(-1)

    right, wrong = merge(states), merge(states + states[:1])
    assert out_tol.max() < 2 * (2 * P + 5) * 2.0**-53 * 10  # |out| < 10 in these states
    assert ((right - wrong).abs() > out_tol).any()


def test_engine_default_is_onepass_except_in_static_steps():
    from treeattn.engine.config import ConfigError, EngineConfig

    assert EngineConfig().method == "onepass"
    assert EngineConfig(decode_step="static").method == "allreduce"
    assert EngineConfig(method="tree", decode_step="static").method == "tree"
    with pytest.raises(ConfigError, match="onepass.*decode_step='static'") as raised:
        EngineConfig(method="onepass", decode_step="static")
    assert raised.value.option == "method"
