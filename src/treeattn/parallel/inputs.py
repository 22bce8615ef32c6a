"""Local validation of the inputs of the decode ops, and the metadata the ranks must agree on.

tree_decode and ring_decode share one preamble (metadata.validate_and_agree): decode_inputs
validates this rank's tensors (with check_inputs=False it only reads their shapes: the local
attention validates them anyway), and input_fields is what every rank contributes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treeattn.ops.validation import check_positions, check_qkv, check_scale, check_softcap
from treeattn.parallel.metadata import UNKNOWN, Digest, device_code, dtype_code, float_code, tensor_digest


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


def decode_inputs(q, k, v, scale, q_pos, kv_pos, softcap, *, check: bool) -> DecodeInputs:
    """check_decode_inputs with check=True. With check=False (check_inputs=False: the caller vouches
    for the inputs) only the shapes are read and the default scale filled in, so the tensors are
    validated once per call, by the local attention, not twice."""
    if check or not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return check_decode_inputs(q, k, v, scale, q_pos, kv_pos, softcap)
    _check_positions_given(q_pos, kv_pos)
    B, Sq, Hq, D = q.shape
    _, Sk, Hkv, _ = k.shape
    scale = D ** -0.5 if scale is None else float(scale)
    return DecodeInputs(B, Sq, Sk, Hq, Hkv, D, v.shape[3], scale, q_pos, kv_pos, softcap)


def check_decode_inputs(q, k, v, scale, q_pos, kv_pos, softcap=None) -> DecodeInputs:
    """Validate q (B, Sq, Hq, D), this rank's k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv), the scale, the
    positions (both or neither: a key is visible to a query iff kv_pos <= q_pos) and the softcap."""
    B, Sq, Sk, Hq, Hkv, D, Dv = check_qkv(q, k, v)
    scale = check_scale(scale, D)
    softcap = check_softcap(softcap)
    _check_positions_given(q_pos, kv_pos)
    q_pos = positions(q_pos, "q_pos", B, Sq, q.device)
    kv_pos = positions(kv_pos, "kv_pos", B, Sk, q.device)
    return DecodeInputs(B, Sq, Sk, Hq, Hkv, D, Dv, scale, q_pos, kv_pos, softcap)


def _check_positions_given(q_pos, kv_pos) -> None:
    if (q_pos is None) != (kv_pos is None):
        raise ValueError(
            "q_pos and kv_pos must be given together (causal masking by absolute positions), got "
            f"q_pos={'None' if q_pos is None else 'a tensor'} and kv_pos={'None' if kv_pos is None else 'a tensor'}"
        )


def positions(pos, name: str, batch: int, length: int, device: torch.device) -> torch.Tensor | None:
    """check_positions, keeping the caller's form: int64 (length,) or (batch, length), or None."""
    checked = check_positions(pos, name, batch, length, device)
    if checked is None:
        return None
    return checked[0] if pos.dim() == 1 else checked


def per_batch(pos: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """Positions (n,) or (batch, n) as a contiguous int64 (batch, n) tensor (the form that travels)."""
    if pos is None:
        return None
    return pos.to(torch.int64).expand(batch, pos.shape[-1]).contiguous()


def input_fields(q, inputs: DecodeInputs | None, *, digests: bool = True) -> dict[str, int | Digest]:
    """The metadata every rank contributes (UNKNOWN where this rank's inputs were rejected): the
    shapes, dtype, device, scale, softcap, and digests of q and q_pos, which must be the same on
    every rank (a q that differs would be silently mixed into one result). digests=False (for a
    gather that compares only the lengths) sends placeholders of the same size instead."""
    names = ("B (q.shape[0])", "Sq (q.shape[1])", "Hq (q.shape[2])", "Hkv (k.shape[2])", "D (q.shape[3])",
             "Dv (v.shape[3])", "dtype", "device", "scale", "softcap", "positions given", "Sk")
    if inputs is None:
        return {**dict.fromkeys(names, UNKNOWN), "q": Digest.unknown(), "q_pos": Digest.unknown()}
    values = (inputs.B, inputs.Sq, inputs.Hq, inputs.Hkv, inputs.D, inputs.Dv, dtype_code(q.dtype), device_code(q.device),
              float_code(inputs.scale), 0 if inputs.softcap is None else float_code(inputs.softcap), int(inputs.masked),
              inputs.Sk)
    return {
        **dict(zip(names, values)),
        "q": tensor_digest(q) if digests else Digest.unknown(),
        "q_pos": tensor_digest(per_batch(inputs.q_pos, inputs.B)) if digests else Digest.unknown(),
    }


MATCHED_FIELDS = ("B (q.shape[0])", "Sq (q.shape[1])", "Hq (q.shape[2])", "Hkv (k.shape[2])", "D (q.shape[3])",
                  "Dv (v.shape[3])", "dtype", "device", "scale", "softcap", "positions given", "q_pos", "q")
