"""Human-readable quantities for the cost model's tables: 16.5 KB, 39.1 GiB, 450 GB/s, 5 us.

Bytes that travel (messages, link traffic) are in decimal units (1 KB = 1000 B), as link bandwidths
are quoted (GB/s); memory is in binary units (1 GiB = 2**30 B), as device memory is. Three
significant digits throughout.
"""

from __future__ import annotations

import math


def _scaled(value: float, units: tuple[tuple[str, float], ...], smallest: str) -> str:
    if not math.isfinite(value):
        return str(value)
    for unit, size in units:
        if abs(value) >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.3g} {smallest}"


def format_bytes(n: float) -> str:
    """Bytes sent, decimal: 16510 -> '16.5 KB', 512 -> '512 B'."""
    return _scaled(n, (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)), "B")


def format_memory(n: float) -> str:
    """Bytes of memory, binary: 41943040000 -> '39.1 GiB'."""
    return _scaled(n, (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)), "B")


def format_seconds(s: float) -> str:
    """0.0123 -> '12.3 ms', 5e-06 -> '5 us', 3.4 -> '3.4 s'."""
    return "0 s" if s == 0 else _scaled(s, (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)), "s")


def format_rate(bytes_per_second: float) -> str:
    """Bytes per second, decimal: 4.5e11 -> '450 GB/s'."""
    return format_bytes(bytes_per_second) + "/s"


def format_flops(flops: float) -> str:
    """FLOP/s: 9.89e14 -> '989 TFLOP/s'."""
    return _scaled(flops, (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6)), "FLOP/s")
