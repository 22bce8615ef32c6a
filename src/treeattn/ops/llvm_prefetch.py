"""llvm.prefetch for the numba kernels' code generators (packed_cpu_kernel, packed_int8_kernel, paged_cpu_kernel).

A prefetch is a hint: it never faults (past an array's end included) and changes no value, only when a cache line
arrives. Both functions emit IR into a numba intrinsic's `builder`:

    prefetch(builder, pointer, offset)             # the line holding byte `offset` after an i8* `pointer`
    prefetch_lines(builder, address, nbytes, 2)    # every 64-byte line of [address, address + nbytes), into L2
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

LINE = 64
"""Bytes a prefetch brings (x86-64's cache line)."""


def _intrinsic(builder):
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                          "llvm.prefetch.p0")


def prefetch(builder, pointer, offset, locality: int = 3) -> None:
    """Emit a read prefetch of the line at byte `offset` (an i64 value or constant) from the i8* `pointer`;
    locality 3 keeps it in every cache level, 2 in L2 and outer.

    >>> fn = ir.Function(ir.Module(), ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer()]), "f")
    >>> builder = ir.IRBuilder(fn.append_basic_block())
    >>> prefetch(builder, fn.args[0], ir.Constant(ir.IntType(64), 4096))
    >>> "llvm.prefetch.p0" in str(fn.module)
    True
    """
    i32 = ir.IntType(32)
    builder.call(_intrinsic(builder), [builder.gep(pointer, [offset]), ir.Constant(i32, 0), ir.Constant(i32, locality),
                                       ir.Constant(i32, 1)])


def prefetch_lines(builder, address, nbytes, locality: int = 3) -> None:
    """Emit a loop that prefetches every LINE bytes of [address, address + nbytes): `address` an i64 (ptrtoint),
    `nbytes` an i64, in address order."""
    i64, i8p = ir.IntType(64), ir.IntType(8).as_pointer()
    with cgutils.for_range_slice(builder, ir.Constant(i64, 0), nbytes, ir.Constant(i64, LINE)) as (at, _):
        prefetch(builder, builder.inttoptr(builder.add(address, at), i8p), ir.Constant(i64, 0), locality)


__all__ = ["LINE", "prefetch", "prefetch_lines"]
