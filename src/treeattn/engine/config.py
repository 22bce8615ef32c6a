"""How an engine runs: one frozen EngineConfig, validated once where its fields live, the same on every rank.

    config = EngineConfig(nproc=4, decode="tree", block_size=256, max_context=8192)
    Engine(model, config)                       # or Engine(model, nproc=4, ...): the same fields as keywords
    ta.generate(model, prompts, config, SamplingParams(max_new_tokens=64))   # one batch, the same config

`EngineConfig.__post_init__` checks every field on its own and the combinations that need no model
(decode "local" on several ranks, speculation with static steps, ...). What needs the model (its
memory, a draft model's tokenizer, CUDA for graph steps) is checked before any rank starts by
treeattn.engine.checks. How to sample is not here: that is each request's SamplingParams
(treeattn.engine.request). A bad value fails once, with one line naming the field: a ConfigError
(a ValueError; ConfigTypeError is a TypeError too) whose `.option` is the field's name.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from treeattn.cache.placement import PLACEMENTS
from treeattn.engine.device import DEVICES
from treeattn.engine.errors import ConfigError, ConfigTypeError
from treeattn.engine.speculate import MAX_DRAFT_TOKENS, SPECULATE_KINDS
from treeattn.models.attention import DECODE_KINDS
from treeattn.models.packed import WEIGHT_FORMATS
from treeattn.ops.packed_linear import ACTIVATION_FORMATS, PREFILL_DTYPES
from treeattn.parallel.tree_decode import METHODS

PREFILL_KINDS = ("auto", "ring", "split")
"""The engine's prefill option: "ring" (treeattn.engine.worker.ring_prefill), "split" (token_parallel's steps), "auto"."""

RING_ROWS_PER_RANK = 4096
"""While no sequence decodes, a step of ring prefill takes up to this many prompt tokens per rank
(idle_prefill_chunk): each rank runs at most as many rows as one 4096-token chunk on one rank."""


def resolve_prefill(prefill: str, world_size: int, layer_windows: Sequence[int | None]) -> str:
    """The kind of step that runs a prompt-only step of enough tokens: "ring" or "split".

    "auto" is "ring" on several ranks for a model without sliding windows; with a window it is
    "split" (a ring step's attention is exact under a window too, but through masked blocks, not the
    fused causal kernel). One rank has nothing to split: "split" (the replicated step) there.
    """
    if prefill not in PREFILL_KINDS:
        raise ValueError(f"prefill must be one of {PREFILL_KINDS}, got {prefill!r}")
    if world_size == 1:
        return "split"
    if prefill == "auto":
        return "ring" if all(w is None for w in layer_windows) else "split"
    return prefill


def idle_prefill_chunk(prefill: str, world_size: int, layer_windows: Sequence[int | None]) -> int | None:
    """The scheduler's prompt tokens per step while no sequence decodes: RING_ROWS_PER_RANK per
    rank when prompt-only steps are ring steps, else None (prefill_chunk, as while decoding)."""
    return RING_ROWS_PER_RANK * world_size if resolve_prefill(prefill, world_size, layer_windows) == "ring" else None


DECODE_STEPS = ("dynamic", "static", "graph")
"""How the engine runs a decode step: "dynamic" (PagedBatch: host-built indices, exact sizes),
"static" (StaticDecodeStep, eager) or "graph" (StaticDecodeStep replayed from CUDA graphs)."""


DEFAULT_METHOD = "onepass"
"""tree_decode's combine when none is named: the fastest exact one measured on this repository's
machine (docs/benchmarks.md, "One round per layer"). The static and CUDA-graph steps, which may not
read the host inside a step, take "allreduce" instead."""


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3")
"""What the KV cache may store (kv_cache_dtype): "auto" is the model's dtype; "fp8_e4m3" is
torch.float8_e4m3fn codes with a float32 scale per token and KV head (treeattn.ops.fp8); the others
are torch's names."""


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype a KV cache of `kv_cache_dtype` (KV_CACHE_DTYPES) stores for a model of `model_dtype`."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError("kv_cache_dtype", f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "fp8_e4m3":
        return torch.float8_e4m3fn
    return model_dtype if kv_cache_dtype == "auto" else getattr(torch, kv_cache_dtype)


