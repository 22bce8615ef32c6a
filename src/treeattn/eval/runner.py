"""Decode prompts with several methods each, on p local ranks: the engine of `treeattn demo`
(real weights) and `treeattn eval needle`.

    runs = decode_methods("model.gguf", [ids_a, ids_b], EngineConfig(nproc=4, device="cpu"), SamplingParams(max_new_tokens=16),
                          methods=(("tree", "allreduce"), ("ring", "allreduce")))
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
from dataclasses import dataclass, replace

import torch

from treeattn.engine.config import DEFAULT_METHOD, EngineConfig
from treeattn.engine.generate import generate
from treeattn.engine.measure import malloc_env
from treeattn.engine.request import SamplingParams
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
    config: EngineConfig,
    sampling: SamplingParams,
    *,
    methods: Sequence[tuple[str, str]] = (("tree", DEFAULT_METHOD), ("ring", "allreduce")),
    on_prompt: Callable[[int], None] | None = None,
) -> tuple[list[list[MethodRun]], Timing]:
    """Greedy-decode each prompt with each method on `config.nproc` local ranks (gloo).

    Args:
        model_path: HF directory or .gguf file, loaded once on every rank.
        prompts: token id lists.
        config: how the ranks run: nproc (1 runs in this process with local attention: methods are
            then ignored), device ("cpu", "cuda", or "auto": treeattn.engine.device.resolve_device;
            rank r loads onto rank_device(device, r) and the group is NCCL for CUDA, gloo for the CPU),
            dtype (the weights' torch dtype; None: float32), placement, kv_cache_dtype, weight_format,
            block_size, threads_per_rank (None: cores // nproc, at least 1). decode and method come
            from `methods`.
        sampling: what each answer asks (max_new_tokens, stop_token_ids besides the model's eos ids;
            greedy at its default temperature 0).
        methods: (decode, tree method) pairs; decode "tree" or "ring".
        on_prompt: called in this process with the index of each finished prompt (nproc == 1 only).

    Returns:
        (runs[prompt][method], Timing).
    """
    from treeattn.engine.device import resolve_device

    nproc = config.nproc
    config = replace(config, device=resolve_device(config.device),  # "auto": CUDA when there is one, else the CPU
                     threads_per_rank=config.threads_per_rank or max(1, (os.cpu_count() or 1) // nproc))
    if nproc == 1:
        config = replace(config, tp=None)
    elif config.tp is not None:
        check_layout(str(model_path), config)
    args = (str(model_path), [list(p) for p in prompts], tuple(methods) if nproc > 1 else (("local", "allreduce"),), config,
            sampling)
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
            per_rank = spawn(_decode_rank, nproc, *args, backend=backend_for(config.device), timeout=SPAWN_TIMEOUT_S,
                             # spawned: glibc reads MALLOC_ENV when a process starts
                             threads=config.threads_per_rank, method="spawn")
        rows = per_rank[0][0]
        load_s = max(r[1] for r in per_rank)
    runs = [[MethodRun(method_name(d, m), d, m, nproc, result) for d, m, result in row] for row in rows]
    return runs, Timing(load_s=load_s, total_s=time.perf_counter() - start)


def check_layout(model_path: str, config: EngineConfig) -> None:
    """The engine's own refusals of `config.tp` on `config.nproc` ranks for this checkpoint (tp must divide
    nproc and the model's query heads, and divide its KV heads or be a multiple of them; a packed matrix
    must split on its blocks), in one line (a ConfigError naming tp) before any rank starts. Reads headers only.

    >>> from treeattn.eval.demo import smollm2_path
    >>> check_layout(str(smollm2_path()), EngineConfig(nproc=2, tp=1, device="cpu"))    # SmolLM2: 9 query heads, 3 KV heads
    >>> check_layout(str(smollm2_path()), EngineConfig(nproc=2, tp=2, device="cpu"))
    Traceback (most recent call last):
    ...
    treeattn.engine.errors.ConfigError: tp=2 must divide the model's 9 query heads
    """
    from treeattn.engine.checks import check_engine, with_device

    check_engine(model_path, with_device(model_path, replace(config, cache_tokens=config.nproc)))


def _decode_rank(rank, world_size, model_path, prompts, methods, config: EngineConfig, sampling: SamplingParams, on_prompt=None):
    """One rank: load once (onto its device); on one process one ta.generate per prompt (its prefill
    and decode); on several ranks one engine for everything (see shared_prefill_rows). No warm-up
    request: every engine's ranks compile or load their numba kernels when they start (treeattn.engine.worker.warmup)."""
    from treeattn.engine.device import rank_device
    from treeattn.models.loader import load_model, read_config

    torch.set_num_threads(config.threads_per_rank)
    start = time.perf_counter()
    shard = None
    if config.tp is not None and world_size > 1:  # the Helix layout: this rank reads its share of the weights
        from treeattn.engine.worker.tensor_parallel import HelixLayout, tensor_parallel_cuts

        shard = tensor_parallel_cuts(read_config(model_path), HelixLayout(world_size, config.tp, rank))
    model = load_model(model_path, dtype=config.dtype or torch.float32, device=rank_device(config.device, rank),
                       weight_format=config.weight_format, shard=shard)
    load_s = time.perf_counter() - start
    if world_size > 1:
        rows = shared_prefill_rows(model, prompts, methods, config, sampling)
        import torch.distributed as dist

        dist.barrier()  # leave together: a rank tearing its group down early can abort a peer still in gloo
        return rows, load_s
    rows = []
    for index, prompt in enumerate(prompts):
        row = []
        for decode, method in methods:
            result = generate(model, prompt, _engine_config(config, decode, method), sampling)
            row.append((decode, method, result))
        rows.append(row)
        if on_prompt is not None:
            on_prompt(index)
    return rows, load_s


def _engine_config(config: EngineConfig, decode: str, method: str, **changes) -> EngineConfig:
    """The engine's config of one method: what `config` says of the cache (placement, kv_cache_dtype,
    block_size), the rest as a loaded model's engine takes it by default (its own device and dtype)."""
    return EngineConfig(nproc=config.nproc, tp=config.tp, decode=decode, method=method, placement=config.placement,
                        kv_cache_dtype=config.kv_cache_dtype, block_size=config.block_size, **changes)


def shared_prefill_rows(model, prompts, methods, config: EngineConfig, sampling: SamplingParams):
    """On every rank of the default group: one ta.Engine inside the group for every prompt and method.
    Per prompt, the first method prefills it and answers; each next method switches the engine's
    decode (Engine.set_decode: the caches stay) and asks the same prompt again, which the prefix
    cache serves (its full blocks, from the window checkpoint of a hybrid model such as Gemma 3): the
    methods decode from one prefill, and each result's cached_prompt_tokens says how many prompt
    tokens came from it. The engine is sized for one sequence of the longest prompt, so a next
    prompt evicts the last one's blocks; `config` gives placement, kv_cache_dtype and block_size.
    Returns rank 0's rows [(decode, method, GenerationResult)] per prompt, None on the other ranks."""
    from treeattn.engine.client import Engine
    from treeattn.engine.generate import DEFAULT_TIMEOUT_S, Generation, batch_config
    from treeattn.parallel.shared_memory import group_timeout_s

    (decode, method), world_size = methods[0], torch.distributed.get_world_size()
    config = _engine_config(config, decode, method, timeout_s=group_timeout_s() or DEFAULT_TIMEOUT_S)
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
