"""Decode prompts with several methods each, on p local ranks: the engine of `treeattn demo`
(real weights) and `treeattn eval needle`.

    runs = decode_methods("model.gguf", [ids_a, ids_b], nproc=4, methods=(("tree", "allreduce"), ("ring", "allreduce")))
    runs[0][1].result.generated_ids      # prompt 0, second method

On p > 1 ranks every rank loads the model once and the ranks run one ta.Engine inside the group for
everything (shared_prefill_rows): the first method prefills each prompt into the sequence-sharded
cache and decodes greedily; each next method switches the engine's decode (Engine.set_decode) and
asks the same prompt again, which the prefix cache serves, so every method decodes from that one
prefill (GenerationResult.cached_prompt_tokens: the prompt tokens it found cached). On one process
the prompt is prefilled and decoded locally ("local"; tree and ring need ranks).
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
    tp: int | None = None,
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
        tp: EngineConfig.tp for nproc > 1 (the Helix layout: tp tensor-parallel x nproc / tp KV ranks, every
            rank reading only its share of the weights; None: every rank holds all of them). Checked
            against the model before any rank starts (treeattn.engine.checks.check_engine); ignored on one process.

    Returns:
        (runs[prompt][method], Timing).
    """
    threads = threads or max(1, (os.cpu_count() or 1) // nproc)
    tp = tp if nproc > 1 else None
    if tp is not None:
        check_layout(str(model_path), nproc, tp, dtype, device, weight_format)
    args = (str(model_path), [list(p) for p in prompts], tuple(methods) if nproc > 1 else (("local", "allreduce"),),
            max_new_tokens, list(stop_token_ids), threads, dtype, device, placement, kv_cache_dtype, weight_format, tp)
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
            per_rank = spawn(_decode_rank, nproc, *args, backend=backend_for(device), timeout=SPAWN_TIMEOUT_S, threads=threads,
                             method="spawn")  # spawned: glibc reads MALLOC_ENV when a process starts
        rows = per_rank[0][0]
        load_s = max(r[1] for r in per_rank)
    runs = [[MethodRun(method_name(d, m), d, m, nproc, result) for d, m, result in row] for row in rows]
    return runs, Timing(load_s=load_s, total_s=time.perf_counter() - start)


def check_layout(model_path: str, nproc: int, tp: int, dtype: str, device: str, weight_format: str) -> None:
    """The engine's own refusals of `tp` on `nproc` ranks for this checkpoint (tp must divide nproc and the
    model's query heads, and divide its KV heads or be a multiple of them; a packed matrix must split on
    its blocks), in one line (a ValueError naming tp) before any rank starts. Reads headers only.

    >>> from treeattn.eval.demo import smollm2_path
    >>> check_layout(str(smollm2_path()), 2, 1, "float32", "cpu", "auto")    # SmolLM2: 9 query heads, 3 KV heads
    >>> check_layout(str(smollm2_path()), 2, 2, "float32", "cpu", "auto")
    Traceback (most recent call last):
    ...
    treeattn.engine.errors.ConfigError: tp=2 must divide the model's 9 query heads
    """
    from treeattn.engine.checks import check_engine, with_device
    from treeattn.engine.config import EngineConfig

    config = EngineConfig(nproc=nproc, tp=tp, device=device, dtype=getattr(torch, dtype), weight_format=weight_format,
                          cache_tokens=nproc)
    check_engine(model_path, with_device(model_path, config))


def _decode_rank(rank, world_size, model_path, prompts, methods, max_new_tokens, stop_token_ids, threads, dtype, device,
                 placement, kv_cache_dtype, weight_format, tp=None, on_prompt=None):
    """One rank: load once (onto its device; with tp on several ranks only its share of the weights); on
    one process one ta.generate per prompt (its prefill and decode); on several ranks one engine for
    everything (see shared_prefill_rows). No warm-up request: every engine's ranks compile or load their
    numba kernels when they start (treeattn.engine.warmup)."""
    from treeattn.engine.device import rank_device
    from treeattn.models.loader import load_model, read_config

    torch.set_num_threads(threads)
    start = time.perf_counter()
    shard = None
    if tp is not None and world_size > 1:  # the Helix layout: this rank reads its share of the weights
        from treeattn.engine.tensor_parallel import HelixLayout, tensor_parallel_cuts

        shard = tensor_parallel_cuts(read_config(model_path), HelixLayout(world_size, tp, rank))
    model = load_model(model_path, dtype=getattr(torch, dtype), device=rank_device(device, rank), weight_format=weight_format,
                       shard=shard)
    load_s = time.perf_counter() - start
    if world_size > 1:
        rows = shared_prefill_rows(model, prompts, methods, max_new_tokens, stop_token_ids, placement, kv_cache_dtype, tp=tp)
        import torch.distributed as dist

        dist.barrier()  # leave together: a rank tearing its group down early can abort a peer still in gloo
        return rows, load_s
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
    return rows, load_s


def shared_prefill_rows(model, prompts, methods, max_new_tokens, stop_token_ids=(), placement="contiguous", kv_cache_dtype="auto",
                        block_size: int | None = None, tp: int | None = None):
    """On every rank of the default group: one ta.Engine inside the group for every prompt and method.
    Per prompt, the first method prefills it and answers; each next method switches the engine's
    decode (Engine.set_decode: the caches stay) and asks the same prompt again, which the prefix
    cache serves (its full blocks, from the window checkpoint of a hybrid model such as Gemma 3): the
    methods decode from one prefill, and each result's cached_prompt_tokens says how many prompt
    tokens came from it. The engine is sized for one sequence of the longest prompt, so a next
    prompt evicts the last one's blocks; block_size and tp are the engine's (None: EngineConfig's default;
    tp: the Helix layout, the model loaded whole or as this rank's share).
    Returns rank 0's rows [(decode, method, GenerationResult)] per prompt, None on the other ranks."""
    from treeattn.engine.client import Engine
    from treeattn.engine.config import EngineConfig
    from treeattn.engine.generate import DEFAULT_TIMEOUT_S, Generation, batch_config
    from treeattn.engine.request import SamplingParams
    from treeattn.parallel.shared_memory import group_timeout_s

    sampling = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=tuple(stop_token_ids))
    (decode, method), world_size = methods[0], torch.distributed.get_world_size()
    config = EngineConfig(nproc=world_size, tp=tp, decode=decode, method=method, placement=placement,
                          kv_cache_dtype=kv_cache_dtype,
                          timeout_s=group_timeout_s() or DEFAULT_TIMEOUT_S, block_size=block_size or EngineConfig.block_size)
    config = batch_config(config, sampling, 1, [max(prompts, key=len)], world_size)
    engine = Engine(model, config)  # the other ranks serve its steps here until rank 0 closes it
    if not engine.is_driver:
        return None
    rows = []
    try:
        for prompt in prompts:
            row = []
            for decode, method in methods:
                engine.set_decode(decode, method)
                run = Generation(model, [prompt], sampling=sampling, engine=engine)
                for _ in run:
                    pass
                row.append((decode, method, run.result))
            rows.append(row)
    finally:
        engine.close()
    return rows


__all__ = ["MethodRun", "Timing", "check_layout", "decode_methods", "method_name", "shared_prefill_rows"]
