"""Local validation of the inputs of the decode ops, and the metadata the ranks must agree on."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treeattn.ops.validation import check_positions, check_qkv, check_scale, check_softcap
from treeattn.parallel.metadata import UNKNOWN, device_code, dtype_code, float_code


@dataclass
class DecodeInputs:
    """Validated shapes of one rank's decode inputs (q the same on every rank, k/v its shard)."""

    B: int
    Sq: int
    Sk: int
    Hq: int
    Hkv: int
    D: int
    Dv: int
    scale: float
    q_pos: torch.Tensor | None  # int64 (Sq,) or (B, Sq)
    kv_pos: torch.Tensor | None  # int64 (Sk,) or (B, Sk)
    softcap: float | None = None  # logit soft-capping c: scores s become c * tanh(s / c)

    @property
    def masked(self) -> bool:
        """Causal masking by absolute positions applies (speculative decoding, Sq > 1)."""
        return self.q_pos is not None


def check_decode_inputs(q, k, v, scale, q_pos, kv_pos, softcap=None) -> DecodeInputs:
    """Validate q (B, Sq, Hq, D), this rank's k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv), the scale, the
    positions (both or neither: a key is visible to a query iff kv_pos <= q_pos) and the softcap."""
    B, Sq, Sk, Hq, Hkv, D, Dv = check_qkv(q, k, v)
    scale = check_scale(scale, D)
    softcap = check_softcap(softcap)
    if (q_pos is None) != (kv_pos is None):
        raise ValueError(
            "q_pos and kv_pos must be given together (causal masking by absolute positions), got "
            f"q_pos={'None' if q_pos is None else 'a tensor'} and kv_pos={'None' if kv_pos is None else 'a tensor'}"
        )
    q_pos = positions(q_pos, "q_pos", B, Sq, q.device)
    kv_pos = positions(kv_pos, "kv_pos", B, Sk, q.device)
    return DecodeInputs(B, Sq, Sk, Hq, Hkv, D, Dv, scale, q_pos, kv_pos, softcap)


def positions(pos, name: str, batch: int, length: int, device: torch.device) -> torch.Tensor | None:
    """check_positions, keeping the caller's form: int64 (length,) or (batch, length), or None."""
    checked = check_positions(pos, name, batch, length, device)
    if checked is None:
        return None
    return checked[0] if pos.dim() == 1 else checked


def per_batch(pos: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """Positions (n,) or (batch, n) as a contiguous (batch, n) tensor (the form that travels)."""
    if pos is None:
        return None
    return pos.expand(batch, pos.shape[-1]).contiguous()


def input_fields(q, inputs: DecodeInputs | None) -> dict[str, int]:
    """The metadata every rank contributes (UNKNOWN where this rank's inputs were rejected)."""
    if inputs is None:
        names = ("B (q.shape[0])", "Sq (q.shape[1])", "Hq (q.shape[2])", "Hkv (k.shape[2])", "D (q.shape[3])",
                 "Dv (v.shape[3])", "dtype", "device", "scale", "softcap", "positions given", "Sk")
        return dict.fromkeys(names, UNKNOWN)
    return {
        "B (q.shape[0])": inputs.B,
        "Sq (q.shape[1])": inputs.Sq,
        "Hq (q.shape[2])": inputs.Hq,
        "Hkv (k.shape[2])": inputs.Hkv,
        "D (q.shape[3])": inputs.D,
        "Dv (v.shape[3])": inputs.Dv,
        "dtype": dtype_code(q.dtype),
        "device": device_code(q.device),
        "scale": float_code(inputs.scale),
        "softcap": 0 if inputs.softcap is None else float_code(inputs.softcap),
        "positions given": int(inputs.masked),
        "Sk": inputs.Sk,
    }


MATCHED_FIELDS = ("B (q.shape[0])", "Sq (q.shape[1])", "Hq (q.shape[2])", "Hkv (k.shape[2])", "D (q.shape[3])",
                  "Dv (v.shape[3])", "dtype", "device", "scale", "softcap", "positions given")
