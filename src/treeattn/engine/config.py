"""What one generation is: a frozen GenerationConfig, validated once, the same on every rank.

    config = GenerationConfig(max_new_tokens=64, temperature=0.7, top_p=0.9, decode="tree")
    warnings = check_against_model(config, model.config, prompts, world_size=4)   # before spawning

`GenerationConfig.__post_init__` checks every field on its own and the combinations that need no
model (num_samples > 1 with decode "ring", ...). `check_against_model` checks what needs the model
and the prompts (token ids in the vocabulary, capacity, decode "local" on several ranks, a ring
prefill through a sliding window, the memory the KV cache reserves). The CLI calls both in the
parent process, before spawning the ranks; ta.generate calls them on every rank. Either way a
bad value fails once, with one line naming the option: a ConfigError (a ValueError) whose
`.option` is the field's name (ConfigTypeError, also a TypeError, for a value of the wrong type).
"""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from treeattn.cache.placement import PLACEMENTS, make_placement
from treeattn.cache.sharded import kv_bytes_per_token
from treeattn.engine.ring_prefill import PREFILL_KINDS
from treeattn.models.attention import DECODE_KINDS
from treeattn.parallel.tree_decode import METHODS
from treeattn.speculate import MAX_DRAFT_TOKENS, SPECULATE_KINDS

DEFAULT_METHOD = "onepass"
"""tree_decode's combine when none is named: the fastest exact one measured on this repository's
machine (docs/benchmarks.md, "One round per layer"). The static and CUDA-graph steps, which may not
read the host inside a step, take "allreduce" instead."""


class ConfigError(ValueError):
    """A bad generation option. `option` is the field's name ("top_p"), for the CLI's flag."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


class ConfigTypeError(ConfigError, TypeError):
    """A generation option of the wrong type (a TypeError too)."""


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0: greedy; else logits / temperature, then top_k, then top_p, then one draw."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if not _is_real(t) or not (math.isfinite(t) and t >= 0):
            raise ConfigError("temperature", f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise ConfigError("top_k", f"top_k must be a positive int or None, got {self.top_k!r}")
        if self.top_p is not None and (not _is_real(self.top_p) or not 0 < self.top_p <= 1):
            raise ConfigError("top_p", f"top_p must be in (0, 1] or None, got {self.top_p!r}")


def resolve_method(method: str | None, static_option: str | None) -> str:
    """tree_decode's combine for a generation or an engine: `method`, or when None the default
    (DEFAULT_METHOD; "allreduce" when `static_option` names the option that asks for static or
    CUDA-graph steps, e.g. "cuda_graph" or "decode_step"). Static steps may not read the host inside a
    step, which "onepass" does (one flag per layer): ConfigError naming method. Unknown methods are
    left to the caller's own check."""
    if method is None:
        return "allreduce" if static_option else DEFAULT_METHOD
    if method == "onepass" and static_option:
        raise ConfigError("method", f"method='onepass' reads one flag on the host per layer, which {static_option} forbids "
                          "inside a step: use method='allreduce' or method='tree'")
    return method


def check_draft_model_option(speculate: str | None, draft_model):
    """The draft_model option of a generation or an engine, checked against speculate: a checkpoint
    path (a path-like becomes a str) or a loaded model, given exactly when speculate == "draft".
    Returns it normalized; raises ConfigError naming draft_model or speculate."""
    if isinstance(draft_model, os.PathLike):
        draft_model = os.fspath(draft_model)
    if draft_model is not None and not isinstance(draft_model, (str, torch.nn.Module)):
        raise ConfigTypeError("draft_model", f"draft_model must be a checkpoint path or a loaded model, "
                              f"got {type(draft_model).__name__}")
    if draft_model is not None and speculate != "draft":
        got = "no speculation" if speculate is None else f"speculate={speculate!r}"
        raise ConfigError("draft_model", f"draft_model is the drafter of speculate='draft', got {got}")
    if speculate == "draft" and draft_model is None:
        raise ConfigError("speculate", "speculate='draft' needs draft_model=PATH, the draft model's checkpoint")
    return draft_model


