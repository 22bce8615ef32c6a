"""Decode prompts with several methods each, on p local ranks: the engine of `treeattn demo`
(real weights) and `treeattn eval needle`.

    runs = decode_methods("model.gguf", [ids_a, ids_b], nproc=4, methods=(("tree", "allreduce"), ("ring", "allreduce")))
    runs[0][1].result.generated_ids      # prompt 0, second method

On p > 1 ranks every rank loads the model once, then for each prompt and method runs ta.generate
(the engine inside the group: its ring prefill into the sequence-sharded cache, then greedy
decoding with that method). On one process the prompt is prefilled and decoded locally ("local";
tree and ring need ranks).
Results come from rank 0; every rank returns the same tokens by construction (rank 0 samples and
broadcasts).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from treeattn.engine.config import DEFAULT_METHOD
from treeattn.engine.generate import generate
from treeattn.engine.measure import malloc_env
from treeattn.eval.synthetic import MethodRun  # one MethodRun for both demos

SPAWN_TIMEOUT_S = 1800.0  # a collective may wait this long for a slow peer's prefill


@dataclass
class Timing:
    """Wall seconds of a decode_methods call: model load (slowest rank) and everything."""

    load_s: float
    total_s: float


def method_name(decode: str, method: str) -> str:
    return f"tree ({method})" if decode == "tree" else "ring (pass-KV)" if decode == "ring" else "single process (local)"


def decode_methods(
    model_path: str,
    prompts: Sequence[Sequence[int]],
    *,
    nproc: int,
    methods: Sequence[tuple[str, str]] = (("tree", DEFAULT_METHOD), ("ring", "allreduce")),
    max_new_tokens: int = 16,
    stop_token_ids: Sequence[int] = (),
    threads: int | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    placement: str = "contiguous",
    on_prompt: Callable[[int], None] | None = None,
    kv_cache_dtype: str = "auto",
    weight_format: str = "auto",
) -> tuple[list[list[MethodRun]], Timing]:
    """Greedy-decode each prompt with each method on `nproc` local ranks (gloo).

    Args:
        model_path: HF directory or .gguf file, loaded once on every rank.
        prompts: token id lists.
        nproc: ranks; 1 runs in this process with local attention (methods are then ignored).
        methods: (decode, tree method) pairs; decode "tree" or "ring".
        max_new_tokens, stop_token_ids: as in ta.generate (SamplingParams: ids that stop besides the model's eos).
        threads: torch threads per rank; default cores // nproc (at least 1).
        dtype: parameter dtype name ("float32", "bfloat16", "float16").
        device: "cpu" or "cuda" (resolved, treeattn.engine.device.resolve_device): rank r loads onto
            rank_device(device, r) and the ranks' group is NCCL for CUDA, gloo for the CPU.
        placement: cache placement of tokens on ranks ("contiguous" or "interleaved").
        on_prompt: called in this process with the index of each finished prompt (nproc == 1 only).
        kv_cache_dtype, weight_format: as EngineConfig takes them (what the KV cache stores; how a
            GGUF file's quantized weights are held).

    Returns:
        (runs[prompt][method], Timing).
    """
    threads = threads or max(1, (os.cpu_count() or 1) // nproc)
    args = (str(model_path), [list(p) for p in prompts], tuple(methods) if nproc > 1 else (("local", "allreduce"),),
            max_new_tokens, list(stop_token_ids), threads, dtype, device, placement, kv_cache_dtype, weight_format)
    start = time.perf_counter()
    if nproc == 1:
        saved = torch.get_num_threads()
        try:
            rows, load_s = _decode_rank(0, 1, *args, on_prompt=on_prompt)
        finally:
            torch.set_num_threads(saved)
    else:
        from treeattn.engine.device import backend_for
        from treeattn.parallel import spawn

        with malloc_env():  # the ranks' resident memory follows their live tensors
            per_rank = spawn(_decode_rank, nproc, *args, backend=backend_for(device), timeout=SPAWN_TIMEOUT_S)
        rows = per_rank[0][0]
        load_s = max(r[1] for r in per_rank)
    runs = [[MethodRun(method_name(d, m), d, m, nproc, result) for d, m, result in row] for row in rows]
    return runs, Timing(load_s=load_s, total_s=time.perf_counter() - start)


def _decode_rank(rank, world_size, model_path, prompts, methods, max_new_tokens, stop_token_ids, threads, dtype, device,
                 placement, kv_cache_dtype, weight_format, on_prompt=None):
    """One rank: load once (onto its device), then per prompt and method one ta.generate (a prefill and the decode)."""
    from treeattn.engine.device import rank_device
    from treeattn.models.loader import load_model

    torch.set_num_threads(threads)
    start = time.perf_counter()
    model = load_model(model_path, dtype=getattr(torch, dtype), device=rank_device(device, rank), weight_format=weight_format)
    load_s = time.perf_counter() - start
    rows = []
    for index, prompt in enumerate(prompts):
        row = []
        for decode, method in methods:
            result = generate(model, prompt, max_new_tokens=max_new_tokens, decode=decode, method=method,
                              stop_token_ids=stop_token_ids, placement=placement, kv_cache_dtype=kv_cache_dtype)
            row.append((decode, method, result))
        rows.append(row)
        if on_prompt is not None:
            on_prompt(index)
    if world_size > 1:
        import torch.distributed as dist

        dist.barrier()  # leave together: a rank tearing its group down early can abort a peer still in gloo
    return (rows if rank == 0 else None), load_s


__all__ = ["MethodRun", "Timing", "decode_methods", "method_name"]
