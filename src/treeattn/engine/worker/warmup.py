"""A rank's warm-up at engine start: every numba kernel its model and cache will call, called once first.

    done = warm_up_rank(model, kv_dtype=torch.bfloat16, world_size=2)   # RankRunner does this on the CPU

As vLLM runs its kernels before it serves, a rank compiles (or loads from numba's on-disk cache) the
kernels of its steps before the first request: the paged attention kernel for the KV cache's element
type (and the model's, in which the window layers and contiguous decode calls read), serial or on the
rank's threads; the packed GEMV of each weight format the model (and its draft model) holds, serial
and, with several threads, parallel (a vocabulary split over ranks can fall on either side of
packed_linear.PARALLEL_MIN_WEIGHTS), and the 8-bit activation kernel of each where the model's packed layers take it
(activation_format="int8"); RMSNorm and RoPE for a float32 model; onepass's combine on
several ranks. Nothing here communicates, so ranks warm up independently. A model off the CPU
warms nothing (Triton compiles in StaticDecodeStep's warm-up on CUDA).
"""

from __future__ import annotations

import torch

from treeattn.models.packed import PackedEmbedding, PackedLinear


def packed_kinds(*models) -> list[tuple[str, torch.dtype]]:
    """The (format, values dtype) of every packed weight in `models` (None entries skipped), sorted."""
    kinds = {(m.fmt, m.qs.dtype) for model in models if model is not None for m in model.modules()
             if isinstance(m, (PackedLinear, PackedEmbedding))}
    return sorted(kinds, key=str)


def warm_up_rank(model, *, kv_dtype: torch.dtype, world_size: int, draft_model=None) -> list[str]:
    """Warm the numba kernels `model` (and `draft_model`) and a KV cache of `kv_dtype` will call on
    this rank (see the module docstring). Returns ops.warmup.warm_kernels' lines; [] off the CPU."""
    weight = next(model.parameters(), None)  # the model's device and dtype (not every model family names them)
    if weight is None or weight.device.type != "cpu":
        return []
    dtype = getattr(model, "dtype", weight.dtype)
    from treeattn.ops.warmup import KV_DTYPES, warm_kernels  # here: `python -m treeattn.ops.warmup` runs it as __main__

    threads = torch.get_num_threads()
    packed = [(fmt, values, t) for fmt, values in packed_kinds(model, draft_model) for t in sorted({1, threads})]
    kv_dtypes = [d for d in dict.fromkeys((kv_dtype, dtype)) if d in KV_DTYPES]
    combine = (dtype,) if world_size > 1 and dtype in (torch.float32, torch.float64) else ()
    int8 = any(getattr(m, "activations", None) == "int8" for m in model.modules())  # set_activation_format: its kernel too
    return warm_kernels(kv_dtypes=kv_dtypes, attention_threads=threads, packed=packed, rowwise=dtype == torch.float32,
                        combine=combine, int8=int8)


__all__ = ["packed_kinds", "warm_up_rank"]