@dataclass(frozen=True)
class GenerationConfig:
    """Every option of one generation (see treeattn.generate.generate for what each does).

    Attributes:
        max_new_tokens: new tokens per sequence, >= 1.
        temperature, top_k, top_p: sampling (SamplingParams); temperature 0 is greedy.
        seed: sampling seed, >= 0: sequence i draws from a generator seeded with seed + i.
        stop_tokens: token ids that end a sequence (a tuple); None: the model's eos ids.
        num_samples: n >= 1 completions of one prompt (n > 1: the prompt prefilled once, the
            samples decoding over its shared blocks).
        decode: "tree", "ring" or "local". method: tree_decode's "allreduce", "tree", "twolevel" or
            "onepass"; None (the default): DEFAULT_METHOD, or "allreduce" for static_decode and
            cuda_graph (onepass reads one flag on the host per layer). Set after validation.
        prefill: the engine's prefill of prompt steps on several ranks, "auto", "ring" or "split"
            (EngineConfig.prefill). placement: "contiguous" or "interleaved".
        block_size: cache block size in tokens. capacity: cache slots per sequence (None: the
            longest prompt + max_new_tokens). chunk: prompt tokens per engine step at most.
        static_decode, cuda_graph: the engine's fixed-shape decode steps, eager or in CUDA graphs
            (EngineConfig.decode_step "static" / "graph").
        speculate: None, "ngram" (prompt-lookup drafts, treeattn.speculate) or "draft" (a draft model's,
            treeattn.draft_model): speculative decoding, verified by one forward pass of the model per
            step. One prompt, num_samples 1, dynamic steps. The engine's (EngineConfig.speculate).
        draft_tokens: the most tokens drafted per step, in [1, MAX_DRAFT_TOKENS].
        draft_model: with speculate="draft" (and only then): the draft model's checkpoint path (an HF
            directory or a .gguf file; a str, what travels to the ranks), or a loaded model (in one
            process). Its tokenizer and context window are checked against the model's where the
            model is known (check_draft_model). It runs on every rank over its own cache of the
            model's blocks (treeattn.engine.draft).
        shared_memory: combine across the ranks through shared memory when they all run on this
            host and the model is on the CPU (treeattn.parallel.shared_memory); else, or with
            False, through the process group's back end (gloo, NCCL).
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    stop_tokens: tuple[int, ...] | None = None
    num_samples: int = 1
    decode: str = "tree"
    method: str | None = None
    prefill: str = "auto"
    placement: str = "contiguous"
    block_size: int = 256
    capacity: int | None = None
    chunk: int = 1024
    static_decode: bool = False
    cuda_graph: bool = False
    speculate: str | None = None
    draft_tokens: int = 4
    draft_model: str | torch.nn.Module | None = None
    shared_memory: bool = True

    def __post_init__(self) -> None:
        for name, low in (("max_new_tokens", 1), ("seed", 0), ("num_samples", 1), ("block_size", 1), ("chunk", 1)):
            _check_int(name, getattr(self, name), low)
        if self.seed >= 2**64:
            raise ConfigError("seed", f"seed must be below 2**64 (a torch.Generator seed), got {self.seed}")
        if self.capacity is not None:
            _check_int("capacity", self.capacity, 1)
        self.sampling  # noqa: B018  (validates temperature, top_k, top_p)
        if self.stop_tokens is not None:
            object.__setattr__(self, "stop_tokens", _token_tuple(self.stop_tokens))
        static = "cuda_graph=True" if self.cuda_graph is True else "static_decode=True" if self.static_decode is True else None
        object.__setattr__(self, "method", resolve_method(self.method, static))
        for name, allowed in (("decode", DECODE_KINDS), ("method", METHODS), ("prefill", PREFILL_KINDS), ("placement", PLACEMENTS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(name, f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("static_decode", "cuda_graph", "shared_memory"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigTypeError(name, f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        self._check_speculation()

    def _check_speculation(self) -> None:
        _check_int("draft_tokens", self.draft_tokens, 1)
        if self.draft_tokens > MAX_DRAFT_TOKENS:
            raise ConfigError("draft_tokens", f"draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], got {self.draft_tokens}")
        if self.speculate is not None and self.speculate not in SPECULATE_KINDS:
            raise ConfigError("speculate", f"speculate must be None or one of {SPECULATE_KINDS}, got {self.speculate!r}")
        object.__setattr__(self, "draft_model", check_draft_model_option(self.speculate, self.draft_model))
        if self.speculate is None:
            return
        if self.num_samples > 1:
            raise ConfigError("speculate", f"speculate={self.speculate!r} decodes one sequence; num_samples={self.num_samples} "
                              "asks for several")
        if self.static_decode or self.cuda_graph:
            option = "cuda_graph" if self.cuda_graph else "static_decode"
            raise ConfigError("speculate", f"speculate={self.speculate!r} verifies a varying number of tokens per step; "
                              f"{option}=True runs fixed one-token steps")

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)

    @property
    def decode_step(self) -> str:
        """ "dynamic", "static" (static_decode) or "graph" (cuda_graph)."""
        return "graph" if self.cuda_graph else "static" if self.static_decode else "dynamic"

    def cache_capacity(self, longest_prompt: int) -> int:
        """Cache slots per sequence: `capacity`, or the longest prompt + max_new_tokens."""
        return self.capacity if self.capacity is not None else longest_prompt + self.max_new_tokens

    def blocks_per_rank(self, longest_prompt: int, batch: int, world_size: int) -> int:
        """Cache blocks on each rank for `batch` prompts (times num_samples sequences) of
        cache_capacity slots each: every sequence's blocks dealt over the ranks."""
        span = -(-self.cache_capacity(longest_prompt) // (self.block_size * world_size))
        return batch * self.num_samples * span

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def check_prompts(prompts, vocab_size: int) -> list[list[int]]:
    """One prompt (ints) or a batch (lists of ints) -> list of non-empty lists of ids in [0, vocab_size)."""
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist()
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ConfigError("prompts", f"prompts must be a non-empty list of token ids or of lists of token ids, got {prompts!r:.80}")
    if all(_is_int(t) for t in prompts):
        prompts = [prompts]
    checked = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)) or len(prompt) == 0:
            raise ConfigError("prompts", f"prompt {i} must be a non-empty list of token ids, got {prompt!r:.80}")
        for t in prompt:
            if not _is_int(t):
                raise ConfigTypeError("prompts", f"prompt {i}: token ids must be ints, got {type(t).__name__} ({t!r})")
            if not 0 <= t < vocab_size:
                raise ConfigError("prompts", f"prompt {i}: token id {t} is outside the vocabulary [0, {vocab_size})")
        checked.append([int(t) for t in prompt])
    return checked


