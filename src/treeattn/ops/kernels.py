"""The compiled kernels that need an optional dependency, imported on first use: numba's CPU kernels
(paged decode attention, packed-weight GEMV, onepass's combine, RMSNorm and RoPE, prompt logprobs'
reductions) and the Triton decode kernel for CUDA.

    module = optional_kernel("paged_cpu_kernel")   # treeattn.ops.paged_cpu_kernel, or None without numba
    rows = numpy_rows(x, width)                    # a float32 CPU tensor as the (-1, width) array numba's kernels take

Each caller keeps its torch path for None, so a missing numba or triton slows a path down and never
breaks it; the first miss is logged (INFO) once per kernel.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType

import numpy as np
import torch

logger = logging.getLogger(__name__)

KERNELS = {"paged_cpu_kernel": "numba", "packed_cpu_kernel": "numba", "packed_int8_kernel": "numba",
           "combine_cpu_kernel": "numba", "rowwise_cpu_kernel": "numba", "logits_cpu_kernel": "numba",
           "triton_decode": "triton"}
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


def numpy_rows(t: torch.Tensor, width: int) -> np.ndarray:
    """t, a float32 CPU tensor outside autograd (callers check), as a C-contiguous numpy (-1, width)
    array: a view when t is contiguous, else a contiguous copy's. numpy's reshape costs a fraction of
    torch's reshape and view around a small kernel call."""
    if t.requires_grad:  # a parameter read while grad is off
        t = t.detach()
    return (t if t.is_contiguous() else t.contiguous()).numpy().reshape(-1, width)


__all__ = ["KERNELS", "numpy_rows", "optional_kernel"]
