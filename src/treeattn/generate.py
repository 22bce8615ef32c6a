"""Generation: prefill a prompt into the sequence-sharded KV cache, then decode token by token.

The one entry point is `generate` (and `stream`, the same as an iterator). Call it on every rank of
the group with the same arguments; every rank returns the same tokens.

    import treeattn as ta
    model = ta.load_model("path/to/checkpoint")
    result = ta.generate(model, [prompt_ids], max_new_tokens=64, decode="tree", method="allreduce")
    result.generated_ids[0]              # list of new token ids of the first prompt

    for step in ta.stream(model, [prompt_ids], max_new_tokens=64):   # tokens as they come
        print(step.tokens)

What happens, on each rank of `group` (p ranks; without torch.distributed initialized, p = 1):

1. Setup: arguments are validated (a prompt that does not fit in the cache fails here), and one
   all-gather checks that every rank got the same arguments, so a mismatch raises on every rank
   instead of hanging. A ShardedKVCache is built with the chosen placement.
2. Prefill, one of:
   - "ring": rank r runs only the prompt tokens it holds in the cache (placement decides), through
     all layers; each layer's attention is ring_attention. The prompt's compute is split p ways.
   - "local": every rank runs the whole prompt, `chunk` tokens at a time; each chunk attends to the
     cache through the decode attention (tree_decode / ring_decode across the shards; plain
     attention on one rank). Activations stay bounded by the chunk.
   "auto" picks "ring" on p > 1 ranks (unless a sliding window is shorter than the prompt:
   ring_attention has no window) and "local" on one.
3. Decode: rank 0 turns the last hidden state into logits, samples the next token of every
   sequence and broadcasts the ids, so every rank and every p sees the same tokens. Every rank then
   runs the new token through the model; its keys/values land on the rank the placement names;
   attention is "tree" (tree_decode with `method`), "ring" (ring_decode, pass-KV) or "local".
   Stops at max_new_tokens or when every sequence has produced a stop token.
   With static_decode=True the steps run through treeattn.decode_step.DecodeStep (fixed shapes,
   no host synchronization inside a step); with cuda_graph=True that step is captured in a CUDA
   graph once and replayed for every token. Logits, sampling and the broadcast stay outside it.

The prefill and the forward passes run through treeattn.sharded_runner.ShardedRunner (the model over
its sharded cache, the same calls on every rank).

Speculative decoding (speculate="ngram" or "draft", one prompt): every rank drafts up to draft_tokens
tokens: by prompt lookup (treeattn.speculate; a deterministic function of the context, which every
rank holds), or with a draft model run like the model itself, through its own ShardedRunner over its
own cache sharded like the model's (same capacity, placement and ranks, the same decode attention
and prefill; treeattn.draft_model: rank 0 picks each drafted token and broadcasts it before the next
draft forward pass; with draft_cache="rank0" the draft model runs on rank 0 alone with a whole cache
and broadcasts its drafts). Every rank then runs the last token and the drafts through the model in one
forward pass (their d + 1 causal queries at their positions through the same decode attention, so
one combine per layer verifies them all); rank 0 accepts a prefix of the drafts (greedy: exact
match; temperature > 0: the speculative-sampling rule with the drafter's proposal distribution, so
the output distribution is the model's) and broadcasts the outcome; every rank then truncates the
rejected drafts' keys/values from its shard of the model's cache (and the draft model from its own
before it drafts again). The draft model's prefill of the prompt runs before the first token (in
prefill_s), split across the ranks like the model's.

Sampling: temperature 0 is greedy (argmax). Otherwise logits / temperature, then top-k, then top-p
(nucleus), then one draw per sequence from a torch.Generator seeded with `seed` on rank 0.

A batch of prompts of different lengths is left-padded; padding tokens are invisible to every
query, so each sequence decodes exactly as it would alone.

Shared-context sampling (num_samples = n > 1, one prompt): the prompt is prefilled once, for one
sequence, into the sharded cache; the first logits are repeated n times and sampled like a batch
of n copies of the prompt (the same draws from the same seed). The n samples then decode in
lockstep with bifurcated attention (papers/bifurcated-attention.txt): their own tokens go to a
small cache of batch n that every rank keeps whole, and each step reads the prompt's K/V once for
all n samples (treeattn.models.shared_context). Every result also carries each sequence's token
log-probabilities under the model (softmax of the logits, before temperature, top-k and top-p)
and their mean, the pass@top-k ranking score of the paper.
"""

from __future__ import annotations

import hashlib
import logging
import os
import resource
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist

from treeattn.cache import PAD_POSITION, ShardedKVCache
from treeattn.decode_step import DecodeStep, graph_safe_reason
from treeattn.engine.measure import current_rss, peak_rss as peak_rss_bytes, reset_peak_rss
from treeattn.engine.config import (
    ConfigError,
    ConfigTypeError,
    GenerationConfig,
    SamplingParams,
    check_against_model,
    check_prompts,
    resolve_prefill,
)
from treeattn.models.attention import attention_backend, group_world_size
from treeattn.models.llama import LlamaModel
from treeattn.parallel.shared_memory import shared_memory_group
from treeattn.sharded_runner import ShardedRunner
from treeattn.speculate import NgramDrafter, accept

logger = logging.getLogger(__name__)



@dataclass
class StepOutput:
    """One decoding step: the new token of every sequence.

    Attributes:
        index: 0 for the first new token, 1 for the second, ...
        tokens: the new token id of each sequence (B ints; a finished sequence's entry is ignored).
        finished: per sequence, whether it has stopped (stop token or this was its last token).
        elapsed_s: seconds since generation started (setup and prefill included).
    """

    index: int
    tokens: list[int]
    finished: list[bool]
    elapsed_s: float


