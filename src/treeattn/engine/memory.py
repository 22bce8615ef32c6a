"""Memory: how many bytes a model and its cache take, how many a device has, and the one check that they fit.

    kv = kv_cache_bytes_per_rank(config, model.config, torch.bfloat16)   # one rank's KV cache of an EngineConfig
    check_memory_fit(ranks=2, weights=model_bytes(model, torch.bfloat16), cache=kv, draft=0, device="cpu",
                     cache_option="cache_tokens")   # ConfigError naming the option to change, or nothing

check_memory_fit is the one memory check: the engine (checks.check_memory), ta.generate and
`treeattn generate` (before spawning its ranks, through checks.check_memory too) ask it. Every rank
on this machine holds all the weights (and the draft model's), and its share of the KV cache.
"""

from __future__ import annotations

import os

import torch

from treeattn.engine.errors import ConfigError


def model_bytes(model, dtype: torch.dtype) -> int:
    """Bytes of a model's weights in `dtype`: a loaded model's parameters (a model with packed weights:
    what it holds), or a checkpoint's (a directory or .gguf file, read without its weights; counted
    dequantized, an upper bound for weight_format "packed")."""
    if isinstance(model, (str, os.PathLike)):
        from treeattn.models.loader import check_checkpoint

        model = check_checkpoint(model, dtype=dtype)
    from treeattn.models.packed import is_packed, weight_bytes

    if is_packed(model):
        return weight_bytes(model)
    return sum(p.numel() for p in model.parameters()) * torch.empty((), dtype=dtype).element_size()


def kv_cache_bytes_per_rank(config, model_config, dtype: torch.dtype, *, blocks_for=None,
                            compute_dtype: torch.dtype | None = None) -> int:
    """Bytes of KV cache one rank of an engine with EngineConfig `config` allocates for a model of
    `model_config` in `dtype`: keys and values of every slot of its paged arena (config.blocks_per_rank
    blocks and the pad block, treeattn.cache.paged), plus a hybrid model's window layers, which every
    rank keeps per running sequence (max_batch_size of them; treeattn.cache.window) and, with the
    prefix cache, as many window checkpoints at most (treeattn.cache.prefix). `blocks_for`: the
    model config that sizes the arena when it is not `model_config`'s (a draft model's cache has the
    blocks of the model's). `compute_dtype`: the model's dtype (the window rings' held_dtype)."""
    from treeattn.cache.sharded import kv_bytes_per_token
    from treeattn.cache.window import window_bytes_per_sequence

    blocks = config.blocks_per_rank((blocks_for or model_config).max_position_embeddings) + 1
    per_sequence = window_bytes_per_sequence(model_config, dtype, compute_dtype)
    windows = config.max_batch_size * (2 if config.prefix_cache else 1) * per_sequence
    total = blocks * config.block_size * kv_bytes_per_token(model_config, dtype) + windows
    if getattr(config, "tp", None) is not None and config.nproc > 1 and blocks_for is None:  # the Helix layout: its KV heads
        from treeattn.engine.worker.tensor_parallel import HelixLayout, local_heads

        total = total * local_heads(model_config, HelixLayout(config.nproc, config.tp, 0))[1] // model_config.num_kv_heads
    return total


def device_memory_bytes(device: torch.device | str) -> int | None:
    """Memory `device` offers: the machine's RAM for "cpu", the GPU's free memory for "cuda"
    (torch.cuda.mem_get_info: what other processes and this one hold is already taken); None if unknown."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.mem_get_info(device.index if device.index is not None else torch.cuda.current_device())[0]
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    return None


def format_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def check_memory_fit(*, ranks: int, weights: int, cache: int, draft: int, device, cache_option: str) -> None:
    """`ranks` ranks on this machine, each holding `weights` bytes of weights, `cache` bytes of KV
    cache and `draft` bytes of draft model with its cache, against the memory of `device` (the
    machine's RAM for the CPU; a GPU's free memory, where each CUDA rank has its own GPU: ranks=1).

    Raises:
        ConfigError naming the option to change: "draft_model" when the draft alone does not fit,
        else "nproc" when one rank would fit, else `cache_option` (the option that sizes the cache).
    """
    device = torch.device(device)
    available = device_memory_bytes(device)
    where = f"free on {device}" if device.type == "cuda" else "of memory of this machine"
    total = ranks * (weights + cache + draft)
    if available is None or total <= available:
        return
    option = ("draft_model" if ranks * (weights + cache) <= available else "nproc" if weights + cache + draft <= available
              else cache_option)
    drafted = f" + {format_bytes(draft)} of draft model and its cache" if draft else ""
    raise ConfigError(option,
                      f"{option}: {ranks} rank(s) x ({format_bytes(weights)} of weights + {format_bytes(cache)} of KV cache"
                              f"{drafted}) = {format_bytes(total)}, more than the {format_bytes(available)} {where}")
