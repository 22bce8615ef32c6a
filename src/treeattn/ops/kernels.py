"""The compiled kernels that need an optional dependency, imported on first use: numba's CPU kernels
(paged decode attention, packed-weight GEMV, onepass's combine, RMSNorm and RoPE) and the Triton decode kernel for CUDA.

    module = optional_kernel("paged_cpu_kernel")   # treeattn.ops.paged_cpu_kernel, or None without numba

Each caller keeps its torch path for None, so a missing numba or triton slows a path down and never
breaks it; the first miss is logged (INFO) once per kernel.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType

logger = logging.getLogger(__name__)

KERNELS = {"paged_cpu_kernel": "numba", "packed_cpu_kernel": "numba", "combine_cpu_kernel": "numba", "rowwise_cpu_kernel": "numba", "triton_decode": "triton"}
"""Each optional kernel module of treeattn.ops and the dependency it needs."""


@functools.lru_cache(maxsize=None)
def optional_kernel(name: str) -> ModuleType | None:
    """treeattn.ops.<name> (one of KERNELS), or None (logged once) when its optional dependency is missing."""
    if name not in KERNELS:
        raise ValueError(f"name must be one of {sorted(KERNELS)}, got {name!r}")
    try:
        return importlib.import_module(f"treeattn.ops.{name}")
    except ImportError as exc:
        logger.info("treeattn.ops.%s unavailable (%s, an optional dependency): the torch path runs instead", name, exc)
        return None


__all__ = ["KERNELS", "optional_kernel"]