def check_against_model(config: GenerationConfig, model_config, prompts: list[list[int]], world_size: int, *,
                        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> list[str]:
    """Check `config` against the model, the (checked) prompts and the number of ranks.

    Args:
        config: the generation's options.
        model_config: the model's LlamaConfig.
        prompts: the output of check_prompts.
        world_size: ranks the KV cache is sharded over.
        dtype, device: of the model (the cache takes them): the cache's reservation on one rank is
            checked against the memory of `device`.

    Returns:
        Warnings (strings) the caller shows once; today: positions beyond max_position_embeddings.

    Raises:
        ConfigError naming the option at fault.
    """
    if config.num_samples > 1 and len(prompts) != 1:
        raise ConfigError("num_samples", f"num_samples={config.num_samples} samples completions of one prompt, got {len(prompts)} prompts")
    if config.speculate is not None and len(prompts) != 1:
        raise ConfigError("speculate", f"speculate={config.speculate!r} decodes one prompt at a time, got {len(prompts)} prompts")
    if config.stop_tokens is not None:
        outside = [t for t in config.stop_tokens if t >= model_config.vocab_size]
        if outside:
            raise ConfigError("stop_tokens", f"stop_tokens: token id {outside[0]} is outside the vocabulary [0, {model_config.vocab_size})")
    if config.cuda_graph and torch.device(device).type != "cuda":
        raise ConfigError("cuda_graph", f"cuda_graph=True needs the model on a CUDA device, got {torch.device(device)} "
                          "(static_decode=True runs the same steps without graphs)")
    if config.decode == "local" and world_size > 1:
        raise ConfigError("decode", f"decode='local' runs on one rank, but the group has {world_size}; use decode='tree' or decode='ring'")
    longest = max(len(p) for p in prompts)
    capacity = config.cache_capacity(longest)
    needed = longest + config.max_new_tokens
    if longest > capacity:
        raise ConfigError("capacity", f"prompt of {longest} tokens is longer than the KV cache: capacity={capacity} tokens")
    if needed > capacity:
        raise ConfigError("capacity", f"prompt of {longest} tokens + max_new_tokens={config.max_new_tokens} needs {needed} cache slots, "
                          f"more than capacity={capacity}")
    reserved = kv_cache_bytes_per_rank(config, model_config, len(prompts), longest, world_size, dtype)
    available = device_memory_bytes(device)
    if available is not None and reserved > available:
        option = _largest_cache_term(config, len(prompts), capacity)
        raise ConfigError(option, f"{option}={getattr(config, option)}: the KV cache of {capacity} slots x {len(prompts)} sequences "
                          f"(blocks of {config.block_size}{f', and {config.num_samples} samples' if config.num_samples > 1 else ''}) "
                          f"would take {format_bytes(reserved)} per rank on {world_size} rank(s), more than the "
                          f"{format_bytes(available)} of memory of {torch.device(device)}")
    warnings = []
    if needed > model_config.max_position_embeddings:
        warnings.append(f"{needed} positions exceed the model's max_position_embeddings={model_config.max_position_embeddings}")
    return warnings


def kv_cache_bytes_per_rank(config: GenerationConfig, model_config, batch: int, longest: int, world_size: int,
                            dtype: torch.dtype) -> int:
    """Bytes the engine's KV cache arena of this generation takes on every rank: keys and values of
    every slot of its blocks (GenerationConfig.blocks_per_rank, and the pad block)."""
    blocks = config.blocks_per_rank(longest, batch, world_size) + 1
    return blocks * config.block_size * kv_bytes_per_token(model_config, dtype)


def _largest_cache_term(config: GenerationConfig, batch: int, capacity: int) -> str:
    """The option that makes the cache too big: the samples' cache, blocks larger than the whole
    cache, or the capacity itself (named capacity when given, else max_new_tokens)."""
    if config.num_samples > 1 and config.num_samples * config.max_new_tokens > batch * capacity:
        return "num_samples"
    if config.block_size > capacity:
        return "block_size"
    return "capacity" if config.capacity is not None else "max_new_tokens"


def model_bytes(model, dtype: torch.dtype) -> int:
    """Bytes of a model's weights in `dtype`: a loaded model's parameters, or a checkpoint's (a
    directory or .gguf file, read without its weights)."""
    if isinstance(model, (str, os.PathLike)):
        from treeattn.models.loader import check_checkpoint

        model = check_checkpoint(model, dtype=dtype)
    return sum(p.numel() for p in model.parameters()) * torch.empty((), dtype=dtype).element_size()


def device_memory_bytes(device: torch.device | str) -> int | None:
    """Total memory of `device`: the machine's RAM for "cpu", the GPU's for "cuda"; None if unknown."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device.index or 0).total_memory
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


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(name: str, value, low: int) -> None:
    if not _is_int(value):
        raise ConfigTypeError(name, f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < low:
        raise ConfigError(name, f"{name} must be >= {low}, got {value}")


def _token_tuple(values) -> tuple[int, ...]:
    """stop_tokens as a tuple of ids >= 0; a float like 2.7 is refused, not truncated."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, set, frozenset, torch.Tensor)):
        raise ConfigError("stop_tokens", f"stop_tokens must be a list of token ids or None, got {values!r:.80}")
    out = []
    for t in (values.tolist() if isinstance(values, torch.Tensor) else values):
        if isinstance(t, bool):
            raise ConfigError("stop_tokens", f"stop_tokens must hold int token ids, got {t!r}")
        try:
            t = operator.index(t)
        except TypeError:
            raise ConfigError("stop_tokens", f"stop_tokens must hold int token ids, got {type(t).__name__} ({t!r})") from None
        if t < 0:
            raise ConfigError("stop_tokens", f"stop_tokens must hold token ids >= 0, got {t}")
        out.append(t)
    return tuple(out)
