"""Cross-rank input agreement: one small all-gather so that bad input fails on every rank, not hangs.

Before the first collective of a multi-rank op, every rank contributes a short int64 vector of
metadata (shapes, dtype, scale, method, its KV length, ...) and whether its own inputs passed
local validation. Every rank then sees the same table and so raises the same ValueError when the
ranks disagree; a rank whose local inputs were rejected raises its own error, the others say which
rank it was. Without the check, a rank that disagrees would sit in a collective until the group
times out, or silently combine garbage.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from treeattn.parallel import comm

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
DEVICE_CODES = {"cpu": 0, "cuda": 1}
UNKNOWN = -1


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPE_CODES.get(dtype, UNKNOWN)


def device_code(device: torch.device) -> int:
    return DEVICE_CODES.get(device.type, 99)


def float_code(x: float) -> int:
    """The bits of a float64 as an int64, so floats travel exactly in the int64 table."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def float_from_code(code: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(code)))[0]


_DTYPE_NAMES = {code: str(dtype).removeprefix("torch.") for dtype, code in DTYPE_CODES.items()}
_DEVICE_NAMES = {code: name for name, code in DEVICE_CODES.items()}

FORMATTERS: dict[str, Callable[[int], str]] = {
    "dtype": lambda c: _DTYPE_NAMES.get(c, f"code {c}"),
    "device": lambda c: _DEVICE_NAMES.get(c, f"code {c}"),
    "scale": lambda c: repr(float_from_code(c)),
}


DIGEST_PROJECTIONS = 4
# Floating digests agree when every projection and the norm are within DIGEST_RTOL * (larger norm):
# rounding differences (a few ulps per element) stay far below it; a q that differs in one batch row
# of sixteen moves a projection by ~0.35 of the norm times a standard normal factor, caught by at
# least one of the four projections with probability > 0.9999.
DIGEST_RTOL = 1e-2
_DIGEST_SEED = 20240611


@dataclass(frozen=True)
class Digest:
    """A short summary of a tensor that must be the same on every rank.

    values: (L2 norm, DIGEST_PROJECTIONS projections on fixed pseudo-random +-1 vectors), float64.
    exact: integer tensors (positions) must match exactly; floating ones within DIGEST_RTOL.
    """

    values: tuple[float, ...]
    exact: bool

    @staticmethod
    def unknown() -> Digest:
        """The digest a rank contributes when its own inputs were rejected (never compared)."""
        return Digest((math.nan,) * (1 + DIGEST_PROJECTIONS), False)

    def agrees_with(self, other: Digest) -> bool:
        if self.exact or other.exact:
            return self.values == other.values
        tolerance = DIGEST_RTOL * max(abs(self.values[0]), abs(other.values[0]))
        return all(_close(a, b, tolerance) for a, b in zip(self.values, other.values))


def _close(a: float, b: float, tolerance: float) -> bool:
    if a == b or (math.isnan(a) and math.isnan(b)):
        return True
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= tolerance


def tensor_digest(t: torch.Tensor | None) -> Digest:
    """The Digest of t (any shape, strides, dtype, device); None (an absent optional tensor) digests
    as an empty one. Call it only when checking: one pass over t in float64 and one host read.

    Projection j weighs element (row r, column c) of t viewed as (rows, last dim) by the sign
    column_signs[c, j] * row_signs[r, j], both drawn from a fixed seed: a random +-1 projection
    that costs two small matrix products, not a weight per element.
    """
    if t is None or t.numel() == 0:
        return Digest((0.0,) * (1 + DIGEST_PROJECTIONS), exact=t is not None and not t.dtype.is_floating_point)
    x = t.detach().reshape(-1, t.shape[-1]).to(torch.float64)
    rows, columns = x.shape
    generator = torch.Generator().manual_seed(_DIGEST_SEED)
    column_signs = (torch.randint(0, 2, (columns, DIGEST_PROJECTIONS), generator=generator) * 2 - 1).to(x)
    row_signs = (torch.randint(0, 2, (rows, DIGEST_PROJECTIONS), generator=generator) * 2 - 1).to(x)
    projections = ((x @ column_signs) * row_signs).sum(dim=0)
    values = torch.cat([torch.linalg.vector_norm(x).reshape(1), projections])
    return Digest(tuple(values.tolist()), exact=not t.dtype.is_floating_point)