def kv_cache_dtype_name(dtype: torch.dtype) -> str:
    """The kv_cache_dtype name of a stored torch dtype (float8_e4m3fn: "fp8_e4m3"), as --json reports it."""
    return "fp8_e4m3" if dtype == torch.float8_e4m3fn else str(dtype).removeprefix("torch.")


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


def given_or_built(cls, given, keywords: dict, option: str):
    """The `cls` object a caller gave as `option`, or one built of its fields as `keywords` (not both):
    Engine(model, config | **fields), engine.generate(prompts, params | **fields), ta.generate.
    ConfigTypeError (a ValueError and a TypeError) naming `option` otherwise."""
    if given is None:
        return cls(**keywords)
    if keywords:
        raise ConfigTypeError(option, f"give either {option} or its fields as keywords, not both (got {sorted(keywords)})")
    if not isinstance(given, cls):
        raise ConfigTypeError(option, f"{option} must be a {cls.__name__}, got {type(given).__name__}")
    return given


@dataclass(frozen=True)
class EngineConfig:
    """How an Engine runs, validated once and shipped to the ranks. Engine(model, **fields) builds
    one; a bad value raises a ConfigError (a ValueError) whose .option is the field it names.

    Attributes:
        nproc: ranks sharing the KV cache (inside an existing group, and in generate(): the group's size).
        decode: "tree" (tree_decode), "ring" (ring_decode, pass-KV) or "local" (one rank).
        method: tree_decode method, "allreduce", "tree", "twolevel" or "onepass"; None: the
            default (treeattn.engine.config.DEFAULT_METHOD, onepass: one collective per layer;
            "allreduce" with static decode steps). Resolved on construction.
        placement: "contiguous" or "interleaved" placement of a sequence's blocks on the ranks
            (treeattn.cache.blocks: contiguous gives each rank one span of max_context / p
            tokens of every sequence, so sequences shorter than a span sit on rank 0;
            interleaved spreads every sequence).
        max_batch_size: sequences running together at most.
        cache_tokens: KV cache size in tokens over all ranks (over the KV ranks of one slice with tp; default: max(max_batch_size
            * 2048,
            min(max_position_embeddings, 32768))).
        prefix_cache: reuse cached prompt prefixes (radix tree over blocks).
        block_size: tokens per cache block (the unit of allocation, sharing and placement).
        prefill_chunk: prompt tokens per step at most (chunked prefill) while some sequence decodes;
            with ring prefill steps and no sequence decoding, up to config.RING_ROWS_PER_RANK
            per rank (config.idle_prefill_chunk).
        prefill: how a step of prompt chunks only runs on several ranks: "ring" (each rank runs a
            zigzag share of every chunk's tokens, attention over the step's gathered keys and a ring
            over the cached prefix: treeattn.engine.worker.ring_prefill), "split" (each rank runs a slice,
            attention combined across the ranks: treeattn.engine.worker.token_parallel) or "auto" (ring,
            but split for a model with a sliding window). Steps with decoding sequences split.
        dtype: model dtype (None, "auto": a checkpoint in bfloat16 on CUDA and float32 on the CPU; a
            given model keeps its own).
        device: where the ranks run: "auto" (CUDA when torch sees a GPU, else the CPU; a given model's
            own device), "cpu" or "cuda". Spawned rank r runs on cuda:r, a rank under torchrun on
            cuda:LOCAL_RANK; CUDA ranks form an NCCL group, CPU ranks a gloo group. A checkpoint is
            loaded straight onto each rank's device, tensor by tensor (treeattn.engine.device).
        kv_cache_dtype: what the KV cache stores: "auto" (the model's dtype), "float32", "bfloat16",
            "float16" or "fp8_e4m3" (e4m3 codes and a float32 power-of-two scale per token and KV
            head, set from that token's row when it is written: treeattn.ops.fp8). New keys and
            values are rounded to it when written; every attention read takes the stored values
            (fp8: codes times scales) in the model's dtype and accumulates in float32 (the CPU paged
            kernel widens 16-bit and fp8 blocks as it reads them). A 16-bit cache halves the bytes
            per token against float32; fp8 takes D + 4 bytes per head and token instead of 4 D.
            Not with a hybrid model's window layers (Gemma 3) when it differs from the model's
            dtype; a draft model's cache keeps the draft's dtype.
        weight_format: how a checkpoint's quantized weights are held: "auto" (on the CPU a GGUF file's
            Q4_0, Q4_1, Q8_0, Q4_K, Q5_0 and Q6_K matrices kept packed, the rest in the model's dtype;
            on CUDA, dequantized),
            "packed" (every quantized matrix kept as the file ships it, multiplied by a kernel that reads
            its blocks, numba's kernel on the CPU, Triton's on CUDA: refused for other quantized types, a
            safetensors checkpoint or CUDA without triton) or "dequantize"
            (every weight in the model's dtype). A packed weight is exactly the file's; activations and
            accumulation stay float32 (treeattn.ops.packed_linear). A loaded model keeps its own format.
        activation_format: how packed weights multiply a decode step's activations on the CPU: "float32" (exact:
            the file's weights times float32 activations), "int8" (as llama.cpp does: activations quantized to 8
            bits per block of 32, integer dot products on AVX-512 VNNI, one scale per block; only on a CPU with
            avx512_vnni) or "auto" (this host's choice: float32 for now, see docs/benchmarks.md, issue 50).
            Prefill-sized calls run in prefill_dtype.
        prefill_dtype: what packed weights multiply prefill-sized CPU calls (more than 16 rows) in: "float32" (exact:
            the file's weights, float32 activations) or "bfloat16" (weight and activations rounded to bfloat16, float32
            accumulation in oneDNN's GEMM: about twice as fast where the CPU has AVX-512 BF16 or AMX, refused where it
            has not; the tokens may differ: docs/bench_weights.md, "bfloat16 prefill"). Decode steps are unchanged.
        timeout_s: the group's timeout for every collective, and how long the driver waits for
            the ranks to start.
        threads_per_rank: torch threads of each rank process (default cpu_count // nproc). With nproc=1, or an engine
            inside an existing group (torchrun), the rank is the calling process: when set, torch.set_num_threads sets
            it there (process-wide); None leaves the process's own count.
        speculate: None, "ngram" or "draft": speculative decoding. Every decode step drafts up to
            `draft_tokens` tokens per sequence, verifies them in the same batched forward pass, and
            keeps the accepted ones and the token after them: exactly the tokens decoding without
            speculation gives, greedy or sampled with the same seed. "ngram" drafts by prompt lookup
            from the sequence's own prompt and output (treeattn.engine.speculate.NgramDrafter); "draft"
            with `draft_model` (its argmax), run on every rank over its own cache sharded like the
            model's (treeattn.engine.worker.draft).
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
            bucket, no host synchronization inside the step: treeattn.engine.worker.static_step) or
            "graph" (the static step captured in a CUDA graph per shape, then replayed: CUDA
            only). Static steps need a method that does not read the host: method=None gives
            "allreduce", "onepass" is refused. Steps with prompt chunks or drafts stay dynamic.
        max_context: the most positions (prompt + new tokens) one request may take; None: the
            whole cache, but no more than the model's max_position_embeddings (engine.max_context
            is the resolved value; a larger value given here runs positions beyond the model's
            window, with a warning). A request that needs more fails alone, naming the limit.
        tp: tensor-parallel ranks T: the nproc ranks are T tensor-parallel x nproc / T KV ranks (the Helix
            layout, treeattn.engine.worker.tensor_parallel). Attention's heads (and their q/k/v and
            output projections) split T ways and the sequence nproc / T ways, the MLP, embeddings
            and LM head over all nproc ranks. None: no tensor parallelism (every rank holds every weight; the KV cache
            alone is sharded). tp must divide nproc. With tp, prompt steps run every token on
            every rank (no token-parallel or ring prefill); a draft model stays whole on every rank.
            Refused with decode_step="graph" (CUDA graphs), linear_maps and method "twolevel".
        linear_maps: a directory of Hedgehog feature maps (`treeattn linearize --out`): the layers
            it names run linear attention (treeattn.linear; a hybrid model), their states kept per
            sequence on every rank. Not with speculate or static/graph decode steps; the prefix
            cache is off for such a model.
        kv_store: a directory where the prefix cache's blocks are written through to disk and found
            again after an eviction or a restart, shared by the engines of one host (None: no second
            tier; treeattn.engine.kv_tier). Needs prefix_cache; not with speculate="draft"; off with a
            warning for a model with window layers (Gemma 3) or linear layers.
        kv_store_bytes: the most bytes the kv_store directory holds; least recently used blocks are
            deleted past it.
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
    weight_format: str = "auto"
    activation_format: str = "auto"
    prefill_dtype: str = "float32"
    device: str = "auto"
    timeout_s: float = 60.0
    threads_per_rank: int | None = None
    speculate: str | None = None
    draft_tokens: int = 4
    draft_model: str | torch.nn.Module | None = None
    shared_memory: bool = True
    decode_step: str = "dynamic"
    max_context: int | None = None
    linear_maps: str | None = None
    kv_store: str | None = None
    kv_store_bytes: int = 16 << 30
    tp: int | None = None

    def __post_init__(self) -> None:
        static = self.decode_step in DECODE_STEPS and self.decode_step != "dynamic"
        object.__setattr__(self, "method", resolve_method(self.method, static and f"decode_step={self.decode_step!r}"))
        for name in ("nproc", "max_batch_size", "block_size", "prefill_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"{name} must be an int >= 1, got {value!r}")
        for name in ("cache_tokens", "threads_per_rank", "max_context"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(name, f"{name} must be an int >= 1 or None, got {value!r}")
        if self.decode not in DECODE_KINDS:
            raise ConfigError("decode", f"decode must be one of {DECODE_KINDS}, got {self.decode!r}")
        if self.decode == "local" and self.nproc > 1:
            raise ConfigError("decode",
                              f"decode='local' runs on one rank, but nproc={self.nproc}; use decode='tree' or decode='ring'")
        if self.prefill not in PREFILL_KINDS:
            raise ConfigError("prefill", f"prefill must be one of {PREFILL_KINDS}, got {self.prefill!r}")
        if self.method not in METHODS:
            raise ConfigError("method", f"method must be one of {METHODS}, got {self.method!r}")
        if self.placement not in PLACEMENTS:
            raise ConfigError("placement", f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        for name in ("prefix_cache", "shared_memory"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.device not in DEVICES:
            raise ConfigError("device", f"device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype is not None and (not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point):
            raise ConfigError("dtype", f"dtype must be a floating torch.dtype or None, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError("kv_cache_dtype", f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.weight_format not in WEIGHT_FORMATS:
            raise ConfigError("weight_format", f"weight_format must be one of {WEIGHT_FORMATS}, got {self.weight_format!r}")
        if self.activation_format not in ACTIVATION_FORMATS:
            raise ConfigError("activation_format",
                              f"activation_format must be one of {ACTIVATION_FORMATS}, got {self.activation_format!r}")
        if self.prefill_dtype not in PREFILL_DTYPES:
            raise ConfigError("prefill_dtype", f"prefill_dtype must be one of {PREFILL_DTYPES}, got {self.prefill_dtype!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ConfigError("timeout_s", f"timeout_s must be a number of seconds > 0, got {self.timeout_s!r}")
        if self.speculate is not None and self.speculate not in SPECULATE_KINDS:
            raise ConfigError("speculate", f"speculate must be None or one of {SPECULATE_KINDS}, got {self.speculate!r}")
        k = self.draft_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_TOKENS:
            raise ConfigError("draft_tokens", f"draft_tokens must be an int in [1, {MAX_DRAFT_TOKENS}], got {k!r}")
        object.__setattr__(self, "draft_model", check_draft_model_option(self.speculate, self.draft_model))
        self._check_decode_step()
        self._check_tp()
        self._check_kv_store()

    def _check_kv_store(self) -> None:
        if isinstance(self.kv_store, os.PathLike):
            object.__setattr__(self, "kv_store", os.fspath(self.kv_store))
        b = self.kv_store_bytes
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ConfigError("kv_store_bytes", f"kv_store_bytes must be an int >= 1, got {b!r}")
        if self.kv_store is None:
            return
        if not isinstance(self.kv_store, str) or not self.kv_store:
            raise ConfigTypeError("kv_store", f"kv_store must be a directory path, got {self.kv_store!r}")
        if not self.prefix_cache:
            raise ConfigError("kv_store", "kv_store is the prefix cache's second tier: it needs prefix_cache=True")
        if self.speculate == "draft":
            raise ConfigError("kv_store", "kv_store does not store the draft model's cache: not with speculate='draft'")
        if self.tp is not None and self.tp > 1:
            raise ConfigError("kv_store", f"kv_store keys blocks that hold every KV head: not with tp={self.tp} "
                              "(tensor-parallel ranks hold different heads)")

    @property
    def kv_ranks(self) -> int:
        """Ranks the KV cache of one sequence is sharded over: nproc, or nproc / tp in the Helix layout."""
        return self.nproc if self.tp is None else self.nproc // self.tp

    def _check_tp(self) -> None:
        """tp (None, or an int >= 1 dividing nproc) and what the Helix layout does not run, one line each."""
        tp = self.tp
        if tp is None:
            return
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or (self.nproc > 1 and self.nproc % tp):
            # nproc 1 is also the default that a process group's size replaces (generate, Engine in a group):
            # the engine's checks see the final nproc (tensor_parallel.check_tensor_parallel)
            raise ConfigError("tp", f"tp must be None or an int >= 1 that divides nproc={self.nproc}, got {tp!r}")
        refused = [("decode_step", self.decode_step == "graph", "decode_step='graph'"),
                   ("linear_maps", self.linear_maps is not None, "linear_maps"),
                   ("method", self.method == "twolevel", "method='twolevel'"),
                   ("prefill", self.prefill != "auto", f"prefill={self.prefill!r} (with tp every rank runs every prompt token)")]
        for option, bad, what in refused:
            if bad:
                raise ConfigError(option, f"{what} does not run with tp={tp} (the Helix layout): run it without tp")

    def _check_decode_step(self) -> None:
        if self.decode_step not in DECODE_STEPS:
            raise ConfigError("decode_step", f"decode_step must be one of {DECODE_STEPS}, got {self.decode_step!r}")
        if self.decode_step != "dynamic" and self.speculate is not None:
            raise ConfigError("speculate", f"speculate={self.speculate!r} verifies several tokens per sequence per step; "
                              f"decode_step={self.decode_step!r} runs fixed one-token steps")
        if isinstance(self.linear_maps, os.PathLike):
            object.__setattr__(self, "linear_maps", os.fspath(self.linear_maps))
        if self.linear_maps is not None:
            if not isinstance(self.linear_maps, str):
                raise ConfigTypeError("linear_maps",
                                      f"linear_maps must be a directory path, got {type(self.linear_maps).__name__}")
            # what a hybrid linear model cannot run with: engine.checks.check_linear (one copy, for --linear-maps too)

    def blocks_per_rank(self, max_position_embeddings: int) -> int:
        """Blocks in each rank's pool: cache_tokens over all ranks, default
        max(max_batch_size * 2048, min(max_position_embeddings, 32768)) tokens."""
        tokens = self.cache_tokens or max(self.max_batch_size * 2048, min(max_position_embeddings, 32768))
        return max(1, -(-tokens // (self.block_size * self.kv_ranks)))

    def max_context_tokens(self, max_position_embeddings: int) -> int:
        """Engine.max_context: the most positions one request may take: max_context as given (the
        caller's choice, even beyond the model's window: the engine warns), or the whole cache but
        no more than the model's window. Raises ConfigError when max_context is more than the cache
        holds."""
        cache = self.kv_ranks * self.blocks_per_rank(max_position_embeddings) * self.block_size
        if self.max_context is None:
            return min(cache, max_position_embeddings)
        if self.max_context > cache:
            raise ConfigError("max_context", f"max_context={self.max_context} is more than the KV cache holds ({cache} tokens "
                              f"over {self.kv_ranks} rank(s)); raise cache_tokens or lower max_context")
        return self.max_context

    def span_blocks(self, max_position_embeddings: int) -> int:
        """Blocks of one sequence on each rank under contiguous placement: the p-th part of max_context."""
        blocks = -(-self.max_context_tokens(max_position_embeddings) // self.block_size)
        return min(self.blocks_per_rank(max_position_embeddings), -(-blocks // self.kv_ranks))
