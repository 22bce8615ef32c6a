"""A rank's warm-up at engine start: every numba kernel its model and cache will call, called once first.

    done = warm_up_rank(model, kv_dtype=torch.bfloat16, world_size=2)   # RankRunner does this on the CPU

As vLLM runs its kernels before it serves, a rank compiles (or loads from numba's on-disk cache) the
kernels of its steps before the first request: the paged attention kernel for the KV cache's element
type (and the model's, in which the window layers and contiguous decode calls read), serial and, with
several threads, on the rank's threads (a short context's step runs serially: ops.cpu_decode.kernel_threads);
the packed GEMV of each weight format the model (and its draft model) holds, serial
and, with several threads, parallel (a vocabulary split over ranks can fall on either side of
packed_linear.PARALLEL_MIN_WEIGHTS), and the 8-bit activation kernel of each where the model's packed layers take it
(activation_format="int8"); RMSNorm and RoPE for a float32 model; onepass's combine on
several ranks; prompt logprobs' reduction of a chunk of logits (any request may ask for them). Nothing
here communicates, so ranks warm up independently. A model off the CPU
warms nothing (Triton compiles in StaticDecodeStep's warm-up on CUDA).

    pretouch_cache(cache)        # every block of a PagedKVCache written once (zeros) at the rank's start

Memory is taken at start, as a GPU engine's is: the paged KV arena is allocated with torch.empty,
whose pages on Linux become resident only when first written, so without this a rank's RSS would
grow for as long as the free list hands out blocks never used before (the soak of issue 49 saw rank
0 grow 46 % over its first 11 minutes). pretouch_cache zeroes every block, which is what the engine
does anyway when a sequence starts filling one (PagedKVCache.zero_blocks), so no result changes.
"""

from __future__ import annotations

import torch

from treeattn.models.packed import PackedEmbedding, PackedLinear


def packed_kinds(*models) -> list[tuple[str, torch.dtype]]:
    """The (format, values dtype) of every packed weight in `models` (None entries skipped), sorted."""
    kinds = {(m.fmt, m.qs.dtype) for model in models if model is not None for m in model.modules()
             if isinstance(m, (PackedLinear, PackedEmbedding))}
    return sorted(kinds, key=str)


def attention_heads(model) -> list[tuple[int, int, int]]:
    """(KV heads, query heads a KV head, head dim) of every attention layer of `model` that names them
    (a tensor-parallel rank's: its share of the heads), sorted.

        >>> import torch
        >>> attn = torch.nn.Module(); attn.num_heads, attn.num_kv_heads, attn.head_dim = 9, 3, 64
        >>> attention_heads(torch.nn.Sequential(attn))
        [(3, 3, 64)]
    """
    shapes = {(m.num_kv_heads, m.num_heads // m.num_kv_heads, m.head_dim) for m in model.modules()
              if all(isinstance(getattr(m, a, None), int) for a in ("num_heads", "num_kv_heads", "head_dim"))
              and 0 < m.num_kv_heads <= m.num_heads and m.num_heads % m.num_kv_heads == 0}
    return sorted(shapes)


def warm_up_rank(model, *, kv_dtype: torch.dtype, world_size: int, draft_model=None, decode_segments: bool = False,
                 gemma_segments: bool = False) -> list[str]:
    """Warm the numba kernels `model` (and `draft_model`) and a KV cache of `kv_dtype` will call on
    this rank (see the module docstring); with decode_segments (gemma_segments: Gemma 3's), the compiled decode
    segments writing that cache (treeattn.engine.worker.compiled_decode). Returns ops.warmup.warm_kernels' lines; []
    off the CPU."""
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
                        combine=combine, int8=int8, attention_heads=attention_heads(model),
                        decode_segments=(kv_dtype,) if decode_segments else (),
                        gemma_segments=(kv_dtype,) if gemma_segments else (), logits=True)


def pretouch_cache(cache) -> int:
    """Write every block of `cache` (a treeattn.cache.paged.PagedKVCache: its keys, values and fp8
    scales) once, with zeros, so that its memory is resident from now on. Returns the bytes written.

        >>> import torch
        >>> from treeattn.cache.paged import PagedKVCache
        >>> cache = PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=2, block_size=2, dtype=torch.float32)
        >>> pretouch_cache(cache)  # 3 blocks (the pad block too) x 2 slots x K and V x 4 floats
        192
        >>> bool((cache.arena == 0).all())
        True
    """
    written = 0
    for tensor in (cache.arena, cache.scales):  # the pad block is zero already; zeroing it again changes nothing
        if tensor is not None:
            tensor.view(torch.uint8).zero_()  # in place, no temporary (torch fills no float8 tensor: its bytes)
            written += tensor.numel() * tensor.element_size()
    return written


__all__ = ["attention_heads", "packed_kinds", "pretouch_cache", "warm_up_rank"]
