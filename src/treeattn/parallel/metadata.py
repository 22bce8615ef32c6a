"""Cross-rank input agreement: one small all-gather so that bad input fails on every rank, not hangs.

Before the first collective of a multi-rank op, every rank contributes a short int64 vector of
metadata (shapes, dtype, scale, method, its KV length, ...) and whether its own inputs passed
local validation. Every rank then sees the same table and so raises the same ValueError when the
ranks disagree; a rank whose local inputs were rejected raises its own error, the others say which
rank it was. Without the check, a rank that disagrees would sit in a collective until the group
times out, or silently combine garbage.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence

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


def metadata_device(group: dist.ProcessGroup | None) -> torch.device:
    """Device for the metadata tensor: CUDA for an NCCL group (NCCL moves only CUDA tensors), else CPU."""
    if "nccl" in str(dist.get_backend(group)).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_metadata(
    op_name: str,
    fields: Mapping[str, int],
    group: dist.ProcessGroup | None,
    *,
    must_match: Sequence[str],
    local_error: BaseException | None,
    formatters: Mapping[str, Callable[[int], str]] | None = None,
) -> list[dict[str, int]]:
    """All-gather `fields` (name -> int64) from every rank of `group` and check agreement.

    Args:
        op_name: the public function, for error messages ("tree_decode").
        fields: this rank's values. Every rank must pass the same names in the same order; a value
            this rank could not compute (its inputs were bad) is UNKNOWN.
        must_match: names whose value must be equal on every rank.
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
    row = [int(fields[name]) for name in names] + [0 if local_error is not None else 1]
    vector = torch.tensor(row, dtype=torch.int64, device=metadata_device(group))
    table = [[int(x) for x in piece.tolist()] for piece in comm.all_gather(vector, group)]
    if local_error is not None:
        raise local_error
    rejected = [rank for rank, values in enumerate(table) if values[-1] == 0]
    if rejected:
        raise ValueError(
            f"{op_name}: rank(s) {rejected} rejected their local inputs (each raises its own error); "
            "no rank ran the operation"
        )
    for name in must_match:
        column = [values[names.index(name)] for values in table]
        if len(set(column)) > 1:
            fmt = {**FORMATTERS, **(formatters or {})}.get(name, str)
            per_rank = ", ".join(f"rank {rank}: {fmt(value)}" for rank, value in enumerate(column))
            raise ValueError(f"{op_name}: every rank must pass the same {name}, got {per_rank}")
    return [dict(zip(names, values[:-1])) for values in table]