@dataclass
class GenerationResult:
    """What generate() returns, identical on every rank.

    Attributes:
        prompt_tokens: prompt length of each sequence.
        generated_ids: the new tokens of each sequence, up to and including its stop token.
        finish_reasons: per sequence, "stop" (a stop token) or "length" (max_new_tokens).
        prefill_s: seconds from the start to the first token (setup, prefill, first sample).
        decode_s: seconds spent in the decode steps after the first token.
        decode_steps: decode steps (new tokens - 1); a step is one forward pass of one token per
            sequence, then sampling and the broadcast of the next ids.
        step_times_s: wall time of each decode step on this rank.
        (comm_bytes_per_rank and comm cover exactly the decode steps; the prefill's, including the
        first token's broadcast, is in prefill_comm_bytes_per_rank.)
        world_size, decode, method, prefill, placement: how it ran.
        kv_bytes_per_rank: bytes of KV cache (keys, values, positions) each rank holds at the end.
        kv_bytes_per_token: bytes of keys and values one token takes in all layers (an MLA model's
            latent cache: one latent + RoPE key per layer).
        comm_bytes_per_rank: bytes each rank sent during the decode steps (treeattn's accounting).
        prefill_comm_bytes_per_rank: bytes each rank sent during the prefill.
        peak_rss_bytes_per_rank: peak resident memory of each rank during the decode steps
            (Linux: the high-water mark is reset when decoding starts; elsewhere the process peak).
        start_rss_bytes_per_rank: resident memory of each rank when decoding started; the
            difference to the peak is what decoding itself added (attention buffers, K/V in flight).
        comm: rank 0's comm_stats of the decode steps, as a dict (bytes, messages, rounds, by op).
        token_logprobs: per sequence, the log-probability of each generated token under the model
            (log-softmax of the logits, before temperature, top-k and top-p).
        num_samples: n of shared-context sampling (1: one sequence per prompt). With n > 1 the
            sequences are the n samples of the one prompt.
        decode_step: "dynamic" (the cache views grow each step), "static" (treeattn.decode_step,
            eager) or "graph" (the static step replayed from a CUDA graph).
        decode_setup_s: seconds spent building the static step and capturing its graph, after
            the first token and before the decode steps (in neither prefill_s nor decode_s).
        speculation: {} without speculative decoding; else method, draft_tokens (k), drafted,
            accepted, acceptance_rate (accepted / drafted), decoded_tokens (tokens the decode steps
            produced), tokens_per_forward (decoded_tokens / decode_steps) and draft_s (rank 0's
            seconds drafting, inside decode_s); with a draft model also draft_model (its path),
            draft_cache and draft_prefill_s (its prefill of the prompt, inside prefill_s). decode_steps then counts
            the model's verification forward passes, one per step.
    """

    prompt_tokens: list[int]
    generated_ids: list[list[int]]
    finish_reasons: list[str]
    prefill_s: float
    decode_s: float
    decode_steps: int
    step_times_s: list[float]
    world_size: int
    decode: str
    method: str
    prefill: str
    placement: str
    kv_bytes_per_rank: list[int] = field(default_factory=list)
    kv_bytes_per_token: int = 0
    comm_bytes_per_rank: list[float] = field(default_factory=list)
    prefill_comm_bytes_per_rank: list[float] = field(default_factory=list)
    peak_rss_bytes_per_rank: list[int] = field(default_factory=list)
    start_rss_bytes_per_rank: list[int] = field(default_factory=list)
    comm: dict = field(default_factory=dict)
    token_logprobs: list[list[float]] = field(default_factory=list)
    num_samples: int = 1
    decode_step: str = "dynamic"
    decode_setup_s: float = 0.0
    speculation: dict = field(default_factory=dict)

    @property
    def mean_logprobs(self) -> list[float]:
        """Per sequence, the mean log-probability of its generated tokens (the paper's ranking score)."""
        return [sum(lp) / len(lp) if lp else float("nan") for lp in self.token_logprobs]

    def ranking(self) -> list[int]:
        """Sequence indices ordered by mean log-probability, best first (ties: lower index first)."""
        scores = self.mean_logprobs
        return sorted(range(len(scores)), key=lambda i: (-scores[i], i))

    @property
    def time_per_token_s(self) -> float:
        """Mean seconds per decode step (one new token of every sequence), or with speculation per
        token the decode steps produced; nan without steps."""
        if not self.decode_steps:
            return float("nan")
        return self.decode_s / (self.speculation["decoded_tokens"] if self.speculation else self.decode_steps)

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second over the decode steps, all sequences together."""
        return len(self.prompt_tokens) / self.time_per_token_s if self.decode_steps else float("nan")

    @property
    def comm_bytes_per_token(self) -> float:
        """Bytes sent by all ranks together per decode step."""
        return sum(self.comm_bytes_per_rank) / self.decode_steps if self.decode_steps else float("nan")

    def as_dict(self) -> dict:
        """JSON-friendly dict of everything, with the derived rates."""
        out = {k: v for k, v in vars(self).items()}
        out.update(time_per_token_s=self.time_per_token_s, tokens_per_s=self.tokens_per_s, comm_bytes_per_token=self.comm_bytes_per_token,
                   mean_logprobs=self.mean_logprobs, ranking=self.ranking())
        return out


def generate(
    model: LlamaModel,
    prompts: Sequence[int] | Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    stop_tokens: Sequence[int] | None = None,
    num_samples: int = 1,
    decode: str = "tree",
    method: str | None = None,
    prefill: str = "auto",
    placement: str = "contiguous",
    block_size: int = 256,
    capacity: int | None = None,
    chunk: int = 1024,
    group: dist.ProcessGroup | None = None,
    topology=None,
    cache: ShardedKVCache | None = None,
    static_decode: bool = False,
    cuda_graph: bool = False,
    speculate: str | None = None,
    draft_tokens: int = 4,
    draft_model=None,
    draft_cache: str = "sharded",
    shared_memory: bool = True,
    on_token: Callable[[StepOutput], None] | None = None,
) -> GenerationResult:
    """Generate continuations of `prompts` with the KV cache sharded across the ranks of `group`.

    Call on every rank of the group with the same arguments (checked: a mismatch raises on every
    rank). Every rank returns the same GenerationResult. The options (all but model, prompts,
    group, topology, cache and on_token) form one GenerationConfig (treeattn.engine.config),
    validated once before any work.

    Args:
        model: a LlamaModel (treeattn.load_model or random_model), the same weights on every rank.
        prompts: one prompt (a list of token ids) or a list of prompts (a batch; left-padded); or
            chat messages ([{"role": "user", "content": ...}], or a batch of such lists), rendered
            with the model's chat template and tokenizer (model.chat_template, model.tokenizer, set
            by treeattn.load_model); the template's end-of-turn token then also stops generation.
        max_new_tokens: new tokens per sequence, >= 1.
        temperature: 0 for greedy decoding; > 0 (finite) scales the logits before sampling.
        top_k: keep the k most likely tokens (None: all).
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p (None: 1).
        seed: seed of the sampling generator (on rank 0; the ids are broadcast).
        stop_tokens: token ids that end a sequence; default the model's eos_token_ids.
        num_samples: n >= 1 completions of one prompt. n > 1 needs exactly one prompt and decode
            "tree" (or one process): one prefill, then the n samples decode with bifurcated
            attention; the result then has n sequences, ranked by result.mean_logprobs if wanted.
        decode: "tree" (tree_decode), "ring" (ring_decode, K/V passed around) or "local" (one rank).
        method: tree_decode method: "allreduce", "tree", "twolevel" or "onepass"; None: the
            default (treeattn.engine.config.DEFAULT_METHOD; "allreduce" for static steps).
        prefill: "auto", "ring" (ring_attention, prompt split across ranks) or "local" (every rank
            runs the prompt in chunks, attention through the decode attention).
        placement: "contiguous" or "interleaved" placement of tokens on ranks.
        block_size: cache block size in tokens.
        capacity: KV cache capacity in tokens per sequence; default longest prompt + max_new_tokens.
            A cache that would not fit in the device's memory is refused before it is allocated.
        chunk: tokens per chunk of the "local" prefill and of MLP activations.
        group: process group; None is the default group (or a single process without one).
        topology: treeattn Topology for method "twolevel".
        cache: a ShardedKVCache that already holds these prompts (the .cache of an earlier
            Generation with the same prompts, placement and group), to decode again without a
            prefill: it is cut back to the prompt minus its last token, which is run again to get
            the first logits. The cache remembers the token ids it holds; a cache holding other
            tokens (or filled outside generate) is refused. None: a new cache and a full prefill.
        static_decode: decode with treeattn.decode_step.DecodeStep: fixed shapes (attention over
            the whole cache capacity, unused slots hidden), no host synchronization inside a
            step. Needs num_samples == 1; on CUDA a model the Triton decode kernel takes.
        cuda_graph: static_decode, with the step captured in a CUDA graph after warmup and
            replayed for every token. Needs the model on a CUDA device.
        speculate: None, "ngram" or "draft": speculative decoding (one prompt): each step drafts up
            to draft_tokens tokens, by prompt lookup (treeattn.speculate.NgramDrafter) or with
            draft_model (treeattn.draft_model.DraftModelDrafter, on every rank, its cache sharded like the model's),
            verifies them in one forward pass and keeps what the acceptance rule accepts (greedy: the
            same tokens as without speculation; temperature > 0: the same distribution).
            result.speculation reports it.
        draft_tokens: the most tokens drafted per step, in [1, 16].
        draft_model: with speculate="draft": the draft model, a checkpoint path (loaded, on the ranks
            that run it, in the model's dtype and device) or a loaded LlamaModel, of the model's tokenizer.
        draft_cache: where the draft model runs: "sharded" (every rank, over its own cache sharded
            like the model's) or "rank0" (rank 0 alone, its cache whole, the drafts broadcast);
            docs/benchmarks.md measures both.
        shared_memory: combine across the ranks through shared memory when they all run on this
            host and the model is on the CPU (treeattn.parallel.shared_memory: one round, no
            sockets); False: through the group's back end (gloo, NCCL).
        on_token: called with each StepOutput as tokens come (on every rank).

    Returns:
        GenerationResult.

    Raises:
        ValueError / TypeError: bad arguments (treeattn.engine.config.ConfigError names the
            option), a prompt that does not fit, ranks that disagree -- before any prefill work.
        NonFiniteLogitsError: the model produced NaN or inf logits (on every rank; nothing
            non-finite becomes a token).
    """
    run = stream(
        model, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
        seed=seed, stop_tokens=stop_tokens, num_samples=num_samples, decode=decode, method=method, prefill=prefill,
        placement=placement, block_size=block_size, capacity=capacity, chunk=chunk, group=group, topology=topology,
        cache=cache, static_decode=static_decode, cuda_graph=cuda_graph, speculate=speculate, draft_tokens=draft_tokens,
        draft_model=draft_model, draft_cache=draft_cache, shared_memory=shared_memory,
    )
    for step in run:
        if on_token is not None:
            on_token(step)
    return run.result


def stream(model: LlamaModel, prompts, *, group: dist.ProcessGroup | None = None, topology=None,
           cache: ShardedKVCache | None = None, **options) -> "Generation":
    """generate() as an iterator: `for step in stream(model, prompts, ...)` yields a StepOutput per
    new token; afterwards `.result` holds the GenerationResult. Same arguments as generate()
    (without on_token). Arguments are checked here, before any work."""
    from treeattn.models.chat import encode_prompts, is_chat

    if is_chat(prompts):  # chat messages: rendered by the model's template; stop at its end of turn too
        prompts, end_of_turn = encode_prompts(model, prompts)
        if options.get("stop_tokens") is None:
            options["stop_tokens"] = list(model.config.eos_token_ids) + end_of_turn
    return Generation(model, prompts, group=group, topology=topology, cache=cache, **options)


class NonFiniteLogitsError(RuntimeError):
    """The model produced NaN or inf logits; raised on every rank, before any such token is used."""


class Generation:
    """One generation run (see generate). Iterate over it to run it; then read .result.

    Args:
        model, prompts, group, topology, cache: as for generate().
        config: the GenerationConfig; or leave it None and pass its fields as keywords (**options).
    """

    def __init__(
        self,
        model: LlamaModel,
        prompts,
        config: GenerationConfig | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        topology=None,
        cache: ShardedKVCache | None = None,
        **options,
    ) -> None:
        self.model, self.group, self.topology = model, group, topology
        self.rank, self.world_size = _rank_and_size(group)
        self.result: GenerationResult | None = None
        local_error = capacity = block_size = prefill = draft_model = draft_prefill = None  # resolved below
        try:
            if config is None:
                config = GenerationConfig(**options)
            elif options:
                raise ConfigTypeError("config", f"give either config or its fields as keywords, not both (got {sorted(options)})")
            elif not isinstance(config, GenerationConfig):
                raise ConfigTypeError("config", f"config must be a GenerationConfig, got {type(config).__name__}")
            self.prompts = check_prompts(prompts, model.config.vocab_size)
            warnings = check_against_model(config, model.config, self.prompts, self.world_size, dtype=model.dtype, device=model.device)
            if self.rank == 0:  # the same on every rank: say it once
                for warning in warnings:
                    logger.warning("%s", warning)
            if config.decode_step != "dynamic":
                _check_static_step(config, model, len(self.prompts))
            longest = max(len(p) for p in self.prompts)
            capacity, block_size = config.cache_capacity(longest), config.block_size
            prefill = resolve_prefill(config.prefill, self.world_size, longest, model.config.layer_windows)
            if prefill == "local" and config.prefill == "auto" and self.world_size > 1 and self.rank == 0:
                logger.info("a sliding window shorter than the prompt: prefill 'local' (ring_attention has no window)")
            if config.speculate == "draft" and (config.draft_cache == "sharded" or self.rank == 0):  # the ranks that run it
                from treeattn.draft_model import check_loaded_draft

                draft_model = check_loaded_draft(config.draft_model, model, positions=longest + config.max_new_tokens)
                draft_prefill = resolve_prefill(config.prefill, self.world_size, longest, draft_model.config.layer_windows)
            if cache is not None:
                tokens, positions = _left_pad(self.prompts, "cpu")
                _check_reused_cache(cache, model, tokens, positions, longest + config.max_new_tokens, config.placement,
                                    self.rank, self.world_size)
                capacity, block_size, prefill = cache.capacity, cache.block_size, "reused"
        except (ValueError, TypeError) as exc:
            local_error = exc
        self._agree(config, local_error, capacity=capacity, block_size=block_size, prefill=prefill)
        self.config = config
        self.stop_tokens = frozenset(model.config.eos_token_ids if config.stop_tokens is None else config.stop_tokens)
        self.sampling = config.sampling
        self.decode_step = config.decode_step
        self.max_new_tokens, self.seed, self.chunk, self.num_samples = config.max_new_tokens, config.seed, config.chunk, config.num_samples
        decode = config.decode
        if not _distributed(group) and decode != "local":
            logger.info("no process group: decode=%r runs as plain attention on this one process", decode)
            decode = "local"
        self.decode, self.method, self.prefill, self.placement = decode, config.method, prefill, config.placement
        # The group the decode attention combines over and the tokens are broadcast on.
        self.comm_group = shared_memory_group(group, device=model.device) if config.shared_memory else group
        self.cache = cache if cache is not None else ShardedKVCache(
            num_layers=model.config.num_layers, num_kv_heads=model.config.num_kv_heads, head_dim=model.config.head_dim,
            value_dim=model.config.cache_value_dim, capacity=capacity, batch_size=len(self.prompts), placement=config.placement, block_size=block_size,
            rank=self.rank, world_size=self.world_size, dtype=model.dtype, device=model.device,
        )
        self.runner = ShardedRunner(model, self.cache, decode=decode, method=self.method, prefill=prefill, group=self.comm_group,
                                    topology=topology, chunk=self.chunk)
        self._drafter = self._make_drafter(draft_model, draft_prefill) if config.speculate else None
        self._draft_s = self._draft_prefill_s = 0.0  # this rank's seconds drafting, and in the draft model's prefill
        # The samples' own tokens (num_samples > 1): batch n, unsharded, the same on every rank.
        self.sample_cache = None if self.num_samples == 1 else ShardedKVCache(
            num_layers=model.config.num_layers, num_kv_heads=model.config.num_kv_heads, head_dim=model.config.head_dim,
            value_dim=model.config.cache_value_dim, capacity=self.max_new_tokens, batch_size=self.num_samples, block_size=min(block_size, self.max_new_tokens),
            dtype=model.dtype, device=model.device,
        )

    def _make_drafter(self, draft_model, draft_prefill: str | None):
        """This rank's drafter: prompt lookup; the draft model over its own cache sharded like the model's;
        or with draft_cache "rank0" the draft model on rank 0 alone, its cache whole (None elsewhere)."""
        if self.config.speculate == "ngram":
            return NgramDrafter()
        from treeattn.draft_model import DraftModelDrafter

        if self.config.draft_cache == "sharded":
            return DraftModelDrafter.like(draft_model, self.runner, prefill=draft_prefill, sampling=self.sampling)
        if self.rank == 0:
            return DraftModelDrafter.whole(draft_model, capacity=self.cache.capacity, sampling=self.sampling, chunk=self.chunk)
        return None

    def _agree(self, config, local_error, *, capacity, block_size, prefill) -> None:
        """Every rank checks that all ranks got the same prompts, options and model (one all-gather),
        so that a rank with bad or different arguments fails every rank instead of hanging them."""
        if self.world_size == 1:
            if local_error is not None:
                raise local_error
            return
        from treeattn.parallel.metadata import UNKNOWN, gather_metadata

        names = ("prompts", *(f.name for f in fields(GenerationConfig)), "resolved capacity", "resolved block_size",
                 "resolved prefill", "model")
        if local_error is not None:
            values = dict.fromkeys(names, UNKNOWN)
        else:
            values = {"prompts": _fingerprint(self.prompts)}
            values.update({name: _model_fingerprint(value) if isinstance(value, torch.nn.Module) else _fingerprint(value)
                           for name, value in config.as_dict().items()})
            values.update({"resolved capacity": capacity, "resolved block_size": block_size,
                           "resolved prefill": _fingerprint(prefill), "model": _model_fingerprint(self.model)})
        gather_metadata("generate", values, self.group, must_match=names, local_error=local_error)

    # ------------------------------------------------------------------------------ running

    def __iter__(self) -> Iterator[StepOutput]:
        if self.result is not None:
            raise RuntimeError("this Generation has already run; call generate()/stream() again")
        from treeattn.parallel import comm_stats

        self.start_time = time.perf_counter()
        _CACHED_TOKENS.pop(self.cache, None)  # its contents change now; recorded again at the end
        with torch.inference_mode():
            tokens, positions = _left_pad(self.prompts, self.model.device)
            fed = [tokens.cpu()]  # the token ids run into the cache, (B, n) blocks
            generator = torch.Generator(device="cpu").manual_seed(self.seed)
            with comm_stats() as prefill_comm:
                last_hidden = self.runner.prefill(tokens, positions)
                if self.config.speculate == "draft" and self._drafter is not None:  # the draft's own prefill, in the time to first token
                    draft_start = time.perf_counter()
                    self._drafter.prefill(self.prompts[0])
                    self._draft_prefill_s = time.perf_counter() - draft_start
                if self.num_samples > 1:  # n samples of the one prompt: its logits, n times
                    last_hidden = last_hidden.expand(self.num_samples, -1)
                new, logprobs = self._next_tokens(last_hidden, generator, index=0)
            prefill_s = time.perf_counter() - self.start_time
            outputs = _Outputs(len(new), self.stop_tokens)
            next_pos = (positions[:, -1] + 1).expand(len(new))
            setup_start = time.perf_counter()
            static_step = self._static_step(next_pos) if self.decode_step != "dynamic" and self.max_new_tokens > 1 else None
            decode_setup_s = time.perf_counter() - setup_start
            step_logprobs: list[torch.Tensor] = []  # per step, (B,) float64; real on rank 0 only
            step_times: list[float] = []
            start_rss = current_rss()
            reset_peak_rss()
            with comm_stats() as decode_comm:  # each step: one forward pass, then sample and broadcast
                steps = self._speculative_steps if self.config.speculate else self._steps
                yield from steps(new, logprobs, next_pos, generator, static_step, outputs, fed, step_logprobs, step_times)
            decode_s = sum(step_times)
            peak_rss = peak_rss_bytes()
            _remember_tokens(self.cache, torch.cat(fed, dim=1), positions.cpu())
            token_logprobs = self._token_logprobs(step_logprobs, outputs.generated)  # one broadcast, after the timed steps
            kv_bytes = self.cache.nbytes() + (self.sample_cache.nbytes() if self.sample_cache is not None else 0)
            per_rank = self._gather_per_rank([kv_bytes, decode_comm.bytes_sent, prefill_comm.bytes_sent, peak_rss, start_rss,
                                              self._draft_s, self._draft_prefill_s])
            self.result = GenerationResult(
                prompt_tokens=[len(p) for p in self.prompts] * self.num_samples, generated_ids=outputs.generated,
                finish_reasons=outputs.reasons, token_logprobs=token_logprobs, num_samples=self.num_samples,
                prefill_s=prefill_s, decode_s=decode_s, decode_steps=len(step_times), step_times_s=step_times,
                world_size=self.world_size, decode=self.decode, method=self.method, prefill=self.prefill,
                placement=self.placement, kv_bytes_per_rank=[int(x) for x in per_rank[0]],
                kv_bytes_per_token=self.cache.bytes_per_token,
                comm_bytes_per_rank=per_rank[1], prefill_comm_bytes_per_rank=per_rank[2],
                peak_rss_bytes_per_rank=[int(x) for x in per_rank[3]], start_rss_bytes_per_rank=[int(x) for x in per_rank[4]],
                comm=decode_comm.as_dict(), decode_step=self.decode_step, decode_setup_s=decode_setup_s,
                speculation=self._speculation_report(draft_s=per_rank[5][0], draft_prefill_s=per_rank[6][0]),
            )

    def _speculation_report(self, *, draft_s: float, draft_prefill_s: float) -> dict:
        """result.speculation: the counts of _speculative_steps and rank 0's drafting times; {} without."""
        if not self.config.speculate:
            return {}
        report = dict(self._speculation, draft_s=draft_s)
        if self.config.speculate == "draft":
            from treeattn.draft_model import describe

            report.update(draft_model=describe(self.config.draft_model), draft_cache=self.config.draft_cache,
                          draft_prefill_s=draft_prefill_s)
        return report

    def _steps(self, new, logprobs, next_pos, generator, static_step, outputs, fed, step_logprobs, step_times) -> Iterator[StepOutput]:
        """The decode steps, one new token per sequence each: yields a StepOutput per token (the first
        one, `new`, sampled after the prefill, included) and appends to outputs, fed (token ids run
        into the cache), step_logprobs and step_times."""
        for index in range(self.max_new_tokens):
            if index > 0:
                step_start = time.perf_counter()
                if static_step is not None:
                    hidden = static_step(new)
                elif self.num_samples == 1:
                    hidden = self._decode_step(new, next_pos)
                else:
                    hidden = self._sample_step(new, next_pos)
                if self.num_samples == 1:
                    fed.append(new.cpu()[:, None])
                new, logprobs = self._next_tokens(hidden, generator, index=index)
                next_pos = next_pos + 1
                step_times.append(time.perf_counter() - step_start)
            outputs.add(new.tolist())
            step_logprobs.append(logprobs)
            last = index == self.max_new_tokens - 1 or all(outputs.finished)
            yield StepOutput(index, new.tolist(), [f or last for f in outputs.finished], time.perf_counter() - self.start_time)
            if last:
                break

    def _speculative_steps(self, new, logprobs, next_pos, generator, static_step, outputs, fed, step_logprobs,
                           step_times) -> Iterator[StepOutput]:
        """_steps with speculation (one sequence): each step drafts d <= draft_tokens tokens on every
        rank (_propose), runs the last token and the drafts through the model in one forward pass
        (d + 1 causal queries at their positions through the decode attention), keeps the accepted
        drafts and the token after them (rank 0 decides, one broadcast), and cuts the rejected drafts'
        keys/values out of the cache on every rank. Yields a StepOutput per token; a step_times entry
        per forward pass (drafting included)."""
        context = torch.tensor(self.prompts[0] + [0] * self.max_new_tokens, dtype=torch.int64)
        length = len(self.prompts[0])
        stats = {"method": self.config.speculate, "draft_tokens": self.config.draft_tokens, "drafted": 0, "accepted": 0}
        emitted, emitted_logprobs, index = [int(new[0])], [logprobs], 0
        while True:
            for token, token_logprob in zip(emitted, emitted_logprobs):
                context[length] = token
                length += 1
                outputs.add([token])
                step_logprobs.append(token_logprob)
                last = index == self.max_new_tokens - 1 or outputs.finished[0]
                yield StepOutput(index, [token], [True] if last else [False], time.perf_counter() - self.start_time)
                index += 1
                if last:
                    decoded = index - 1
                    stats.update(acceptance_rate=stats["accepted"] / stats["drafted"] if stats["drafted"] else float("nan"),
                                 decoded_tokens=decoded, tokens_per_forward=decoded / len(step_times) if step_times else float("nan"))
                    self._speculation = stats
                    return
            step_start = time.perf_counter()
            draft, proposal = self._propose(context[:length], index, generator)
            inputs = torch.cat([context[length - 1: length], draft])[None]  # (1, d + 1): the last token, then the drafts
            positions = next_pos[:, None] + torch.arange(inputs.shape[1], device=next_pos.device)
            hidden = self.runner.forward(inputs.to(self.model.device), positions)
            accepted, emitted, emitted_logprobs = self._verify(hidden[0], draft, proposal, generator, index=index)
            self.cache.truncate(self.cache.length - (draft.numel() - accepted))
            fed.append(inputs[:, : accepted + 1])
            next_pos = next_pos + accepted + 1
            stats["drafted"] += draft.numel()
            stats["accepted"] += accepted
            step_times.append(time.perf_counter() - step_start)

    def _propose(self, context: torch.Tensor, emitted: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafts after `context` (int64 (L,)) when `emitted` tokens have been produced, on every
        rank: (draft int64 (d,), d <= the tokens still to produce - 1, the same on every rank; proposal
        float64 (d, V) on rank 0, or None for a one-hot proposal). Prompt lookup is a deterministic
        function of the context, which every rank holds, so each rank runs it alone; the draft model
        runs on every rank together (DraftModelDrafter.propose, a broadcast per drafted token), or with
        draft_cache "rank0" on rank 0 alone, which then broadcasts its drafts."""
        budget = min(self.config.draft_tokens, self.max_new_tokens - emitted - 1)
        start = time.perf_counter()
        if self.config.speculate == "ngram":
            draft, proposal = self._drafter.propose(context, budget), None
        elif self.config.draft_cache == "sharded":
            draft, proposal = self._drafter.propose(context, budget, generator)
        else:
            draft, proposal = self._drafter.propose(context, budget, generator) if self.rank == 0 else (context[:0], None)
            draft = self._broadcast_draft(draft)
        self._draft_s += time.perf_counter() - start
        return draft, proposal

    def _broadcast_draft(self, draft: torch.Tensor) -> torch.Tensor:
        """Rank 0's drafts int64 (d,), d <= draft_tokens, to every rank in one broadcast (the others
        pass anything); returns them on every rank."""
        message = torch.zeros(1 + self.config.draft_tokens, dtype=torch.int64)
        if self.rank == 0:
            message[0] = draft.numel()
            message[1: 1 + draft.numel()] = draft
        message = self._broadcast(message.to(self.model.device), src=0).cpu()
        return message[1: 1 + int(message[0])].clone()

    def _verify(self, hidden: torch.Tensor, draft: torch.Tensor, proposal: torch.Tensor | None, generator: torch.Generator,
                *, index: int) -> tuple[int, list[int], list[torch.Tensor]]:
        """Accept drafts on rank 0 (treeattn.speculate.accept) and broadcast the outcome.

        Args:
            hidden: (d + 1, hidden_size) final hidden states of the last token and the d drafts.
            draft: int64 (d,) on the CPU, the same on every rank.
            proposal: float64 (d, V), the distribution the drafts were drawn from, on rank 0; None for
                a one-hot proposal (and on the other ranks).
            index: tokens emitted before this step.

        Returns:
            (accepted, tokens, logprobs): the number of drafts kept; the accepted + 1 new tokens; their
            float64 (1,) log-probabilities under the model (zeros on ranks other than 0).
        """
        d = draft.numel()
        outcome = torch.tensor([-2, -2], dtype=torch.int64)
        logprobs = torch.zeros(d + 1, dtype=torch.float64)
        if self.rank == 0:
            logits = self.model.logits(hidden).float().cpu()  # (d + 1, V)
            if bool(torch.isfinite(logits).all()):
                if self.sampling.temperature == 0:
                    probs = torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).double()
                else:
                    probs = sampling_probs(logits, self.sampling)
                uniforms = torch.rand(d + 1, generator=generator, dtype=torch.float64)
                accepted, token = accept(probs, draft, uniforms[:d], float(uniforms[d]), proposal=proposal)
                tokens = draft[:accepted].tolist() + [token]
                logprobs[: accepted + 1] = chosen_logprobs(logits[: accepted + 1], torch.tensor(tokens))
                outcome = torch.tensor([accepted, token], dtype=torch.int64)
            else:
                outcome = torch.tensor([-1, -1], dtype=torch.int64)
        accepted, token = self._broadcast(outcome.to(self.model.device), src=0).tolist()
        if accepted < 0:
            raise NonFiniteLogitsError(f"the model produced non-finite logits (NaN or inf) for sequence(s) [0] at new token "
                                       f"{index} (or one of the {d} drafted after it); generation stopped. {self._locate_non_finite()}")
        tokens = draft[:accepted].tolist() + [token]
        return accepted, tokens, [logprobs[i: i + 1] for i in range(accepted + 1)]

    def _decode_step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run one new token per sequence, tokens/positions int64 (B,). Returns hidden (B, hidden_size)."""
        return self.runner.forward(tokens[:, None], positions[:, None])[:, -1]

    def _broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return self.runner.broadcast(tensor, src)

    def _static_step(self, positions: torch.Tensor):
        """The DecodeStep that runs the decode steps (static_decode / cuda_graph), captured in a CUDA
        graph for cuda_graph. positions: int64 (B,), those of the first token it runs. It returns
        the final hidden state (B, hidden_size); logits and sampling stay outside (on rank 0)."""
        decode = self.decode if _distributed(self.group) else "local"
        step = DecodeStep(self.model, self.cache, positions, decode=decode, method=self.method, group=self.group,
                          topology=self.topology, logits=False)
        if self.decode_step == "graph":
            step.capture()
        return step

    def _sample_step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A decode step for num_samples > 1: the n samples' new tokens (int64 (n,)) go to the samples'
        cache, and attention reads the shared prompt once for all of them (bifurcated)."""
        from treeattn.models.shared_context import SharedContextUpdate

        if not hasattr(self, "_bifurcated_attend"):
            self._bifurcated_attend = attention_backend(self.decode, method=self.method, group=self.comm_group, topology=self.topology,
                                                        shared_context=True)
        slots = self.sample_cache.extend(positions[:, None])
        store = SharedContextUpdate(self.cache, self.sample_cache.update(slots))
        hidden = self.model(tokens[:, None], positions[:, None], store, self._bifurcated_attend)
        return hidden[:, -1]

    def _next_tokens(self, hidden: torch.Tensor, generator: torch.Generator, *, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample on rank 0, broadcast: int64 (B,) next token ids, the same on every rank, and
        float64 (B,) their log-probabilities under the model (on rank 0; zeros on the others).

        Non-finite logits are never sampled: rank 0 broadcasts negative ids instead (-1 for each
        row with a NaN or inf, -2 for the others), and every rank raises NonFiniteLogitsError.
        The hot path pays one isfinite over the logits; the layer is looked for only then."""
        logprobs = torch.zeros(hidden.shape[0], dtype=torch.float64)
        if self.rank == 0:
            tokens, logprobs = self._sample(hidden, generator)
        else:
            tokens = torch.empty(hidden.shape[0], dtype=torch.int64, device=hidden.device)
        tokens = self._broadcast(tokens, src=0)
        if int(tokens.min()) < 0:
            bad = (tokens == -1).nonzero().flatten().tolist()
            raise NonFiniteLogitsError(f"the model produced non-finite logits (NaN or inf) for sequence(s) {bad} at new token "
                                       f"{index}; generation stopped. {self._locate_non_finite()}")
        return tokens, logprobs

    def _sample(self, hidden: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank 0's part of _next_tokens: logits, then int64 (B,) tokens on hidden's device (negative
        ids for non-finite logits) and their float64 (B,) log-probabilities."""
        logits = self.model.logits(hidden)
        finite_rows = torch.isfinite(logits).all(dim=-1).cpu()
        if not bool(finite_rows.all()):
            return torch.where(finite_rows, -2, -1).to(torch.int64).to(hidden.device), torch.zeros(hidden.shape[0], dtype=torch.float64)
        tokens = sample(logits, self.sampling, generator)
        return tokens.to(hidden.device), chosen_logprobs(logits, tokens)

    def _locate_non_finite(self) -> str:
        """Where the non-finite values start (the error path only; a collective on every rank): the
        first layer whose cached keys/values hold a NaN or inf on any rank, and any non-finite weights."""
        layers = [self.cache] + ([self.sample_cache] if self.sample_cache is not None else [])
        first = self.model.config.num_layers
        for layer in range(self.model.config.num_layers):
            if any(not bool(torch.isfinite(t).all()) for c in layers for t in c.layer(layer)):
                first = layer
                break
        if _distributed(self.group):
            first_t = torch.tensor([first], dtype=torch.int64)
            dist.all_reduce(first_t, op=dist.ReduceOp.MIN, group=self.group)
            first = int(first_t)
        if first < self.model.config.num_layers:
            where = f"The first non-finite keys/values are in layer {first} (its input, or its k/v projection, is non-finite)."
        else:
            where = "The keys/values of every layer are finite: the last layer's output, the final norm or lm_head made them."
        weights = [name for name, p in self.model.named_parameters() if not bool(torch.isfinite(p).all())]
        if weights:
            where += f" Non-finite weights: {', '.join(weights[:3])}" + (f" and {len(weights) - 3} more" if len(weights) > 3 else "") + "."
        elif self.model.dtype != torch.float32:
            where += f" The weights are finite: an overflow in {str(self.model.dtype).removeprefix('torch.')}? Try float32."
        return where

    def _token_logprobs(self, step_logprobs: list[torch.Tensor], generated: list[list[int]]) -> list[list[float]]:
        """Each sequence's token log-probabilities, from rank 0 to every rank in one broadcast."""
        table = self._broadcast(torch.stack(step_logprobs).to(self.model.device), src=0).cpu()  # (steps, B)
        return [table[: len(ids), b].tolist() for b, ids in enumerate(generated)]

    def _gather_per_rank(self, values: list[float]) -> list[list[float]]:
        """All-gather a few numbers from every rank: [value][rank]."""
        vector = torch.tensor(values, dtype=torch.float64)
        if not _distributed(self.group):
            rows = [vector]
        else:
            rows = [torch.empty_like(vector) for _ in range(self.world_size)]
            dist.all_gather(rows, vector, group=self.group)
        return [[float(row[i]) for row in rows] for i in range(len(values))]


class _Outputs:
    """The tokens generated so far for each sequence, and which sequences have stopped."""

    def __init__(self, batch: int, stop_tokens: frozenset[int]) -> None:
        self.stop_tokens = stop_tokens
        self.generated: list[list[int]] = [[] for _ in range(batch)]
        self.finished = [False] * batch
        self.reasons = ["length"] * batch

    def add(self, tokens: list[int]) -> None:
        for b, token in enumerate(tokens):
            if self.finished[b]:
                continue
            self.generated[b].append(token)
            if token in self.stop_tokens:
                self.finished[b], self.reasons[b] = True, "stop"


# ---------------------------------------------------------------------------------- sampling


def chosen_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """float64 (B,) log-softmax of logits (B, V) at tokens int64 (B,): logit - logsumexp, without
    materializing the log-softmax of the whole vocabulary."""
    logits = logits.cpu().double()
    return logits.gather(1, tokens[:, None].cpu()).squeeze(1) - torch.logsumexp(logits, dim=-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """Pick the next token of each row.

    Args:
        logits: (B, V) float32.
        params: SamplingParams.
        generator: CPU torch.Generator; exactly one uniform draw per row is taken from it when
            temperature > 0 (none for greedy), so the same seed gives the same stream of draws.

    Returns:
        int64 (B,) token ids on the CPU.
    """
    logits = logits.float().cpu()
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    cdf = sampling_probs(logits, params).cumsum(dim=-1)
    draw = torch.rand(logits.shape[0], 1, generator=generator, dtype=torch.float64) * cdf[:, -1:]
    return torch.searchsorted(cdf, draw, right=True).squeeze(-1).clamp(max=logits.shape[-1] - 1)


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sample() draws from, for temperature > 0: float64 (B, V) on the CPU from
    logits (B, V): logits / temperature, then top-k, then top-p, then softmax."""
    logits = logits.float().cpu() / params.temperature
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the more likely tokens
        drop_sorted = mass_before >= params.top_p  # the most likely token is always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.softmax(logits, dim=-1).double()


# ----------------------------------------------------------------------------------- helpers


def _rank_and_size(group) -> tuple[int, int]:
    """(rank in `group`, size of `group`); (0, 1) without torch.distributed."""
    p = group_world_size(group)  # raises if a group is given without torch.distributed
    return (dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0), p


def _distributed(group) -> bool:
    """Whether `group` has more than one rank (collectives are needed)."""
    return group_world_size(group) > 1


def _check_static_step(config: GenerationConfig, model: LlamaModel, batch: int) -> None:
    """static_decode / cuda_graph: what needs the model (its device, the Triton kernel)."""
    option = "cuda_graph" if config.cuda_graph else "static_decode"
    if config.cuda_graph and model.device.type != "cuda":
        raise ConfigError(option, f"cuda_graph=True needs the model on a CUDA device, got {model.device} "
                          "(static_decode=True runs the same step without a graph)")
    reason = graph_safe_reason(model, batch)
    if reason is not None:
        raise ConfigError(option, f"{option}=True cannot run this model without host synchronization: {reason}")


# The token ids (and positions) each cache holds, recorded by the Generation that filled it, so that a
# cache passed back to generate() is checked against the new prompts: int64 (B, cache.length) each.
_CACHED_TOKENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _remember_tokens(cache: ShardedKVCache, tokens: torch.Tensor, positions: torch.Tensor) -> None:
    """Record what `cache` holds: tokens int64 (B, >= cache.length), positions int64 (B, L) of the prompt."""
    steps = torch.arange(1, tokens.shape[1] - positions.shape[1] + 1).expand(tokens.shape[0], -1)
    positions = torch.cat([positions, positions[:, -1:] + steps], dim=1)
    if tokens.shape[1] >= cache.length:
        _CACHED_TOKENS[cache] = (tokens[:, : cache.length], positions[:, : cache.length])


def _check_reused_cache(cache, model, tokens: torch.Tensor, positions: torch.Tensor, needed: int, placement: str,
                        rank: int, world_size: int) -> None:
    """A cache passed to generate(): the same layout, room for `needed` slots, and it holds exactly
    the new prompts (tokens, positions: int64 (B, L) on the CPU, left-padded)."""
    if not isinstance(cache, ShardedKVCache):
        raise ConfigTypeError("cache", f"cache must be a ShardedKVCache or None, got {type(cache).__name__}")
    batch, longest = tokens.shape
    expected = (model.config.num_layers, model.config.num_kv_heads, model.config.head_dim, model.config.cache_value_dim, batch,
                placement, rank, world_size)
    actual = (cache.num_layers, cache.num_kv_heads, cache.head_dim, cache.value_dim, cache.batch_size, cache.placement.kind,
              cache.rank, cache.world_size)
    if expected != actual:
        raise ConfigError("cache", "cache does not fit this generation: (layers, Hkv, D, value_dim, batch, placement, rank, world_size) "
                          f"expected {expected}, got {actual}")
    if cache.length < longest:
        raise ConfigError("cache", f"cache holds {cache.length} tokens, fewer than the prompt's {longest}")
    if cache.capacity < needed:
        raise ConfigError("cache", f"cache capacity {cache.capacity} is below the {needed} slots this generation needs")
    held = _CACHED_TOKENS.get(cache)
    if held is None:
        raise ConfigError("cache", "cache holds tokens no finished generate() recorded (a new, hand-filled or interrupted cache): "
                          "pass cache=None to prefill")
    held_tokens, held_positions = held
    if not (torch.equal(held_tokens[:, :longest], tokens) and torch.equal(held_positions[:, :longest], positions)):
        differ = (held_tokens[:, :longest] != tokens) | (held_positions[:, :longest] != positions)
        b, i = (int(x) for x in differ.nonzero()[0])
        raise ConfigError("cache", f"cache holds a different context: sequence {b} differs from the prompt at token {i} "
                          f"(cached id {int(held_tokens[b, i])}, prompt id {int(tokens[b, i])}); pass cache=None to prefill")


def _left_pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens int64 (B, L) left-padded with id 0; positions int64 (B, L), PAD_POSITION on padding."""
    length = max(len(p) for p in prompts)
    tokens = torch.zeros(len(prompts), length, dtype=torch.int64)
    positions = torch.full((len(prompts), length), PAD_POSITION, dtype=torch.int64)
    for b, prompt in enumerate(prompts):
        tokens[b, length - len(prompt):] = torch.tensor(prompt, dtype=torch.int64)
        positions[b, length - len(prompt):] = torch.arange(len(prompt))
    return tokens.to(device), positions.to(device)


def _fingerprint(value) -> int:
    """A stable int64 digest of a JSON-able value (for the cross-rank agreement check)."""
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _model_fingerprint(model: LlamaModel) -> int:
    """Digest of the config and a few weights, so ranks with different models fail early."""
    probe = [model.embed_tokens.weight[:2].float().sum().item(), model.norm.weight.float().sum().item()]
    c = model.config
    return _fingerprint([c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, str(model.dtype), probe])
