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

from treeattn.cache.placement import PLACEMENTS
from treeattn.cache.sharded import kv_bytes_per_token
from treeattn.cache.window import hybrid_windows, window_bytes_per_sequence
from treeattn.engine import memory
from treeattn.engine.device import DEVICES
from treeattn.engine.errors import ConfigError, ConfigTypeError
from treeattn.engine.request import SamplingParams
from treeattn.engine.ring_prefill import PREFILL_KINDS
from treeattn.engine.speculate import MAX_DRAFT_TOKENS, SPECULATE_KINDS
from treeattn.engine.static_step import DECODE_STEPS
from treeattn.models.attention import DECODE_KINDS
from treeattn.parallel.tree_decode import METHODS

DEFAULT_METHOD = "onepass"
"""tree_decode's combine when none is named: the fastest exact one measured on this repository's
machine (docs/benchmarks.md, "One round per layer"). The static and CUDA-graph steps, which may not
read the host inside a step, take "allreduce" instead."""


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
"""What the KV cache may store (kv_cache_dtype): "auto" is the model's dtype; the others are torch's names."""


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype a KV cache of `kv_cache_dtype` (KV_CACHE_DTYPES) stores for a model of `model_dtype`."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError("kv_cache_dtype", f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return model_dtype if kv_cache_dtype == "auto" else getattr(torch, kv_cache_dtype)


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
class EngineConfig:
    """How an Engine runs, validated once and shipped to the ranks. Engine(model, **fields) builds
    one; a bad value raises ValueError (ConfigError for max_context) naming the field.

    Attributes:
        nproc: ranks sharing the KV cache (ignored inside an existing group: its size is used).
        decode: "tree" (tree_decode), "ring" (ring_decode, pass-KV) or "local" (one rank).
        method: tree_decode method, "allreduce", "tree", "twolevel" or "onepass"; None: the
            default (treeattn.engine.config.DEFAULT_METHOD, onepass: one collective per layer;
            "allreduce" with static decode steps). Resolved on construction.
        placement: "contiguous" or "interleaved" placement of a sequence's blocks on the ranks
            (treeattn.cache.blocks: contiguous gives each rank one span of max_context / p
            tokens of every sequence, so sequences shorter than a span sit on rank 0;
            interleaved spreads every sequence).
        max_batch_size: sequences running together at most.
        cache_tokens: KV cache size in tokens over all ranks (default: max(max_batch_size * 2048,
            min(max_position_embeddings, 32768))).
        prefix_cache: reuse cached prompt prefixes (radix tree over blocks).
        block_size: tokens per cache block (the unit of allocation, sharing and placement).
        prefill_chunk: prompt tokens per step at most (chunked prefill) while some sequence decodes;
            with ring prefill steps and no sequence decoding, up to ring_prefill.RING_ROWS_PER_RANK
            per rank (ring_prefill.idle_prefill_chunk).
        prefill: how a step of prompt chunks only runs on several ranks: "ring" (each rank runs a
            zigzag share of every chunk's tokens, attention over the step's gathered keys and a ring
            over the cached prefix: treeattn.engine.ring_prefill), "split" (each rank runs a slice,
            attention combined across the ranks: treeattn.engine.token_parallel) or "auto" (ring,
            but split for a model with a sliding window). Steps with decoding sequences split.
        dtype: model dtype (None, "auto": a checkpoint in bfloat16 on CUDA and float32 on the CPU; a
            given model keeps its own).
        device: where the ranks run: "auto" (CUDA when torch sees a GPU, else the CPU; a given model's
            own device), "cpu" or "cuda". Spawned rank r runs on cuda:r, a rank under torchrun on
            cuda:LOCAL_RANK; CUDA ranks form an NCCL group, CPU ranks a gloo group. A checkpoint is
            loaded straight onto each rank's device, tensor by tensor (treeattn.engine.device).
        kv_cache_dtype: what the KV cache stores: "auto" (the model's dtype), "float32", "bfloat16" or
            "float16". New keys and values are rounded to it when written; every attention read
            takes the stored values in the model's dtype and accumulates in float32 (the CPU paged
            kernel widens 16-bit blocks as it reads them). A 16-bit cache halves the bytes per token
            against float32. Not with a hybrid model's window layers (Gemma 3) when it differs from
            the model's dtype; a draft model's cache keeps the draft's dtype.
        timeout_s: the group's timeout for every collective, and how long the driver waits for
            the ranks to start.
        threads_per_rank: torch threads of each rank process (default cpu_count // nproc).
        speculate: None, "ngram" or "draft": speculative decoding. Every decode step drafts up to
            `draft_tokens` tokens per sequence, verifies them in the same batched forward pass, and
            keeps the accepted ones and the token after them: exactly the tokens decoding without
            speculation gives, greedy or sampled with the same seed. "ngram" drafts by prompt lookup
            from the sequence's own prompt and output (treeattn.engine.speculate.NgramDrafter); "draft"
            with `draft_model` (its argmax), run on every rank over its own cache sharded like the
            model's (treeattn.engine.draft).
        draft_tokens: the most tokens drafted per sequence per step, in [1, MAX_DRAFT_TOKENS].
        draft_model: with speculate="draft" (and only then): the draft model, a checkpoint path or
            a LlamaModel, loaded on every rank in the model's dtype. It must share the model's
            tokenizer and reach every position the engine runs (max_context); both are checked
            before any rank starts (ConfigError naming draft_model). Its weights and cache count in
            the memory check.
        shared_memory: the ranks combine through shared memory when they all run on this host
            with a CPU model (treeattn.parallel.shared_memory; one round, no sockets); False:
            through the process group's back end.
        decode_step: how a step that only decodes (one token per sequence, no drafts) runs:
            "dynamic" (index tensors built for its exact sizes), "static" (fixed shapes per batch
            bucket, no host synchronization inside the step: treeattn.engine.static_step) or
            "graph" (the static step captured in a CUDA graph per shape, then replayed: CUDA
            only). Static steps need a method that does not read the host: method=None gives
            "allreduce", "onepass" is refused. Steps with prompt chunks or drafts stay dynamic.
        max_context: the most positions (prompt + new tokens) one request may take; None: the
            whole cache, but no more than the model's max_position_embeddings (engine.max_context
            is the resolved value; a larger value given here runs positions beyond the model's
            window, with a warning). A request that needs more fails alone, naming the limit.
    """

    nproc: int = 1
    decode: str = "tree"
    method: str | None = None
    placement: str = "contiguous"
    max_batch_size: int = 16
    cache_tokens: int | None = None
    prefix_cache: bool = True
    block_size: int = 256
    prefill_chunk: int = 512
    prefill: str = "auto"
    dtype: torch.dtype | None = None
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    timeout_s: float = 60.0
    threads_per_rank: int | None = None
    speculate: str | None = None
    draft_tokens: int = 4
    draft_model: str | torch.nn.Module | None = None
    shared_memory: bool = True
    decode_step: str = "dynamic"
    max_context: int | None = None

    def __post_init__(self) -> None:
        static = self.decode_step in DECODE_STEPS and self.decode_step != "dynamic"
        object.__setattr__(self, "method", resolve_method(self.method, static and f"decode_step={self.decode_step!r}"))
        for name in ("nproc", "max_batch_size", "block_size", "prefill_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("cache_tokens", "threads_per_rank", "max_context"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
        if self.decode not in DECODE_KINDS:
            raise ValueError(f"decode must be one of {DECODE_KINDS}, got {self.decode!r}")
        if self.prefill not in PREFILL_KINDS:
            raise ConfigError("prefill", f"prefill must be one of {PREFILL_KINDS}, got {self.prefill!r}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        for name in ("prefix_cache", "shared_memory"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.device not in DEVICES:
            raise ConfigError("device", f"device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype is not None and (not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating torch.dtype or None, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError("kv_cache_dtype", f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be a number of seconds > 0, got {self.timeout_s!r}")
        if self.speculate is not None and self.speculate not in SPECULATE_KINDS:
            raise ValueError(f"speculate must be None or one of {SPECULATE_KINDS}, got {self.speculate!r}")
        k = self.draft_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_TOKENS:
            raise ValueError(f"draft_tokens must be an int in [1, {MAX_DRAFT_TOKENS}], got {k!r}")
        object.__setattr__(self, "draft_model", check_draft_model_option(self.speculate, self.draft_model))
        self._check_decode_step()

    def _check_decode_step(self) -> None:
        if self.decode_step not in DECODE_STEPS:
            raise ConfigError("decode_step", f"decode_step must be one of {DECODE_STEPS}, got {self.decode_step!r}")
        if self.decode_step != "dynamic" and self.speculate is not None:
            raise ConfigError("speculate", f"speculate={self.speculate!r} verifies several tokens per sequence per step; "
                              f"decode_step={self.decode_step!r} runs fixed one-token steps")

    def blocks_per_rank(self, max_position_embeddings: int) -> int:
        """Blocks in each rank's pool: cache_tokens over all ranks, default
        max(max_batch_size * 2048, min(max_position_embeddings, 32768)) tokens."""
        tokens = self.cache_tokens or max(self.max_batch_size * 2048, min(max_position_embeddings, 32768))
        return max(1, -(-tokens // (self.block_size * self.nproc)))

    def max_context_tokens(self, max_position_embeddings: int) -> int:
        """Engine.max_context: the most positions one request may take: max_context as given (the
        caller's choice, even beyond the model's window: the engine warns), or the whole cache but
        no more than the model's window. Raises ConfigError when max_context is more than the cache
        holds."""
        cache = self.nproc * self.blocks_per_rank(max_position_embeddings) * self.block_size
        if self.max_context is None:
            return min(cache, max_position_embeddings)
        if self.max_context > cache:
            raise ConfigError("max_context", f"max_context={self.max_context} is more than the KV cache holds ({cache} tokens "
                              f"over {self.nproc} rank(s)); raise cache_tokens or lower max_context")
        return self.max_context

    def span_blocks(self, max_position_embeddings: int) -> int:
        """Blocks of one sequence on each rank under contiguous placement: the p-th part of max_context."""
        blocks = -(-self.max_context_tokens(max_position_embeddings) // self.block_size)
        return min(self.blocks_per_rank(max_position_embeddings), -(-blocks // self.nproc))



@dataclass(frozen=True)
class GenerationConfig:
    """Every option of one generation (see treeattn.engine.generate.generate for what each does).

    Attributes:
        max_new_tokens: new tokens per sequence, >= 1.
        temperature: 0 is greedy (argmax); > 0 divides the logits before sampling.
        top_k: sample among the k most likely tokens only (None, the default: every token).
        top_p: nucleus sampling mass in (0, 1] (None, the default: every token).
        seed: sampling seed, >= 0: sequence i draws from a generator seeded with seed + i.
        stop_tokens: token ids that end a sequence (a tuple); None: the model's eos ids.
        num_samples: n >= 1 completions of one prompt (n > 1: the prompt prefilled once, the
            samples decoding over its shared blocks).
        decode: "tree" (tree_decode), "ring" (ring_decode, pass-KV) or "local" (one rank).
        method: tree_decode's combine, "allreduce", "tree", "twolevel" or "onepass" (None, the
            default: onepass, one collective per layer; allreduce for static and CUDA-graph steps,
            which may not read the host). Set after validation.
        prefill: how a step of prompt chunks runs on several ranks: "ring" (each rank a zigzag
            share of the tokens), "split" (each rank a slice, attention combined) or "auto" (ring,
            split for sliding-window models).
        placement: "contiguous" or "interleaved" placement of a sequence's cache blocks on the ranks.
        block_size: KV cache block size in tokens.
        capacity: KV cache slots per sequence: the most positions (prompt + new tokens) one may take
            (None, the default: the longest prompt + the new tokens); the engine's max_context.
        chunk: prompt tokens per engine step at most (the engine's prefill_chunk).
        static_decode: the engine's fixed-shape decode steps, run eagerly (EngineConfig.decode_step
            "static").
        cuda_graph: the engine's fixed-shape decode steps replayed from CUDA graphs
            (EngineConfig.decode_step "graph"; a CUDA model only).
        speculate: speculative decoding, "ngram" (prompt-lookup drafts) or "draft" (a draft
            model's), verified by one forward pass of the model per step; one prompt, one sample,
            dynamic steps (None, the default: none).
        draft_tokens: the most tokens drafted per step, 1 to MAX_DRAFT_TOKENS (16).
        draft_model: the draft model of speculate "draft" (and only then): a checkpoint (an HF
            directory or a .gguf file) with the model's tokenizer, or a loaded model (in one process).
            Its tokenizer and context window are checked against the model's before any work; it
            runs on every rank over its own cache of the model's blocks (treeattn.engine.draft).
        shared_memory: combine across the ranks through shared memory when they all run on this
            host and the model is on the CPU (treeattn.parallel.shared_memory); off: through the
            process group's back end (gloo, NCCL).
        kv_cache_dtype: what the KV cache stores: "auto" (the model's dtype), "float32", "bfloat16"
            or "float16" (EngineConfig.kv_cache_dtype).
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
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        for name, low in (("max_new_tokens", 1), ("seed", 0), ("num_samples", 1), ("block_size", 1), ("chunk", 1)):
            _check_int(name, getattr(self, name), low)
        if self.seed >= 2**64:
            raise ConfigError("seed", f"seed must be below 2**64 (a torch.Generator seed), got {self.seed}")
        if self.capacity is not None:
            _check_int("capacity", self.capacity, 1)
        self._check_sampling()
        if self.stop_tokens is not None:
            object.__setattr__(self, "stop_tokens", _token_tuple(self.stop_tokens))
        static = "cuda_graph=True" if self.cuda_graph is True else "static_decode=True" if self.static_decode is True else None
        object.__setattr__(self, "method", resolve_method(self.method, static))
        for name, allowed in (("decode", DECODE_KINDS), ("method", METHODS), ("prefill", PREFILL_KINDS), ("placement", PLACEMENTS),
                              ("kv_cache_dtype", KV_CACHE_DTYPES)):
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

    def _check_sampling(self) -> None:
        t = self.temperature
        if not _is_real(t) or not (math.isfinite(t) and t >= 0):
            raise ConfigError("temperature", f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise ConfigError("top_k", f"top_k must be a positive int or None, got {self.top_k!r}")
        if self.top_p is not None and (not _is_real(self.top_p) or not 0 < self.top_p <= 1):
            raise ConfigError("top_p", f"top_p must be in (0, 1] or None, got {self.top_p!r}")

    def sampling_params(self, seed: int, stop_token_ids: tuple[int, ...]) -> SamplingParams:
        """The engine's SamplingParams of one sequence of this generation (top_k None -> 0 and
        top_p None -> 1.0: every token), drawing from `seed`, stopping at `stop_token_ids` only."""
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_k=self.top_k or 0,
                              top_p=self.top_p or 1.0, seed=seed, stop_token_ids=stop_token_ids, ignore_eos=True, logprobs=0)

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
        dtype, device: of the model (the cache takes the device, and the dtype unless
            config.kv_cache_dtype names another): the cache's reservation on one rank is checked
            against the memory of `device`.

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
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype)
    if kv_dtype != dtype and hybrid_windows(tuple(model_config.layer_windows)):
        raise ConfigError("kv_cache_dtype", f"kv_cache_dtype={config.kv_cache_dtype!r} does not run the sliding-window layers "
                          f"of {model_config.architecture} yet: use kv_cache_dtype='auto' (the model's dtype)")
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
    reserved = kv_cache_bytes_per_rank(config, model_config, len(prompts), longest, world_size, kv_dtype)
    available = memory.device_memory_bytes(device)
    if available is not None and reserved > available:
        option = _largest_cache_term(config, len(prompts), capacity)
        raise ConfigError(option, f"{option}={getattr(config, option)}: the KV cache of {capacity} slots x {len(prompts)} sequences "
                          f"(blocks of {config.block_size}{f', and {config.num_samples} samples' if config.num_samples > 1 else ''}) "
                          f"would take {memory.format_bytes(reserved)} per rank on {world_size} rank(s), more than the "
                          f"{memory.format_bytes(available)} of memory of {torch.device(device)}")
    warnings = []
    if needed > model_config.max_position_embeddings:
        warnings.append(f"{needed} positions exceed the model's max_position_embeddings={model_config.max_position_embeddings}")
    return warnings


def kv_cache_bytes_per_rank(config: GenerationConfig, model_config, batch: int, longest: int, world_size: int,
                            dtype: torch.dtype) -> int:
    """Bytes the engine's KV cache takes on every rank for this generation: keys and values of every
    slot of the paged arena's blocks (GenerationConfig.blocks_per_rank, and the pad block), plus a
    hybrid model's window layers, kept per sequence on every rank (cache.window)."""
    blocks = config.blocks_per_rank(longest, batch, world_size) + 1
    windows = batch * window_bytes_per_sequence(model_config, dtype)
    return blocks * config.block_size * kv_bytes_per_token(model_config, dtype) + windows


def _largest_cache_term(config: GenerationConfig, batch: int, capacity: int) -> str:
    """The option that makes the cache too big: the samples' cache, blocks larger than the whole
    cache, or the capacity itself (named capacity when given, else max_new_tokens)."""
    if config.num_samples > 1 and config.num_samples * config.max_new_tokens > batch * capacity:
        return "num_samples"
    if config.block_size > capacity:
        return "block_size"
    return "capacity" if config.capacity is not None else "max_new_tokens"


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
