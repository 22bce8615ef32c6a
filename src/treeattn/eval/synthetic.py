"""The synthetic demo behind `treeattn demo --synthetic`: long-context decoding on local CPU ranks, tree vs ring, no download.

A small Llama-architecture model with random weights (the same on every rank for a seed) gets a
synthetic prompt of `context` tokens. On `nproc` gloo ranks the prompt is prefilled into the
sequence-sharded KV cache (the engine's ring prefill) and decoded greedily, once per method --
tree_decode and ring_decode (pass-KV). A single process then prefills and decodes the same prompt
with plain attention over the whole cache, and every method must give its tokens.

run_demo() returns the measurements; treeattn.eval.demo_cli renders them. benchmarks/engine/engine_decode.py uses it too.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from treeattn.engine.config import DEFAULT_METHOD
from treeattn.engine.generate import GenerationResult, generate
from treeattn.engine.measure import malloc_env
from treeattn.models.llama import LlamaConfig, random_model
from treeattn.models.synthetic import DEMO_CONFIG, synthetic_prompt

logger = logging.getLogger(__name__)


@dataclass
class MethodRun:
    """One decoding method of the demo. `result` is rank 0's GenerationResult."""

    name: str
    decode: str
    method: str
    world_size: int
    result: GenerationResult


def demo_config() -> LlamaConfig:
    return LlamaConfig(**DEMO_CONFIG)


def run_demo(
    *,
    context: int = 32768,
    nproc: int = 4,
    new_tokens: int = 16,
    methods: tuple[tuple[str, str], ...] = (("tree", DEFAULT_METHOD), ("ring", "allreduce")),
    placement: str = "contiguous",
    threads_per_rank: int | None = None,
    seed: int = 0,
    dtype: str = "float32",
    device: str = "cpu",
    kv_cache_dtype: str = "auto",
) -> tuple[list[MethodRun], float]:
    """Decode a random-weight model from a `context`-token prompt on `nproc` local ranks.

    Args:
        context: prompt length in tokens.
        nproc: number of local gloo ranks.
        new_tokens: greedy tokens per method.
        methods: (decode, tree method) pairs, run one after the other (a prefill each).
        placement: cache placement on the ranks.
        threads_per_rank: torch threads in each rank; default cores // nproc (at least 1).
        seed: model weights and prompt.
        dtype: the model's dtype name (the weights are drawn in float32, then converted).
        device: "cpu" or "cuda" (resolved): rank r runs on rank_device(device, r), in an NCCL group for CUDA.
        kv_cache_dtype: what the KV cache stores (EngineConfig.kv_cache_dtype).

    Returns:
        (one MethodRun per method, wall seconds of the whole sharded run incl. process start).
    """
    from treeattn.engine.device import backend_for
    from treeattn.parallel import spawn

    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // nproc)
    with malloc_env():  # the ranks' resident memory follows their live tensors
        start = time.perf_counter()
        per_rank = spawn(_demo_rank, nproc, context, new_tokens, tuple(methods), placement, threads, seed, dtype, device,
                         kv_cache_dtype, backend=backend_for(device), timeout=600, threads=threads,
                         method="spawn")  # spawned: glibc reads MALLOC_ENV when a process starts
        sharded_s = time.perf_counter() - start
    return [MethodRun(name, decode, method, nproc, result) for name, decode, method, result in per_rank[0]], sharded_s


def run_reference(*, context: int = 32768, new_tokens: int = 16, seed: int = 0, threads: int | None = None,
                  dtype: str = "float32", device: str = "cpu", kv_cache_dtype: str = "auto") -> MethodRun:
    """Prefill and decode the demo prompt in this process with plain attention over the whole cache
    (dtype, device, kv_cache_dtype: as run_demo takes them; CUDA: the first GPU)."""
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    try:
        model = _demo_model(seed, dtype, device, rank=0)
        prompt = synthetic_prompt(context, model.config.vocab_size, seed)
        result = generate(model, prompt, max_new_tokens=new_tokens, decode="local", ignore_eos=True,
                          kv_cache_dtype=kv_cache_dtype)
    finally:
        torch.set_num_threads(saved_threads)
    return MethodRun("single process (local)", "local", "-", 1, result)


def _demo_model(seed: int, dtype: str, device: str, rank: int):
    """The demo's random-weight model (the same for a seed on every rank) on rank `rank`'s device."""
    from treeattn.engine.device import rank_device

    return random_model(demo_config(), seed=seed, dtype=getattr(torch, dtype)).to(rank_device(device, rank))


def _demo_rank(rank: int, world_size: int, context, new_tokens, methods, placement, threads, seed, dtype="float32", device="cpu",
               kv_cache_dtype="auto"):
    """One rank: build the model, then prefill and decode the prompt with each method."""
    torch.set_num_threads(threads)
    model = _demo_model(seed, dtype, device, rank)
    prompt = synthetic_prompt(context, model.config.vocab_size, seed)
    rows = []
    for decode, method in methods:
        name = f"tree ({method})" if decode == "tree" else "ring (pass-KV)" if decode == "ring" else decode
        result = generate(model, prompt, max_new_tokens=new_tokens, decode=decode, method=method, placement=placement,
                          ignore_eos=True, kv_cache_dtype=kv_cache_dtype)
        rows.append((name, decode, method, result))
    return rows
