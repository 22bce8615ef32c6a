"""Generation: one batch of prompts from prefill to the last token, on top of ta.Engine.

    import treeattn as ta
    model = ta.load_model("path/to/checkpoint")
    result = ta.generate(model, [prompt_ids], max_new_tokens=64, decode="tree")
    result.generated_ids[0]              # list of new token ids of the first prompt
    result = ta.generate(model, [prompt_ids], EngineConfig(decode="tree"), SamplingParams(max_new_tokens=64))  # the same

    for step in ta.stream(model, [prompt_ids], max_new_tokens=64):   # tokens as they come
        print(step.tokens)

Call it on every rank of the group (p ranks; without torch.distributed initialized, p = 1) with
the same arguments; every rank returns the same GenerationResult. What happens:

1. Setup: the options are the engine's: an EngineConfig (how it runs) and a SamplingParams (how to
   sample), given as objects or as their fields' keywords, the same names as everywhere. The
   EngineConfig is sized to this batch (batch_config), then checked with the prompts and the model
   on every rank by the engine's own checks (a prompt that does not fit, or a cache that does not
   fit in memory, fails here); one all-gather checks that every rank got the same prompts, options
   and model, so a mismatch raises on every rank instead of hanging.
2. The ranks form a ta.Engine inside the group (treeattn.engine: rank 0 drives, every rank runs
   its share of each step), sized to this batch: one running slot per sequence, max_context cache
   slots per sequence (default: the longest prompt + max_new_tokens; so contiguous placement gives
   each rank one span of every sequence, the paper's layout). Rank 0 submits every sequence as a
   request; the engine prefills them (see EngineConfig.prefill) and decodes them together, one
   batched forward pass and one combine per layer per step.
3. Rank 0 turns the engine's token events into one StepOutput per new-token index, reads every
   rank's measurements (treeattn.engine.measure), closes the engine (which lets the other ranks
   return) and broadcasts the result; the other ranks replay the StepOutputs from it.

Sampling: sequence i draws from its own generator seeded with seed + i (treeattn.engine.worker.sampling:
temperature 0 is greedy; otherwise logits / temperature, then top-k, then top-p, one draw per
token), so a sequence's tokens do not depend on the others in the batch. Shared-context sampling
(num_samples = n > 1, one prompt) is n requests of the same prompt with seeds seed .. seed + n - 1:
the prefix cache gives the samples the prompt's blocks (it is prefilled once) and the engine's
decode steps read those shared blocks once for all samples (bifurcated attention). Every result
also carries each sequence's token log-probabilities under the model (log-softmax of the logits,
before temperature, top-k and top-p) and their mean, the pass@top-k ranking score of the
bifurcated-attention paper.

Stop: the model's end-of-sequence ids (unless ignore_eos), stop_token_ids, and stop strings
(`stop`, cut from the text: GenerationResult.texts) end a sequence, as for any engine request.
Speculative decoding (speculate="ngram" or "draft", one prompt) and static or CUDA-graph decode
steps (decode_step="static" or "graph") are the engine's (docs/engine.md).
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, replace

import torch
import torch.distributed as dist

from treeattn.cache.sharded import kv_bytes_per_token
from treeattn.cache.window import window_bytes_per_sequence
from treeattn.engine.checks import Checked, check_engine, with_device
from treeattn.engine.config import EngineConfig, given_or_built, kv_cache_dtype_name, resolve_kv_cache_dtype
from treeattn.models.packed import is_packed
from treeattn.ops.packed_linear import resolve_activation_format
from treeattn.engine.errors import ConfigError, ConfigTypeError
from treeattn.engine.request import MAX_SEED, SamplingParams
from treeattn.engine.config import resolve_prefill
from treeattn.models.attention import group_world_size
from treeattn.models.llama import LlamaModel
from treeattn.parallel.shared_memory import group_timeout_s

logger = logging.getLogger(__name__)

# Seconds a rank may wait for its peers in the engine's collectives when the group's own timeout
# cannot be read (a long prefill step on a slow peer must fit); timeout_s given to generate wins.
DEFAULT_TIMEOUT_S = 1800.0

RENAMED = {
    "capacity": "max_context",
    "chunk": "prefill_chunk",
    "static_decode": "decode_step='static'",
    "cuda_graph": "decode_step='graph'",
    "stop_tokens": "stop_token_ids (added to the model's eos ids; with ignore_eos=True only they stop)",
}
"""generate()'s keywords of earlier releases (GenerationConfig's fields) -> today's (the engine's
names); an old keyword raises a TypeError naming the new one."""

ENGINE_FIELDS = frozenset(f.name for f in fields(EngineConfig))
SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))


@dataclass
class StepOutput:
    """One new-token index: the new token of every sequence.

    Attributes:
        index: 0 for the first new token, 1 for the second, ...
        tokens: the new token id of each sequence (B ints; a finished sequence's entry repeats its
            last token and is to be ignored).
        finished: per sequence, whether it has stopped (stop token or this was its last token).
        elapsed_s: seconds since generation started (setup and prefill included), on rank 0.
        texts: per sequence, the text this token adds (the engine's TokenEvent.text: "" without a
            tokenizer; a tail that could begin a stop string is held back until it cannot, and the
            text ends right before a stop string), so the texts of all steps join to
            GenerationResult.texts. "" for a finished sequence's repeated entry.
    """

    index: int
    tokens: list[int]
    finished: list[bool]
    elapsed_s: float
    texts: list[str] = field(default_factory=list)


@dataclass
class GenerationResult:
    """What generate() returns, identical on every rank.

    Attributes:
        prompt_tokens: prompt length of each sequence.
        cached_prompt_tokens: per sequence, the prompt tokens whose keys/values came from the
            engine's prefix cache (computed for an earlier sequence of the batch: the n samples of
            one prompt, or repeated prompts, prefill the shared full blocks once).
        generated_ids: the new tokens of each sequence, up to and including its stop token (or the
            token that completed a stop string).
        texts: the text of each sequence's new tokens (the engine's detokenizing: stop tokens not
            shown, the text cut before a stop string); "" for every sequence when the model has no
            tokenizer.
        finish_reasons: per sequence, "stop" (a stop token or string) or "length" (max_new_tokens).
        prefill_s: seconds from the start to the first token of every sequence (engine setup,
            prefill, first sample).
        setup_s: the part of prefill_s spent building the engine (rank 0's Engine(...): the packed
            weights' arena, the kernels' warm-up, the KV arena) before the first request was submitted;
            0.0 when generate() ran on an open engine. prefill_s - setup_s is the time from the request
            to its first token, what llama.cpp's time to the first token measures (its load apart).
        decode_s: seconds of the decode steps after the first tokens (rank 0's step times).
        decode_steps: the engine's decode steps (a step is one batched forward pass of every
            running sequence's next token, or with speculation its token and drafts).
        step_times_s: wall time of each decode step on rank 0.
        world_size, decode, method, prefill, placement: how it ran.
        kv_bytes_per_rank: bytes of KV cache each rank holds (its block arena).
        kv_bytes_per_token: bytes of keys and values one more token takes in the layers the
            sequence-sharded cache holds (an MLA model's latent cache: one latent + RoPE key per
            layer; a hybrid model such as Gemma 3: its global layers only).
        kv_cache_dtype: what the KV cache stored ("float32", "bfloat16", "float16", "fp8_e4m3": kv_cache_dtype resolved).
        weight_bytes_per_rank: bytes of the weights each rank holds, in rank order (every rank all of them, or with
            tp its share): parameters, and the blocks and scales of weights kept packed (weight_format).
        weight_format: "packed" when some weight is kept in its file's blocks, else "dequantize".
        activation_format: how the packed weights multiplied the decode steps' activations: "float32" or "int8"
            (EngineConfig.activation_format resolved on this host); None without packed weights.
        prefill_dtype: what the packed weights multiplied the prefill chunks in: "float32" or "bfloat16"
            (EngineConfig.prefill_dtype); None without packed weights.
        tp: the Helix layout's tensor-parallel ranks (EngineConfig.tp; None: no tensor parallelism).
        kv_window_bytes: bytes a hybrid model's sliding-window layers keep per sequence on every
            rank (W - 1 positions of each; treeattn.cache.window); 0 for other models.
        comm_bytes_per_rank: bytes each rank sent during the decode steps (treeattn's accounting).
        prefill_comm_bytes_per_rank: bytes each rank sent during the prefill steps.
        peak_rss_bytes_per_rank: peak resident memory of each rank during the decode steps
            (Linux: the high-water mark is reset when decoding starts; elsewhere the process peak).
        start_rss_bytes_per_rank: resident memory of each rank when decoding started; the
            difference to the peak is what decoding itself added (attention buffers, K/V in flight).
        comm: rank 0's comm_stats of the decode steps, as a dict (bytes, messages, rounds, by op).
        token_logprobs: per sequence, the log-probability of each generated token under the model
            (log-softmax of the logits, before temperature, top-k and top-p).
        num_samples: n of shared-context sampling (1: one sequence per prompt). With n > 1 the
            sequences are the n samples of the one prompt.
        decode_step: "dynamic", "static" (fixed-shape steps, eager) or "graph" (replayed from CUDA
            graphs).
        speculation: {} without speculative decoding; else the request's counters (method,
            draft_tokens, drafted, accepted, acceptance_rate, decoded_tokens, decode_forwards,
            tokens_per_forward; draft_model with a draft model).
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
    kv_window_bytes: int = 0
    kv_cache_dtype: str = "float32"
    weight_bytes_per_rank: list[int] = field(default_factory=list)
    tp: int | None = None
    weight_format: str = "dequantize"
    activation_format: str | None = None
    prefill_dtype: str | None = None
    comm_bytes_per_rank: list[float] = field(default_factory=list)
    prefill_comm_bytes_per_rank: list[float] = field(default_factory=list)
    peak_rss_bytes_per_rank: list[int] = field(default_factory=list)
    start_rss_bytes_per_rank: list[int] = field(default_factory=list)
    comm: dict = field(default_factory=dict)
    token_logprobs: list[list[float]] = field(default_factory=list)
    num_samples: int = 1
    decode_step: str = "dynamic"
    speculation: dict = field(default_factory=dict)
    cached_prompt_tokens: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    setup_s: float = 0.0

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
        out.update(time_per_token_s=self.time_per_token_s, tokens_per_s=self.tokens_per_s,
                   comm_bytes_per_token=self.comm_bytes_per_token,
                   mean_logprobs=self.mean_logprobs, ranking=self.ranking())
        return out


def generate(model: "LlamaModel | str | os.PathLike", prompts, config: EngineConfig | None = None,
             sampling: SamplingParams | None = None, *, num_samples: int = 1, group: dist.ProcessGroup | None = None,
             on_token: Callable[[StepOutput], None] | None = None, on_prefill: Callable[[int, int], None] | None = None,
             **options) -> GenerationResult:
    """Generate continuations of `prompts` with the KV cache sharded across the ranks of `group`.

    Call on every rank of the group with the same arguments (checked: a mismatch raises on every
    rank). Every rank returns the same GenerationResult.

    Args:
        model: a LlamaModel (treeattn.load_model or random_model), the same weights on every rank;
            or a checkpoint directory or .gguf file, loaded here with treeattn.load_model.
        prompts: one prompt (a list of token ids) or a list of prompts (a batch); or chat messages
            ([{"role": "user", "content": ...}], or a batch of such lists), rendered with the
            model's chat template and tokenizer (set by treeattn.load_model); the template's
            end-of-turn token then also stops generation.
        config: the engine's EngineConfig (decode, method, prefill, placement, block_size,
            max_context, prefill_chunk, decode_step, speculate, draft_tokens, draft_model,
            shared_memory, ...); None: the defaults, or its fields as keywords (**options). nproc
            and max_batch_size are the group's size and the batch's (every sequence runs at once);
            max_context (None) becomes the longest prompt + max_new_tokens and cache_tokens (None)
            exactly that many slots per sequence (batch_config).
        sampling: a SamplingParams for every sequence (max_new_tokens, temperature, top_k, top_p,
            seed, stop_token_ids, stop, ignore_eos); None: the defaults, or its fields as keywords.
            Sequence i draws from seed + i.
        num_samples: n >= 1 completions of one prompt (n > 1: the prompt prefilled once, the
            samples decoding over its shared blocks).
        group: process group; None is the default group (or a single process without one).
        on_token: called with each StepOutput (on rank 0 as tokens come; on the other ranks after
            the last token, from the result).
        on_prefill: called on rank 0 as on_prefill(computed, prompt_tokens) after each engine step
            that advanced the prefill (chunked prefill: once per chunk), summed over the batch's
            sequences; computed includes prompt tokens found in the prefix cache. For progress displays.
        **options: fields of EngineConfig or SamplingParams by name (not together with the object
            they belong to). Earlier names (capacity, chunk, static_decode, cuda_graph,
            stop_tokens) raise a TypeError naming today's (RENAMED).

    Returns:
        GenerationResult.

    Raises:
        ValueError / TypeError: bad arguments (a ConfigError names the option), a prompt that does
            not fit, ranks that disagree -- before any prefill work.
        NonFiniteLogitsError: the model produced NaN or inf logits (on every rank; nothing
            non-finite becomes a token).

    Example (one process, a random-weight model)::

        >>> import treeattn as ta
        >>> from treeattn.models.llama import LlamaConfig, random_model
        >>> model = random_model(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
        ...                                  num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=128))
        >>> result = ta.generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=4, ignore_eos=True, block_size=16)
        >>> [len(ids) for ids in result.generated_ids], result.finish_reasons
        ([4, 4], ['length', 'length'])
    """
    run = stream(model, prompts, config, sampling, num_samples=num_samples, group=group, on_prefill=on_prefill, **options)
    for step in run:
        if on_token is not None:
            on_token(step)
    return run.result


def stream(model: "LlamaModel | str | os.PathLike", prompts, config: EngineConfig | None = None,
           sampling: SamplingParams | None = None, *, num_samples: int = 1, group: dist.ProcessGroup | None = None,
           on_prefill: Callable[[int, int], None] | None = None,
           **options) -> "Generation":
    """generate() as an iterator: `for step in stream(model, prompts, ...)` yields a StepOutput per
    new-token index; afterwards `.result` holds the GenerationResult. Same arguments as generate()
    (without on_token). Arguments are checked here, before any work.

    Example (as for generate)::

        >>> import treeattn as ta
        >>> from treeattn.models.llama import LlamaConfig, random_model
        >>> model = random_model(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
        ...                                  num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=128))
        >>> run = ta.stream(model, [1, 2, 3], max_new_tokens=3, ignore_eos=True, block_size=16)
        >>> [step.index for step in run], len(run.result.generated_ids[0])
        ([0, 1, 2], 3)
    """
    from treeattn.models.chat import encode_prompts, is_chat

    config, sampling = split_options(config, sampling, options)
    if isinstance(model, (str, os.PathLike)):  # a checkpoint directory or .gguf file, as ta.Engine takes: straight
        from treeattn.engine.device import rank_device, resolve_device, resolve_dtype  # onto this rank's device
        from treeattn.models.loader import load_model

        kind = resolve_device(config.device)
        rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
        model = load_model(model, dtype=resolve_dtype(config.dtype, kind), device=rank_device(kind, rank),
                           weight_format=config.weight_format)
    if is_chat(prompts):  # chat messages: rendered by the model's template; stop at its end of turn too
        prompts, end_of_turn = encode_prompts(model, prompts)
        if not sampling.ignore_eos:
            sampling = replace(sampling, stop_token_ids=tuple(dict.fromkeys((*sampling.stop_token_ids, *end_of_turn))))
    return Generation(model, prompts, config, sampling, num_samples=num_samples, group=group, on_prefill=on_prefill)


def split_options(config: EngineConfig | None, sampling: SamplingParams | None,
                  options: dict) -> tuple[EngineConfig, SamplingParams]:
    """generate()'s (EngineConfig, SamplingParams): the objects given, or made of the keyword
    `options` (each field goes to the class that has it; a field of a class whose object was given
    too is refused, as are unknown and renamed keywords)."""
    for name in options:
        if name in RENAMED:
            raise ConfigTypeError(name, f"{name} is no longer an option of generate(): use {RENAMED[name]}")
        if name not in ENGINE_FIELDS and name not in SAMPLING_FIELDS:
            raise ConfigTypeError(name, f"{name} is not an option of generate(): options are EngineConfig's and "
                                        "SamplingParams' fields")
    engine = {k: v for k, v in options.items() if k in ENGINE_FIELDS}
    sampled = {k: v for k, v in options.items() if k in SAMPLING_FIELDS}
    return given_or_built(EngineConfig, config, engine, "config"), given_or_built(SamplingParams, sampling, sampled, "sampling")


def check_prompts(prompts, vocab_size: int) -> list[list[int]]:
    """One prompt (ints) or a batch (lists of ints) -> list of non-empty lists of ids in [0, vocab_size)."""
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist()
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ConfigError("prompts",
                          f"prompts must be a non-empty list of token ids or of lists of token ids, got {prompts!r:.80}")
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


def batch_config(config: EngineConfig, sampling: SamplingParams, num_samples: int, prompts: list[list[int]],
                 world_size: int) -> EngineConfig:
    """The EngineConfig that runs this batch at once: nproc the group's size (decode "local" on one
    rank), max_batch_size every sequence (prompts x num_samples), max_context (when None) the longest
    prompt + max_new_tokens, and cache_tokens (when None) max_context slots for every sequence, dealt
    over the ranks in whole blocks (contiguous placement: one span of every sequence per rank).
    ConfigError naming num_samples unless it is an int >= 1."""
    if not _is_int(num_samples):
        raise ConfigTypeError("num_samples", f"num_samples must be an int, got {type(num_samples).__name__} ({num_samples!r})")
    if num_samples < 1:
        raise ConfigError("num_samples", f"num_samples must be >= 1, got {num_samples}")
    longest = max(len(prompt) for prompt in prompts)
    sequences = len(prompts) * num_samples
    max_context = config.max_context or longest + sampling.max_new_tokens
    span = -(-max_context // (config.block_size * world_size))
    return replace(config, nproc=world_size, decode=config.decode if world_size > 1 else "local", max_batch_size=sequences,
                   max_context=max_context, cache_tokens=config.cache_tokens or sequences * span * world_size * config.block_size)


def check_generation(config: EngineConfig, sampling: SamplingParams, num_samples: int, model_config,
                     prompts: list[list[int]]) -> None:
    """What generate() asks beyond any engine request, checked with the batch_config'd `config`:
    n samples of one prompt, speculation on one prompt and one sample, stop ids in the vocabulary,
    and every prompt + max_new_tokens within max_context. ConfigError naming the option."""
    if num_samples > 1 and len(prompts) != 1:
        raise ConfigError("num_samples",
                          f"num_samples={num_samples} samples completions of one prompt, got {len(prompts)} prompts")
    if config.speculate is not None and num_samples > 1:
        raise ConfigError("speculate",
                          f"speculate={config.speculate!r} decodes one sequence; num_samples={num_samples} asks for several")
    if config.speculate is not None and len(prompts) != 1:
        raise ConfigError("speculate", f"speculate={config.speculate!r} decodes one prompt at a time, got {len(prompts)} prompts")
    outside = [t for t in sampling.stop_token_ids if t >= model_config.vocab_size]
    if outside:
        raise ConfigError("stop_token_ids",
                          f"stop_token_ids: token id {outside[0]} is outside the vocabulary [0, {model_config.vocab_size})")
    outside = [t for t, _ in sampling.logit_bias if t >= model_config.vocab_size]
    if outside:
        raise ConfigError("logit_bias",
                          f"logit_bias: token id {outside[0]} is outside the vocabulary [0, {model_config.vocab_size})")
    longest = max(len(p) for p in prompts)
    needed = longest + sampling.max_new_tokens
    if needed > config.max_context:
        raise ConfigError("max_context", f"prompt of {longest} tokens + max_new_tokens={sampling.max_new_tokens} needs {needed} "
                          f"positions, more than max_context={config.max_context}")


class NonFiniteLogitsError(RuntimeError):
    """The model produced NaN or inf logits; raised on every rank, before any such token is used."""


class Generation:
    """One generation run (see generate). Iterate over it to run it; then read .result.

    Args:
        model, prompts, num_samples, group, on_prefill: as for generate().
        config, sampling: the EngineConfig and SamplingParams (None: the defaults; see split_options
            for keywords).
        engine: run on this Engine instead of starting one (rank 0's handle, is_driver; the other
            ranks serve it): only rank 0 makes the Generation, its sequences are the engine's
            requests, the engine stays open afterwards (a prompt asked again finds its prefix
            cached), and its config is the run's (config must be None). The measurements are reset
            when the run starts, so the result's counters are this run's alone.
    """

    def __init__(self, model: LlamaModel, prompts, config: EngineConfig | None = None, sampling: SamplingParams | None = None,
                 *, num_samples: int = 1, group: dist.ProcessGroup | None = None,
                 on_prefill: Callable[[int, int], None] | None = None, engine=None) -> None:
        self.model, self.group, self.on_prefill, self._engine = model, group, on_prefill, engine
        self.result: GenerationResult | None = None
        self._setup_s = 0.0  # rank 0's Engine(...) seconds (GenerationResult.setup_s)
        self.num_samples = num_samples
        if engine is not None:
            self._on_engine(engine, prompts, config, sampling)
            return
        self.world_size = group_world_size(group)  # raises if a group is given without torch.distributed
        self.rank = dist.get_rank(group) if self.world_size > 1 else 0
        local_error = prefill = given = None
        proof = config if isinstance(config, Checked) else None  # `treeattn generate`'s ranks: checked before they started
        try:
            given, sampling = split_options(config if proof is None else proof.config, sampling, {})
            config = given
            if proof is None and given.timeout_s == EngineConfig.timeout_s and self.world_size > 1:  # the group's own
                config = replace(config, timeout_s=group_timeout_s(group) or DEFAULT_TIMEOUT_S)
            if proof is not None and proof.vouches_for(model, config):
                self.prompts = [[int(t) for t in p] for p in prompts]  # checked with the proof
            else:
                proof = None
                self.prompts = check_prompts(prompts, model.config.vocab_size)
                config = batch_config(config, sampling, num_samples, self.prompts, self.world_size)
                check_generation(config, sampling, num_samples, model.config, self.prompts)
                config = with_device(model, config)  # "auto": the model's own device
                # the engine's own checks, in its order
                files = check_engine(model, config, group=group, joined=self.world_size > 1,
                                     cache_option="max_new_tokens" if given.max_context is None else "max_context")
                proof = Checked(config, model, files)
            if config.decode_step != "dynamic":  # needs the loaded model: checked here, also under a proof
                _check_static_step(config, model, config.max_batch_size)
            prefill = resolve_prefill(config.prefill, self.world_size if config.tp is None else 1,  # tp: every rank every token
                                      model.config.layer_windows)
        except (ValueError, TypeError) as exc:
            local_error = exc
        self._agree(given, sampling, local_error, prefill=prefill)  # what each rank was given: the sizing follows from it
        self.config, self.sampling, self.prefill, self.decode = config, sampling, prefill, config.decode
        self._proof = proof  # handed to the Engine this run starts: it does not check again
        if given.decode != "local" and self.world_size == 1:
            logger.info("no process group: decode=%r runs as plain attention on this one process", given.decode)
        self.num_sequences = config.max_batch_size

    def _on_engine(self, engine, prompts, config, sampling) -> None:
        """__init__ with a running engine: rank 0 alone, the engine's config, generate()'s checks of
        the batch against it (before any work)."""
        if not getattr(engine, "is_driver", False):
            raise ValueError("engine: expected the Engine handle of the driving rank (rank 0; is_driver), "
                             f"got {type(engine).__name__}")
        if config is not None:
            raise ValueError("config: a Generation on a running engine uses engine.config; got a config too")
        _, sampling = split_options(None, sampling, {})
        c = self.config = engine.config
        self.world_size, self.rank, self.sampling = c.nproc, 0, sampling
        self.prompts = check_prompts(prompts, self.model.config.vocab_size)
        check_generation(replace(c, max_context=engine.max_context), sampling, self.num_samples, self.model.config, self.prompts)
        if self.num_samples * len(self.prompts) > c.max_batch_size:
            raise ConfigError("num_samples", f"{self.num_samples * len(self.prompts)} sequences, but the engine runs "
                              f"max_batch_size={c.max_batch_size} at once")
        self.prefill, self.decode = resolve_prefill(c.prefill, c.nproc if c.tp is None else 1,
                                                    self.model.config.layer_windows), c.decode
        self.num_sequences = self.num_samples * len(self.prompts)

    def _agree(self, config, sampling, local_error, *, prefill) -> None:
        """Every rank checks that all ranks got the same prompts, options (`config` as given, before
        batch_config) and model (one all-gather), so that a rank with bad or different arguments
        fails every rank instead of hanging them."""
        if self.world_size == 1:
            if local_error is not None:
                raise local_error
            return
        from treeattn.parallel.metadata import UNKNOWN, gather_metadata

        names = ("prompts", *sorted(ENGINE_FIELDS), *sorted(SAMPLING_FIELDS), "num_samples", "resolved prefill", "model")
        if local_error is not None:
            values = dict.fromkeys(names, UNKNOWN)
        else:
            options = {f.name: getattr(c, f.name) for c in (config, sampling) for f in fields(c)}
            options["num_samples"] = self.num_samples
            values = {"prompts": _fingerprint(self.prompts)}
            values.update({name: _model_fingerprint(value) if isinstance(value, torch.nn.Module) else _fingerprint(value)
                           for name, value in options.items()})
            values.update({"resolved prefill": _fingerprint(prefill), "model": _model_fingerprint(self.model)})
        gather_metadata("generate", values, self.group, must_match=names, local_error=local_error)

    # ------------------------------------------------------------------------------ running

    def __iter__(self) -> Iterator[StepOutput]:
        if self.result is not None:
            raise RuntimeError("this Generation has already run; call generate()/stream() again")
        from treeattn.engine.client import Engine

        start = time.perf_counter()
        own = self._engine is None  # else a running engine, which stays open (rank 0 alone)
        if own:
            engine = Engine(self.model, self._proof, group=self.group)
            self._setup_s = time.perf_counter() - start
        else:
            engine = self._engine
            engine.rank_measurements(reset=True)  # this run's counters alone
        if not engine.is_driver:  # this rank served the steps until rank 0 closed the engine
            outcome = self._broadcast_outcome(None)
        else:
            steps: list[StepOutput] = []
            try:
                for step in self._drive(engine, start):
                    steps.append(step)
                    yield step
                outcome = ("ok", self._result(engine, steps, start), steps)
            except NonFiniteLogitsError as exc:
                outcome = ("non-finite", str(exc), steps)
            except BaseException as exc:
                if own:
                    engine.close()
                    self._broadcast_outcome(("error", f"{type(exc).__name__}: {exc}", steps))
                raise
            if own:
                engine.close()
                self._broadcast_outcome(outcome)
        kind, payload, steps = outcome
        if kind == "non-finite":
            raise NonFiniteLogitsError(payload)
        if kind == "error":
            raise RuntimeError(f"generate failed on rank 0: {payload}")
        if not engine.is_driver:
            yield from steps
        self.result = payload

    def _requests(self) -> list[tuple[list[int], SamplingParams]]:
        """(prompt, SamplingParams) of every sequence, in result order: sequence i draws from seed + i,
        and every token comes with its log-probability (logprobs at least 0)."""
        s = self.sampling
        prompts = self.prompts * self.num_samples
        return [(prompt, replace(s, seed=(s.seed + i) % MAX_SEED, logprobs=s.logprobs or 0)) for i, prompt in enumerate(prompts)]

    def _drive(self, engine, start: float) -> Iterator[StepOutput]:
        """Rank 0: submit every sequence, then yield a StepOutput each time every sequence that is
        still running has its next token."""
        events: queue.Queue = queue.Queue()
        handles = []
        requests = self._requests()
        prefilled = [0] * len(requests)  # per sequence, its prompt tokens in the cache (on_prefill)

        def on_prefill(i: int, computed: int, total: int) -> None:  # the engine's driver thread
            prefilled[i] = computed
            self.on_prefill(sum(prefilled), sum(len(prompt) for prompt, _ in requests))

        for i, (prompt, params) in enumerate(requests):
            handles.append(engine.submit(prompt, params, on_event=lambda event, i=i: events.put((i, event)),
                                         on_prefill=None if self.on_prefill is None else
                                         (lambda computed, total, i=i: on_prefill(i, computed, total))))
        tokens: list[list[int]] = [[] for _ in handles]
        texts: list[list[str]] = [[] for _ in handles]  # the text each token added (TokenEvent.text)
        ended = [False] * len(handles)
        index = 0
        try:
            while index < self.sampling.max_new_tokens and not all(
                ended[b] and len(tokens[b]) <= index for b in range(len(handles))
            ):
                b, event = events.get()
                if event.token_id is not None:
                    tokens[b].append(event.token_id)
                    texts[b].append(event.text)
                if event.finished:
                    ended[b] = True
                    if event.finish_reason == "error":
                        raise _request_error(self.model, event.error, b, len(tokens[b]))
                while all(len(t) > index or done for t, done in zip(tokens, ended)) and any(len(t) > index for t in tokens):
                    yield StepOutput(index, [t[min(index, len(t) - 1)] if t else 0 for t in tokens],
                                     [done and len(t) <= index + 1 for t, done in zip(tokens, ended)],
                                     time.perf_counter() - start, [t[index] if len(t) > index else "" for t in texts])
                    index += 1
        finally:
            for handle in handles:
                if not handle.done:
                    handle.cancel()
        self._results = [handle.result() for handle in handles]

    def _result(self, engine, steps: list[StepOutput], start: float) -> GenerationResult:
        """Rank 0: the GenerationResult from the requests' results and every rank's measurements."""
        results = self._results
        measured = engine.rank_measurements()
        first_token = next((s.elapsed_s for s in steps if s.index == 0), time.perf_counter() - start)
        step_times = measured[0].step_s["decode"]
        c = self.config
        return GenerationResult(
            prompt_tokens=[r.prompt_tokens for r in results], generated_ids=[r.token_ids for r in results],
            finish_reasons=[r.finish_reason for r in results], prefill_s=first_token, setup_s=self._setup_s,
            decode_s=sum(step_times),
            decode_steps=len(step_times), step_times_s=step_times, world_size=self.world_size, decode=self.decode,
            method=c.method, prefill=self.prefill, placement=c.placement, tp=c.tp,
            kv_bytes_per_rank=[m.kv_bytes for m in measured],
            kv_bytes_per_token=kv_bytes_per_token(self.model.config, resolve_kv_cache_dtype(c.kv_cache_dtype, self.model.dtype)),
            kv_window_bytes=window_bytes_per_sequence(self.model.config, resolve_kv_cache_dtype(c.kv_cache_dtype,
                                                                                                self.model.dtype),
                                                      self.model.dtype),
            kv_cache_dtype=kv_cache_dtype_name(resolve_kv_cache_dtype(c.kv_cache_dtype, self.model.dtype)),
            weight_bytes_per_rank=[m.weight_bytes for m in measured],
                                weight_format="packed" if is_packed(self.model) else "dequantize",
            activation_format=resolve_activation_format(c.activation_format) if is_packed(self.model) else None,
            prefill_dtype=c.prefill_dtype if is_packed(self.model) else None,
            comm_bytes_per_rank=[m.bytes_sent("decode") for m in measured],
            prefill_comm_bytes_per_rank=[m.bytes_sent("prefill") for m in measured],
            peak_rss_bytes_per_rank=[m.peak_rss_bytes.get("decode", 0) for m in measured],
            start_rss_bytes_per_rank=[m.start_rss_bytes.get("decode", 0) for m in measured],
            comm=measured[0].comm["decode"], token_logprobs=[[lp.logprob for lp in r.logprobs] for r in results],
            num_samples=self.num_samples, decode_step=c.decode_step,
            speculation=results[0].speculation if c.speculate else {},
            cached_prompt_tokens=[r.cached_prompt_tokens for r in results], texts=[r.text for r in results],
        )

    def _broadcast_outcome(self, outcome):
        """Rank 0's (kind, payload, steps) on every rank of the group."""
        if self.world_size == 1:
            return outcome
        box = [outcome]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0) if self.group is not None else 0,
                                   group=self.group)
        return box[0]


