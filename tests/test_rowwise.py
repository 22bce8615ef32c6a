"""treeattn.ops.rowwise: RMSNorm and RoPE through the compiled CPU kernel and through torch.

The kernel's RoPE gives torch's bits; its RMSNorm is within float32 rounding of the float64 result
(the sum of squares in another order); calls the kernel does not take (too many rows, bfloat16,
autograd) take the torch path, which is transformers' arithmetic.
"""

from __future__ import annotations

import pytest
import torch

from treeattn.ops import rowwise
from treeattn.ops.kernels import optional_kernel

pytest.importorskip("numba")

U = 2.0 ** -24


def _torch_path(monkeypatch):
    monkeypatch.setattr(rowwise, "_kernel", lambda *args: None)


def _norm64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("shape", [(1, 1, 576), (2, 3, 64), (5, 8)])
def test_rms_norm_kernel_is_within_float32_rounding_of_float64(shape):
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(*shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
    assert rowwise._kernel(x.numel() // shape[-1], x, weight) is optional_kernel("rowwise_cpu_kernel")
    with torch.inference_mode():
        y = rowwise.rms_norm(x, weight, 1e-5)
    assert y.dtype == torch.float32 and y.shape == x.shape
    bound = (shape[-1] + 8) * U * (weight.double().abs() * _norm64(x, torch.ones_like(weight), 1e-5).abs())
    assert ((y.double() - _norm64(x, weight, 1e-5)).abs() <= bound).all()


def test_rms_norm_torch_path_and_kernel_agree_on_a_zero_row(monkeypatch):
    x, weight = torch.zeros(1, 4), torch.ones(4)
    kernel = rowwise.rms_norm(x, weight, 1e-6)
    _torch_path(monkeypatch)
    assert torch.equal(kernel, rowwise.rms_norm(x, weight, 1e-6)) and torch.isfinite(kernel).all()


@pytest.mark.parametrize("shape", [(1, 1, 9, 64), (2, 3, 4, 16), (1, 5, 1, 2)])
def test_rope_kernel_gives_torchs_bits(shape, monkeypatch):
    """The same bits on every host by construction: the kernel computes x * cos - x' * sin with two
    float32 products and one sum, each rounded (numba without fastmath emits no `contract` flag, so
    LLVM fuses nothing into an FMA even where the CPU has one), and torch's path is three separate
    elementwise ops (mul, mul, add), each rounded; negation is exact. The first assert keeps it so."""
    from treeattn.ops import rowwise_cpu_kernel

    assert not rowwise_cpu_kernel.rope.targetoptions.get("fastmath")
    g = torch.Generator().manual_seed(1)
    B, S, H, D = shape
    x = torch.randn(*shape, generator=g)
    angles = torch.rand(B, S, D // 2, generator=g) * 100
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    assert rowwise._kernel(B * S, x, cos, sin) is not None
    kernel = rowwise.apply_rope(x, cos, sin)
    _torch_path(monkeypatch)
    assert torch.equal(kernel, rowwise.apply_rope(x, cos, sin))


def test_rope_of_a_strided_view_reads_its_values():
    x = torch.randn(1, 2, 6, 8)[:, :, ::2]  # not contiguous
    cos, sin = torch.rand(1, 2, 8), torch.rand(1, 2, 8)
    half = 4
    expected = x * cos[:, :, None] + torch.cat((-x[..., half:], x[..., :half]), -1) * sin[:, :, None]
    assert torch.equal(rowwise.apply_rope(x, cos, sin), expected)


def test_what_the_kernel_does_not_take_runs_in_torch():
    x, w = torch.randn(2, 8), torch.randn(8)
    assert rowwise._kernel(rowwise.MAX_KERNEL_ROWS + 1, x, w) is None  # a prompt chunk
    assert rowwise._kernel(1, x.bfloat16(), w) is None
    assert rowwise._kernel(1, x.double(), w) is None
    assert rowwise._kernel(1, x.requires_grad_(), w) is None
    y = rowwise.rms_norm(x, w, 1e-5)
    y.sum().backward()  # autograd works: the torch path
    assert x.grad is not None and torch.isfinite(x.grad).all()
    bf = rowwise.rms_norm(x.detach().bfloat16(), w.bfloat16(), 1e-5)
    assert bf.dtype == torch.bfloat16
    torch.testing.assert_close(bf.float(), rowwise.rms_norm(x.detach(), w, 1e-5), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("shape", [(1, 1, 9, 3, 64), (2, 3, 4, 2, 16), (1, 5, 1, 1, 2)])
def test_rope_pair_is_two_ropes_bit_for_bit(shape, monkeypatch):
    """apply_rope_pair (one kernel call for a layer's queries and keys) gives apply_rope's bits for each, on the kernel
    and on the torch path; keys of another head dim than the queries' fall back to the two calls."""
    B, S, H, Hk, D = shape
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(B, S, H, D, generator=g), torch.randn(B, S, Hk, D, generator=g)
    angles = torch.rand(B, S, D // 2, generator=g) * 100
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    for path in ("kernel", "torch"):
        if path == "torch":
            _torch_path(monkeypatch)
        pair = rowwise.apply_rope_pair(q, k, cos, sin)
        assert all(torch.equal(a, b) for a, b in zip(pair, (rowwise.apply_rope(q, cos, sin), rowwise.apply_rope(k, cos, sin))))
        assert pair[0].shape == q.shape and pair[1].shape == k.shape