def metadata_device(group: dist.ProcessGroup | None) -> torch.device:
    """Device for the metadata tensor: CUDA for an NCCL group (NCCL moves only CUDA tensors), else CPU."""
    if "nccl" in str(dist.get_backend(comm.process_group(group))).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_metadata(
    op_name: str,
    fields: Mapping[str, int | Digest],
    group: dist.ProcessGroup | None,
    *,
    must_match: Sequence[str],
    local_error: BaseException | None,
    formatters: Mapping[str, Callable[[int], str]] | None = None,
) -> list[dict[str, int | Digest]]:
    """All-gather `fields` from every rank of `group` and check agreement.

    Args:
        op_name: the public function, for error messages ("tree_decode").
        fields: this rank's values: name -> int64, or name -> Digest (a tensor that must be the same
            on every rank). Every rank must pass the same names in the same order; a value this
            rank could not compute (its inputs were bad) is UNKNOWN (Digest.unknown()).
        must_match: names whose value must be equal on every rank (Digests: agree, see Digest).
        local_error: the error this rank's local validation raised, or None.
        formatters: name -> how to print a value in an error message (codes -> names).

    Returns:
        One dict per rank of the group, in rank order.

    Raises:
        local_error on the rank that produced it; ValueError on every other rank, naming the ranks
        whose inputs were rejected; ValueError on every rank, with the same message, when a
        `must_match` field differs between ranks.
    """
    names = list(fields)
    row = []
    for name in names:
        value = fields[name]
        if isinstance(value, Digest):
            row += [int(value.exact)] + [float_code(x) for x in value.values]
        else:
            row.append(int(value))
    row.append(0 if local_error is not None else 1)
    vector = torch.tensor(row, dtype=torch.int64, device=metadata_device(group))
    table = [_unpack_row(names, fields, [int(x) for x in piece.tolist()]) for piece in comm.all_gather(vector, group)]
    if local_error is not None:
        raise local_error
    rejected = [rank for rank, (_, accepted) in enumerate(table) if not accepted]
    if rejected:
        raise ValueError(
            f"{op_name}: rank(s) {rejected} rejected their local inputs (each raises its own error); "
            "no rank ran the operation"
        )
    rows = [values for values, _ in table]
    for name in must_match:
        column = [values[name] for values in rows]
        if isinstance(column[0], Digest):
            differing = [rank for rank, digest in enumerate(column) if not digest.agrees_with(column[0])]
            if differing:
                norms = ", ".join(f"rank {rank}: {digest.values[0]:.6g}" for rank, digest in enumerate(column))
                raise ValueError(
                    f"{op_name}: every rank must pass the same {name}, but rank(s) {differing} hold a different one "
                    f"than rank 0 (checksums differ; L2 norms {norms})"
                )
        elif len(set(column)) > 1:
            fmt = {**FORMATTERS, **(formatters or {})}.get(name, str)
            per_rank = ", ".join(f"rank {rank}: {fmt(value)}" for rank, value in enumerate(column))
            raise ValueError(f"{op_name}: every rank must pass the same {name}, got {per_rank}")
    return rows


def row_length(fields: Mapping[str, int | Digest]) -> int:
    """How many int64 one rank contributes to gather_metadata for `fields` (the accepted flag included)."""
    return 1 + sum(2 + DIGEST_PROJECTIONS if isinstance(value, Digest) else 1 for value in fields.values())


def _unpack_row(names, fields, row: list[int]) -> tuple[dict[str, int | Digest], bool]:
    """One gathered row -> ({name: value}, whether that rank accepted its inputs)."""
    values, at = {}, 0
    for name in names:
        if isinstance(fields[name], Digest):
            width = 2 + DIGEST_PROJECTIONS
            exact, *codes = row[at : at + width]
            values[name] = Digest(tuple(float_from_code(c) for c in codes), bool(exact))
            at += width
        else:
            values[name] = row[at]
            at += 1
    return values, row[at] == 1


T = TypeVar("T")


def validate_and_agree(
    op_name: str,
    group: dist.ProcessGroup | None,
    validate: Callable[[], T],
    fields: Callable[[T | None], Mapping[str, int | Digest]],
    *,
    gather: bool,
    must_match: Sequence[str],
    formatters: Mapping[str, Callable[[int], str]] | None = None,
) -> tuple[T, list[dict[str, int | Digest]] | None]:
    """The preamble of every multi-rank op: validate this rank's inputs, then agree across ranks.

    1. validate() runs on this rank; a ValueError or TypeError it raises is held.
    2. With gather (callers pass it for p > 1 when check_inputs is on, or when they need the
       gathered table anyway): gather_metadata all-gathers fields(what validate returned, or None
       if it raised), so that every rank raises (its own error on the rank whose inputs were
       rejected, the same ValueError on every rank when `must_match` fields differ) and none hangs.
       Without gather the held error is raised here, on this rank only.

    Returns:
        (what validate returned, the gathered table (one dict per rank) or None without gather).
    """
    validated, local_error = None, None
    try:
        validated = validate()
    except (ValueError, TypeError) as exc:
        local_error = exc
    if not gather:
        if local_error is not None:
            raise local_error
        return validated, None
    table = gather_metadata(
        op_name, fields(validated), group, must_match=must_match, local_error=local_error, formatters=formatters
    )
    return validated, table
