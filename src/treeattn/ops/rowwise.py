"""Row-wise ops of a decoder layer: RMSNorm and rotate-half RoPE.

    y = rms_norm(x, weight, eps)     x (..., D), weight (D,) -> (..., D) in x.dtype (weight_offset=1.0: Gemma's 1 + weight)
    y = apply_rope(x, cos, sin)      x (B, S, H, D), cos, sin (B, S, D) -> (B, S, H, D) in x.dtype
    q, k = apply_rope_pair(q, k, cos, sin)    (apply_rope(q, cos, sin), apply_rope(k, cos, sin)): one kernel call

Each is a few torch calls; a decode step of a few rows on the CPU, in float32, outside autograd,
runs the compiled kernel instead (treeattn.ops.rowwise_cpu_kernel, numba: one call), whose fixed
cost is a fraction of theirs. The kernel's RoPE gives torch's bits; its RMSNorm sums the squares
in another order (within float32 rounding). Anything else (more rows, other dtypes or devices, no
numba) takes the torch path below, which is transformers' arithmetic.

Example::

    >>> import torch
    >>> from treeattn.ops.rowwise import rms_norm
    >>> x = torch.tensor([[3.0, 4.0]])
    >>> rms_norm(x, torch.ones(2), 0.0)   # x / sqrt(mean(x**2)) = x / sqrt(12.5)
    tensor([[0.8485, 1.1314]])
"""

from __future__ import annotations

import numpy as np
import torch

from treeattn.ops.kernels import numpy_rows, optional_kernel

MAX_KERNEL_ROWS = 64
"""Calls of at most this many rows take the kernel (decode steps and their drafts); longer ones
(prompt chunks) spend their time in the arithmetic, which torch spreads over its threads."""


def _kernel(rows: int, *tensors: torch.Tensor):
    """treeattn.ops.rowwise_cpu_kernel when it takes a call of `rows` rows on these tensors, else None."""
    if rows > MAX_KERNEL_ROWS:
        return None
    grad = torch.is_grad_enabled()  # once a call: a decode step runs under inference_mode
    for t in tensors:
        if t.dtype != torch.float32 or not t.is_cpu or (grad and t.requires_grad):
            return None
    return optional_kernel("rowwise_cpu_kernel")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0) -> torch.Tensor:
    """weight * x / sqrt(mean(x**2, -1) + eps), computed in float32: x (..., D) any float dtype,
    weight (D,). Returns (..., D) in x.dtype (weight's product in the wider of the two, as in
    transformers' LlamaRMSNorm). weight_offset: multiply by weight + weight_offset instead (Gemma's
    1 + weight), which for float32 x is Gemma3RMSNorm's arithmetic."""
    kernel = _kernel(x.numel() // max(1, x.shape[-1]), x, weight)
    if kernel is not None and x.numel():  # numpy views around the call: a fraction of torch's reshape/view cost
        D = x.shape[-1]
        out = np.empty(x.shape, dtype=np.float32)
        kernel.rms_norm(numpy_rows(x, D), weight.detach().numpy(), float(weight_offset), float(eps), out.reshape(-1, D))
        return torch.from_numpy(out)
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (weight if weight_offset == 0 else weight + weight_offset) * normed.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, S, H, D) by cos, sin (B, S, D) in the rotate-half layout of HF checkpoints:
    x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]). Same dtype out."""
    kernel = _kernel(x.shape[0] * x.shape[1], x, cos, sin)
    if kernel is not None and cos.shape[:2] == x.shape[:2] and x.numel():
        B, S, H, D = x.shape
        out = np.empty(x.shape, dtype=np.float32)
        kernel.rope(numpy_rows(x, H * D).reshape(B * S, H, D), numpy_rows(cos, D), numpy_rows(sin, D), out.reshape(B * S, H, D))
        return torch.from_numpy(out)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_rope_pair(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(apply_rope(q, cos, sin), apply_rope(k, cos, sin)), the same bits, for a layer's queries q (B, S, Hq, D) and keys
    k (B, S, Hkv, D): where the kernel takes both, one call (a decode step's layer rotates both, and half of each call's
    time was its checks and views); else the two calls.

    >>> import torch
    >>> q, k, cos, sin = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 2, 8), torch.rand(1, 1, 8), torch.rand(1, 1, 8)
    >>> pair, alone = apply_rope_pair(q, k, cos, sin), (apply_rope(q, cos, sin), apply_rope(k, cos, sin))
    >>> all(torch.equal(a, b) for a, b in zip(pair, alone))
    True
    """
    kernel = _kernel(q.shape[0] * q.shape[1], q, k, cos, sin)
    if (kernel is not None and q.shape[:2] == k.shape[:2] == cos.shape[:2] and q.shape[3] == k.shape[3] and q.numel()
            and k.numel()):
        B, S, H, D = q.shape
        Hk = k.shape[2]
        out_q, out_k = np.empty((B * S, H, D), dtype=np.float32), np.empty((B * S, Hk, D), dtype=np.float32)
        kernel.rope_pair(numpy_rows(q, H * D).reshape(B * S, H, D), numpy_rows(k, Hk * D).reshape(B * S, Hk, D),
                         numpy_rows(cos, D), numpy_rows(sin, D), out_q, out_k)
        return torch.from_numpy(out_q.reshape(q.shape)), torch.from_numpy(out_k.reshape(k.shape))
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


__all__ = ["MAX_KERNEL_ROWS", "apply_rope", "apply_rope_pair", "rms_norm"]
