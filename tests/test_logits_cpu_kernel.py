"""ops.logits_cpu_kernel.reduce_chunk against float64 and torch: max, sum of exp, count above the target, top k."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("numba")

from treeattn.ops import logits_cpu_kernel as kernel  # noqa: E402


def reduce(logits: torch.Tensor, target: torch.Tensor, k: int, first: int = 0, values=None, ids=None):
    """reduce_chunk on fresh outputs (or the given running top k): (maxes, sums, larger, values, ids) as tensors."""
    n = logits.shape[0]
    maxes, sums, larger = (torch.empty(n) for _ in range(3))
    values = torch.full((n, k), -math.inf) if values is None else values
    ids = torch.zeros(n, k, dtype=torch.int64) if ids is None else ids
    kernel.reduce_chunk(logits.numpy(), target.numpy(), first, maxes.numpy(), sums.numpy(), larger.numpy(),
                        values.numpy(), ids.numpy())
    return maxes, sums, larger, values, ids


@pytest.mark.parametrize("scale", [0.3, 3.0, 30.0, 300.0])
@pytest.mark.parametrize("columns", [1, 7, 16, 100, 2048])
def test_each_reduction_equals_float64s(scale, columns):
    g = torch.Generator().manual_seed(columns)
    logits = (torch.randn(33, columns, generator=g) * scale).float()
    target = logits[torch.arange(33), torch.randint(0, columns, (33,), generator=g)]
    maxes, sums, larger, values, ids = reduce(logits, target, min(5, columns))
    assert torch.equal(maxes, logits.amax(dim=1))
    assert torch.equal(larger, (logits > target[:, None]).sum(dim=1).float())
    exact = torch.exp(logits.double() - maxes.double()[:, None]).sum(dim=1)
    torch.testing.assert_close(sums.double(), exact, rtol=3e-7, atol=0)
    top = logits.topk(min(5, columns), dim=1)
    assert torch.equal(values, top.values) and torch.equal(ids, top.indices)


def test_exp2_is_within_float32_rounding_over_its_range():
    y = np.linspace(-126, 0, 20_001, dtype=np.float32)  # every n = round(y) of the range, f over [-1/2, 1/2]
    got = np.array([kernel._exp2(v) for v in y], dtype=np.float64)
    assert np.abs(got / np.exp2(y.astype(np.float64)) - 1).max() < 3e-7
    assert 0 < kernel._exp2(np.float32(-1000.0)) <= 2.0 ** -126 and math.isnan(kernel._exp2(np.float32("nan")))


def test_the_top_k_runs_over_chunks_and_ties_keep_the_lower_id():
    logits = torch.tensor([[1.0, 5.0, 5.0, 2.0], [0.0, -1.0, -2.0, -3.0]])
    values, ids = torch.full((2, 3), -math.inf), torch.zeros(2, 3, dtype=torch.int64)
    reduce(logits[:, :2].contiguous(), torch.zeros(2), 3, first=0, values=values, ids=ids)
    reduce(logits[:, 2:].contiguous(), torch.zeros(2), 3, first=2, values=values, ids=ids)
    assert values.tolist() == [[5.0, 5.0, 2.0], [0.0, -1.0, -2.0]]
    assert ids.tolist() == [[1, 2, 3], [0, 1, 2]]


def test_a_nan_logit_makes_the_sum_nan_and_far_terms_count_nothing():
    logits = torch.tensor([[0.0, float("nan"), 1.0], [0.0, -1e4, -1e30]])
    _, sums, larger, _, _ = reduce(logits, torch.zeros(2), 0)
    assert math.isnan(sums[0].item())
    assert sums[1].item() == 1.0 and larger.tolist()[1] == 0.0


def test_no_top_k_leaves_nothing_to_merge():
    logits = torch.randn(4, 64)
    _, _, _, values, ids = reduce(logits, logits[:, 0].contiguous(), 0)
    assert values.shape == (4, 0) and ids.shape == (4, 0)
    assert np.isfinite(logits.numpy()).all()
