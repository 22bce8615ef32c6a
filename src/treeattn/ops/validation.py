"""Argument checks shared by every attention entry point.

Each check raises ValueError (wrong shape or value) or TypeError (wrong dtype) with a message that
names the argument, what was expected and what was given. Nothing here broadcasts silently.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int, int, int]:
    """Validate q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv).

    B, Sq and Sk may be 0 (an empty batch, no query, an empty KV shard: the attention state is then
    empty, or out = 0 and lse = -inf); Hq, Hkv, D and Dv must be positive.

    Returns (B, Sq, Sk, Hq, Hkv, D, Dv).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            layout = "(B, Sq, Hq, D)" if name == "q" else f"(B, Sk, Hkv, {'D' if name == 'k' else 'Dv'})"
            raise ValueError(f"{name} must have 4 dims {layout}, got shape {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32, float16, bfloat16 or float64, got {t.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    B, Sq, Hq, D = q.shape
    Bk, Sk, Hkv, Dk = k.shape
    Bv, Skv, Hv, Dv = v.shape
    if Bk != B or Bv != B:
        raise ValueError(f"batch size mismatch: q has B={B}, k has B={Bk}, v has B={Bv}")
    if Dk != D:
        raise ValueError(f"head dim mismatch: q has D={D} (shape {tuple(q.shape)}), k has D={Dk} (shape {tuple(k.shape)})")
    if Skv != Sk:
        raise ValueError(f"sequence length mismatch: k has Sk={Sk}, v has Sk={Skv}")
    if Hv != Hkv:
        raise ValueError(f"kv head count mismatch: k has Hkv={Hkv}, v has Hkv={Hv}")
    if Hq == 0 or Hkv == 0:
        raise ValueError(
            f"head counts must be positive, got Hq={Hq} (q shape {tuple(q.shape)}) and Hkv={Hkv} (k shape {tuple(k.shape)})"
        )
    if Hq % Hkv != 0:
        raise ValueError(f"Hq must be a multiple of Hkv (GQA), got Hq={Hq} (q shape {tuple(q.shape)}), Hkv={Hkv} (k shape "
                         f"{tuple(k.shape)})")
    if D == 0 or Dv == 0:
        raise ValueError(f"head dims must be positive, got D={D}, Dv={Dv}")
    return B, Sq, Sk, Hq, Hkv, D, Dv


def check_positions(pos: torch.Tensor | None, name: str, batch: int, length: int, device: torch.device) -> torch.Tensor | None:
    """Validate a position tensor of shape (length,) or (batch, length) with an integer dtype.

    Returns it as int64 of shape (batch or 1, length) on `device`, or None.
    """
    if pos is None:
        return None
    if not isinstance(pos, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int64 positions, got {type(pos).__name__}")
    if pos.dtype.is_floating_point or pos.dtype.is_complex or pos.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer positions (int64), got dtype {pos.dtype}")
    if pos.dim() == 1:
        if pos.shape[0] != length:
            raise ValueError(f"{name} must have shape ({length},) or ({batch}, {length}), got {tuple(pos.shape)}")
        pos = pos.unsqueeze(0)
    elif pos.dim() == 2:
        if pos.shape != (batch, length):
            raise ValueError(f"{name} must have shape ({length},) or ({batch}, {length}), got {tuple(pos.shape)}")
    else:
        raise ValueError(f"{name} must have shape ({length},) or ({batch}, {length}), got {tuple(pos.shape)}")
    if pos.device != device:
        raise ValueError(f"{name} must be on the device of q ({device}), got {pos.device}")
    return pos.to(torch.int64)


def check_scale(scale: float | None, head_dim: int) -> float:
    if scale is None:
        return head_dim ** -0.5
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"scale must be a scalar, got a tensor of shape {tuple(scale.shape)}")
        scale = float(scale)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    scale = float(scale)
    if not (scale == scale) or scale in (float("inf"), float("-inf")):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def check_softcap(softcap: float | None) -> float | None:
    """softcap: None, or a positive finite float c; scores s become c * tanh(s / c) (Gemma 2)."""
    if softcap is None:
        return None
    if isinstance(softcap, torch.Tensor):
        if softcap.numel() != 1:
            raise ValueError(f"softcap must be a positive float or None, got a tensor of shape {tuple(softcap.shape)}")
        softcap = float(softcap)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a positive float or None, got {type(softcap).__name__}")
    softcap = float(softcap)
    if not (0.0 < softcap < float("inf")):
        raise ValueError(f"softcap must be a positive finite float or None, got {softcap}")
    return softcap


def check_window(window: int | None) -> int | None:
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int):
        raise TypeError(f"window must be a positive int or None, got {type(window).__name__}")
    if window <= 0:
        raise ValueError(f"window must be a positive int or None, got {window}")
    return window


def check_window_is_causal(window: int | None, causal: bool) -> None:
    """A window is a causal sliding window (key visible iff 0 <= q_pos - kv_pos < window), so it
    needs causal=True; without it, it would hide only the keys far behind the query and leave every
    later key visible. Two-sided windows (flash-attn's window_size=(left, right)) are not supported."""
    if window is not None and not causal:
        raise ValueError(
            f"window={window} needs causal=True: it is a causal sliding window (a key is visible iff "
            "0 <= q_pos - kv_pos < window); two-sided windows are not supported"
        )


def check_state(out: torch.Tensor, lse: torch.Tensor, name: str) -> None:
    """Validate an attention state: out (B, Sq, Hq, Dv) and lse (B, Hq, Sq) float32."""
    if not isinstance(out, torch.Tensor) or not isinstance(lse, torch.Tensor):
        raise TypeError(f"{name}: out and lse must be tensors, got {type(out).__name__} and {type(lse).__name__}")
    if out.dim() != 4:
        raise ValueError(f"{name}: out must have shape (B, Sq, Hq, Dv), got {tuple(out.shape)}")
    B, Sq, Hq, _ = out.shape
    if tuple(lse.shape) != (B, Hq, Sq):
        raise ValueError(f"{name}: lse must have shape (B, Hq, Sq) = {(B, Hq, Sq)} to match out {tuple(out.shape)}, got "
                         f"{tuple(lse.shape)}")
    if not out.dtype.is_floating_point:
        raise TypeError(f"{name}: out must be a floating tensor, got {out.dtype}")
    if lse.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{name}: lse must be float32 (or float64), got {lse.dtype}")
    if lse.device != out.device:
        raise ValueError(f"{name}: out and lse must be on one device, got {out.device} and {lse.device}")
