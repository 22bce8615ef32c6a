"""Attention states as single flat buffers, so one state is one message (or one collective)."""

from __future__ import annotations

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, else float32: partial states are combined in this dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def pack_state(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """out (B, Sq, Hq, Dv) and lse (B, Hq, Sq) -> one contiguous 1-D buffer [out, lse] in lse's dtype."""
    buffer = torch.empty(out.numel() + lse.numel(), dtype=lse.dtype, device=lse.device)
    buffer[: out.numel()].view(out.shape).copy_(out)
    buffer[out.numel():].view(lse.shape).copy_(lse)
    return buffer


def unpack_state(buffer: torch.Tensor, out_shape: torch.Size | tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of pack_state: views (out (B, Sq, Hq, Dv), lse (B, Hq, Sq)) into `buffer`."""
    B, Sq, Hq, _ = out_shape
    n_out = 1
    for size in out_shape:
        n_out *= size
    return buffer[:n_out].view(out_shape), buffer[n_out:].view(B, Hq, Sq)