def _request_error(model, message: str | None, sequence: int, index: int) -> Exception:
    """The error of a request the engine failed: non-finite logits (with what may have caused
    them), or anything else."""
    if not (message and "not finite" in message):
        return RuntimeError(f"sequence {sequence} failed in the engine: {message}")
    weights = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if weights:
        cause = (
            f"Non-finite weights: {', '.join(weights[:3])}" + (f" and {len(weights) - 3} more" if len(weights) > 3 else "") + "."
        )
    elif model.dtype != torch.float32:
        cause = f"The weights are finite: an overflow in {str(model.dtype).removeprefix('torch.')}? Try float32."
    else:
        cause = "The weights are finite."
    return NonFiniteLogitsError(f"the model produced non-finite logits (NaN or inf) for sequence(s) [{sequence}] at new token "
                                f"{index}; generation stopped. {cause}")


def _check_static_step(config: EngineConfig, model, batch: int) -> None:
    """decode_step "static" / "graph" on a model the engine's static step cannot run: ConfigError naming decode_step."""
    from treeattn.engine.worker.static_step import graph_safe_reason

    reason = graph_safe_reason(model, batch)
    if reason is not None:
        raise ConfigError("decode_step", f"decode_step={config.decode_step!r} cannot run this model on {model.device}: {reason}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fingerprint(value) -> int:
    """A stable int64 digest of a JSON-able value (for the cross-rank agreement check)."""
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _model_fingerprint(model) -> int:
    """A digest of a model's shape, dtype and a few weights (the same checkpoint on every rank)."""
    probe = [model.norm.weight.float().sum().item()]
    if getattr(model, "helix_cuts", None) is None:  # a rank's share of a table (tensor parallelism) differs per rank
        rows = model.embed_tokens(torch.arange(2, device=model.device))  # an nn.Embedding or a packed table alike
        probe.append(rows.float().sum().item())
    c = model.config
    return _fingerprint([c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, str(model.dtype),
                         probe])
