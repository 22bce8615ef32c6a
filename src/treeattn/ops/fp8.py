"""fp8 (e4m3) keys and values with one power-of-two float32 scale per row: the KV cache's 8-bit format.

    codes, scales = quantize_fp8(x)          # x (..., D) float -> codes (..., D) float8_e4m3fn, scales (...) float32
    x_hat = dequantize_fp8(codes, scales)    # (..., D) float32: codes * scales[..., None], exactly

A row is one token's keys (or values) of one KV head, D channels; the engine's paged cache
(treeattn.cache.paged) stores the codes in its arena and the scales beside it, one per (token, KV
head). The convention is vLLM's and FlashInfer's (the stored byte is e4m3(x / scale), a read is
e4m3 * scale); their scales are static, one per tensor or per KV head, calibrated offline or 1.0.
Here each row gets its own scale when it is written, from that row alone:

    scale = 2 ** (e - 8),  where max |x| = m * 2**e with m in [0.5, 1)   (torch.frexp)

so max |x| / scale lies in [128, 256), inside e4m3's range (448) whatever the model's activations,
and no later token can change the scale of a row already written (tokens arrive one at a time;
there is nothing to requantize). A power of two makes the division and the dequantization exact:
the only rounding is e4m3's own (3 mantissa bits, relative error <= 2**-4 for normal codes), and
`dequantize_fp8` defines the cache's values exactly, so every reader (the torch gathers, the CPU
kernel, the Triton kernel, which fold the scale into the score and the softmax weight instead of
widening with it) attends to the same numbers. Cost: 4 bytes per row (6.25% of the codes at
D = 64).

Non-finite inputs stay non-finite: torch's float8_e4m3fn conversion saturates inf to 448, so an
inf or NaN entry is stored as e4m3's NaN (and its row's other entries may be NaN or saturated;
the row's attention is NaN either way, never a finite answer).
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
"""The stored dtype of an fp8 KV cache (kv_cache_dtype "fp8_e4m3")."""

# max |x| / scale < 2**CODE_EXPONENT = 256 <= 448, e4m3fn's largest finite value.
CODE_EXPONENT = 8
# The smallest scale: 2**-126, float32's smallest normal number (a scale must not underflow to 0).
MIN_SCALE_EXPONENT = -126


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x as e4m3 codes and one power-of-two scale per row.

    Args:
        x: (..., D) float tensor (any float dtype), D >= 1.

    Returns:
        codes (..., D) float8_e4m3fn with x ~= codes * scale (round to nearest even, relative error
        <= 2**-4 for entries of at least max|row| * 2**-13); scales (...) float32, powers of two, at
        least 2**-126. A non-finite entry becomes NaN.
    """
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.dim() < 1:
        got = f"{x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"x must be a floating tensor (..., D), got {got}")
    x32 = x.float()
    _, exponent = torch.frexp(x32.abs().amax(dim=-1))
    scales = torch.ldexp(torch.ones_like(x32[..., 0]), (exponent - CODE_EXPONENT).clamp_min(MIN_SCALE_EXPONENT))
    scaled = x32 / scales[..., None]
    codes = torch.where(torch.isfinite(x32), scaled, float("nan")).to(FP8)
    return codes, scales


def dequantize_fp8(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes (..., D) float8_e4m3fn times scales (...) float32 -> (..., D) in dtype (exact in float32:
    a scale is a power of two)."""
    if codes.dtype != FP8 or scales.dtype != torch.float32 or codes.shape[:-1] != scales.shape:
        raise TypeError(f"codes must be float8_e4m3fn (..., D) and scales float32 (...), got {codes.dtype} "
                        f"{tuple(codes.shape)} and {scales.dtype} {tuple(scales.shape)}")
    return (codes.float() * scales[..., None]).to(dtype)
