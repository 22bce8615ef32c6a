"""ta.Engine: many requests at once over a KV cache sharded across ranks.

    with ta.Engine(model, nproc=4, decode="tree", max_batch_size=16, prefix_cache=True, block_size=256) as engine:
        results = engine.generate(prompts, max_new_tokens=64)          # list of RequestResult
        for event in engine.stream(prompt, max_new_tokens=64): ...     # TokenEvent as they come
        handle = engine.submit(prompt, SamplingParams(...))            # thread-safe; handle.cancel()

Processes. The Engine object is the driver: it lives in the caller's process and owns the
scheduler (treeattn.engine.scheduler), the block pools and the prefix cache. It starts `nproc`
rank processes with ta.spawn; each builds the model and its share of the cache
(treeattn.engine.runner). Every step the driver sends the step's plan to rank 0, rank 0
broadcasts it to the group, every rank runs the same batched forward pass (tree_decode across
the ranks in every attention layer), and rank 0 answers with the sampled tokens. The driver runs
in one background thread; submit() and cancel() only queue a message for it, so they are safe
from any thread, and events are delivered from that thread (on_event) or through the handle.

Speculative decoding: the scheduler appends up to draft_tokens drafts to each decoding sequence's
chunk, rank 0 answers with the accepted drafts and the next token, and the driver emits one
TokenEvent per committed token (docs/engine.md). speculate="ngram" drafts by prompt lookup on the
driver; speculate="draft" reserves the drafts' slots and every rank runs a draft model over its own
cache of the same blocks, filling them in before the verification (treeattn.engine.draft).

Inside an existing process group (torchrun, or a function run by ta.spawn) nothing is started:
the Engine joins the group. On group rank 0 it is the driver and runs rank 0's share itself; on
the other ranks the constructor serves steps until the driver closes, then returns an engine
with is_driver False.

Failures: a request that can never fit, or bad input, fails alone (see submit); an error on any
rank (a rank that dies, a collective that times out after timeout_s) fails every pending request
with finish_reason "error", sets healthy False, and makes later calls raise; close() then leaves
no rank process behind.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.connection import Client, Listener
from pathlib import Path

import torch
import torch.distributed as dist

from treeattn.cache.blocks import ShardedBlockPool
from treeattn.cache.placement import PLACEMENTS
from treeattn.cache.prefix import PrefixCache
from treeattn.cache.sharded import kv_bytes_per_token
from treeattn.cache.window import hybrid_windows
from treeattn.engine.config import (DEFAULT_METHOD, ConfigError, check_draft_model_option, device_memory_bytes, format_bytes,
                                   model_bytes, resolve_method)
from treeattn.engine.measure import RankMeasurements
from treeattn.engine.ring_prefill import PREFILL_KINDS, idle_prefill_chunk
from treeattn.engine.request import RequestResult, SamplingParams, TokenEvent, TokenLogprob
from treeattn.engine.runner import RankRunner, StepOutcome
from treeattn.engine.scheduler import Scheduler, Sequence as _Seq
from treeattn.engine.static_step import DECODE_STEPS
from treeattn.models.attention import DECODE_KINDS
from treeattn.parallel.tree_decode import METHODS
from treeattn.speculate import MAX_DRAFT_TOKENS, NgramDrafter

logger = logging.getLogger(__name__)


ENGINE_SPECULATE_KINDS = ("ngram", "draft")
"""Speculative decoding the engine runs: "ngram", prompt lookup (treeattn.speculate.NgramDrafter), and
"draft", a draft model on every rank (treeattn.engine.draft)."""


class EngineError(RuntimeError):
    """The engine cannot go on (a rank died or failed); every pending request has failed."""


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
        dtype: model dtype (None: the checkpoint's float32, or the given model's).
        timeout_s: the group's timeout for every collective, and how long the driver waits for
            the ranks to start.
        threads_per_rank: torch threads of each rank process (default cpu_count // nproc).
        speculate: None, "ngram" or "draft": speculative decoding. Every decode step drafts up to
            `draft_tokens` tokens per sequence, verifies them in the same batched forward pass, and
            keeps the accepted ones and the token after them: exactly the tokens decoding without
            speculation gives, greedy or sampled with the same seed. "ngram" drafts by prompt lookup
            from the sequence's own prompt and output (treeattn.speculate.NgramDrafter); "draft"
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
        if self.dtype is not None and (not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating torch.dtype or None, got {self.dtype!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be a number of seconds > 0, got {self.timeout_s!r}")
        if self.speculate is not None and self.speculate not in ENGINE_SPECULATE_KINDS:
            raise ValueError(f"speculate must be None or one of {ENGINE_SPECULATE_KINDS}, got {self.speculate!r}")
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
class ModelInfo:
    """What the driver needs to know of the model (rank 0 reports it)."""

    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]


class RequestHandle:
    """A submitted request: iterate for its TokenEvents, result() for its RequestResult."""

    def __init__(self, engine: "Engine", request_id: str, on_event: Callable[[TokenEvent], None] | None) -> None:
        self.request_id = request_id
        self._engine = engine
        self._on_event = on_event
        self._events: queue.Queue[TokenEvent] = queue.Queue()
        self._done = threading.Event()
        self._result: RequestResult | None = None
        self._callback_error: str | None = None  # set when on_event raised a BaseException (see _emit)

    def cancel(self) -> None:
        """Stop the request (its blocks are freed); it finishes with finish_reason "cancelled"."""
        self._engine._post(("cancel", self.request_id))

    def result(self, timeout: float | None = None) -> RequestResult:
        """Wait for the request to end; TimeoutError after `timeout` seconds."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        return self._result

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            event = self._events.get()
            yield event
            if event.finished:
                return

    def _emit(self, event: TokenEvent, result: RequestResult | None = None) -> None:
        """Deliver an event (and with the last one the result). A callback that raises an Exception
        is logged and the request goes on; one that raises SystemExit, KeyboardInterrupt or another
        BaseException is not called again, and the driver fails this request alone
        (_callback_error). Neither stops the engine."""
        if result is not None:
            self._result = result
        self._events.put(event)
        try:
            if self._on_event is not None:
                self._on_event(event)
        except Exception:  # a consumer's bug must not stop the engine
            logger.exception("on_event callback of request %s raised", self.request_id)
        except BaseException as exc:  # noqa: BLE001 -- nor may its SystemExit or KeyboardInterrupt
            logger.error("on_event callback of request %s raised %s: failing the request", self.request_id, type(exc).__name__)
            self._on_event = None
            self._callback_error = f"the on_event callback raised {type(exc).__name__}: {exc}"
        finally:
            if result is not None:
                self._done.set()


class _Request:
    """The driver's record of one request: its handle, sequence, text and timings."""

    def __init__(self, handle: RequestHandle, prompt: list[int], params: SamplingParams, submitted: float) -> None:
        self.handle, self.prompt, self.params, self.submitted = handle, prompt, params, submitted
        self.seq: _Seq | None = None
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []  # one per token when params.logprobs is set
        self.text = ""  # the text delivered so far (the events' deltas); a held-back tail is not in it
        self.first_token_at: float | None = None


class Engine:
    """The serving core (see the module docstring).

    Args:
        model: a LlamaModel, or a checkpoint directory or .gguf file (loaded on every rank with
            ta.load_model).
        config: an EngineConfig; or leave it None and give its fields as keywords (**options:
            nproc, decode, method, placement, max_batch_size, cache_tokens, prefix_cache,
            block_size, prefill_chunk, dtype, timeout_s, threads_per_rank, speculate,
            draft_tokens, draft_model, shared_memory, decode_step, prefill, max_context; see
            EngineConfig). Inside an
            existing process group nproc is the group's size.
        group: inside an existing process group only: the ranks that share the cache (None:
            the world); its rank 0 is the driver.
    """

    def __init__(self, model, config: EngineConfig | None = None, *, group: dist.ProcessGroup | None = None,
                 **options) -> None:
        if config is None:
            config = EngineConfig(**options)
        elif options:
            raise ValueError(f"give either config or its fields as keywords, not both (got {sorted(options)})")
        elif not isinstance(config, EngineConfig):
            raise ValueError(f"config must be an EngineConfig, got {type(config).__name__}")
        if dist.is_available() and not dist.is_initialized() and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend="gloo", timeout=timedelta(seconds=config.timeout_s))  # under torchrun: join its group
        joined = dist.is_available() and dist.is_initialized()
        if group is not None and not joined:
            raise ValueError("group was given but torch.distributed is not initialized")
        if joined:
            if group is not None and dist.get_rank(group) < 0:
                raise ValueError("this process is not a member of `group`")
            config = replace(config, nproc=dist.get_world_size(group))
        self.config = config
        if self.config.nproc > 1 and self.config.decode == "local":
            raise ValueError(f"decode='local' runs on one rank, but nproc={self.config.nproc}; use 'tree' or 'ring'")
        _check_model(model)
        _check_decode_step_device(model, self.config, group if joined else None, joined)
        files = _model_files(model)
        if self.config.draft_model is not None:
            _check_draft_model(files, self.config)
        _check_memory(model, files.config, self.config)
        self.config.max_context_tokens(files.config.max_position_embeddings)  # raises before any rank starts
        self.tokenizer = getattr(files, "tokenizer", None)
        self.healthy = False
        self.is_driver = True
        self._inbox: queue.Queue = queue.Queue()
        self._requests: dict[str, _Request] = {}  # by request id, until finished
        self._by_seq: dict[int, _Request] = {}  # the same, by scheduler sequence id
        self._ids = itertools.count()
        self._closed = False
        self._failure: str | None = None
        self._last_contact = time.monotonic()  # of the driver with the ranks (see KEEPALIVE)
        self._counters = {"prompt_tokens": 0, "generated_tokens": 0, "shared_prefix_keys": 0}
        self._lock = threading.Lock()
        if joined or self.config.nproc == 1:  # one rank needs no process of its own: it runs in the driver thread
            self._channel = _GroupChannel(model, self.config, group if joined else None)
            if joined and dist.get_rank(group) != 0:
                self.is_driver = False
                self._channel.serve()
                return
        else:
            self._channel = _SpawnedRanks(model, self.config)
        info = self._channel.info
        self.model_info = info
        blocks_per_rank = self.config.blocks_per_rank(info.max_position_embeddings)
        self.pool = ShardedBlockPool(world_size=self.config.nproc, blocks_per_rank=blocks_per_rank,
                                     block_size=self.config.block_size, placement=self.config.placement,
                                     span_blocks=self.config.span_blocks(info.max_position_embeddings))
        # A hybrid model's window layers keep no state for a cached prefix (treeattn.cache.window):
        # its prefix cache is off.
        hybrid = bool(hybrid_windows(tuple(files.config.layer_windows)))
        self.prefix_cache = PrefixCache(self.pool) if self.config.prefix_cache and not hybrid else None
        self.scheduler = Scheduler(self.pool, max_batch_size=self.config.max_batch_size,
                                   prefill_chunk=self.config.prefill_chunk, prefix_cache=self.prefix_cache,
                                   drafter=_drafter(self.config.speculate), draft_tokens=self.config.draft_tokens,
                                   draft_cache=self.config.speculate == "draft",
                                   idle_prefill_chunk=idle_prefill_chunk(self.config.prefill, self.config.nproc, files.config.layer_windows))
        self.max_context = self.config.max_context_tokens(info.max_position_embeddings)
        if self.max_context > info.max_position_embeddings:
            logger.warning("max_context=%d exceeds the model's max_position_embeddings=%d: positions beyond it run "
                           "(the model was not trained there)", self.max_context, info.max_position_embeddings)
        self.healthy = True
        self._update_stats()
        self._driver = threading.Thread(target=self._drive, name="treeattn-engine-driver", daemon=True)
        self._driver.start()

    # ------------------------------------------------------------------------------ public

    def submit(self, prompt, params: SamplingParams | None = None, *, on_event: Callable[[TokenEvent], None] | None = None,
               request_id: str | None = None) -> RequestHandle:
        """Queue one request; returns at once. Thread-safe.

        Args:
            prompt: a string (needs a tokenizer) or a list of token ids.
            params: SamplingParams (default: greedy, 64 new tokens).
            on_event: called with each TokenEvent from the engine's driver thread.
            request_id: a name for it (default: a fresh "req-N").

        Raises:
            ValueError: invalid params, an empty prompt, token ids outside the vocabulary, a
                string without a tokenizer. A prompt that can never fit (prompt + max_new_tokens >
                engine.max_context) is not raised: the request finishes with finish_reason
                "error" and a message naming the limit.
            EngineError: the engine has failed or is closed.
        """
        self._require_driver()
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        ids = self._prompt_ids(prompt)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none (use stop_token_ids)")
        if self._failure is not None or self._closed:
            raise EngineError(self._failure or "the engine is closed")
        request_id = request_id or f"req-{next(self._ids)}"
        handle = RequestHandle(self, request_id, on_event)
        self._post(("submit", _Request(handle, ids, params, time.perf_counter())))
        return handle

    def generate(self, prompts, params: SamplingParams | None = None, **sampling) -> list[RequestResult]:
        """Run a list of prompts (strings or token-id lists) together; their results in order.
        A single prompt (a string or one list of ints) gives a list of one result. `params`, or
        SamplingParams' fields as keywords (max_new_tokens=64, temperature=0.0, top_p, top_k, seed,
        stop, stop_token_ids, ignore_eos, logprobs), apply to every prompt."""
        params = _sampling_params(params, sampling)
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and all(_is_id(t) for t in prompts)):
            prompts = [prompts]
        handles = []
        try:
            for p in prompts:
                handles.append(self.submit(p, params))
            results = [h.result() for h in handles]
        except BaseException:  # Ctrl-C (KeyboardInterrupt) or a bad prompt: cancel what was submitted
            for h in handles:
                h.cancel()
            raise
        if self._failure is not None:
            raise EngineError(self._failure)
        return results

    def stream(self, prompt, params: SamplingParams | None = None, **sampling) -> Iterator[TokenEvent]:
        """One prompt's TokenEvents as they come (the last one has finished=True). Leaving the loop
        early cancels the request. `params` or its fields as keywords, as for generate()."""
        params = _sampling_params(params, sampling)
        handle = self.submit(prompt, params)
        finished = False
        try:
            for event in handle:
                finished = event.finished
                yield event
        finally:
            if not finished:
                handle.cancel()

    def stats(self) -> dict:
        """blocks_total, blocks_used, blocks_free, blocks_cached, running, waiting,
        prefix_hit_tokens, preemptions, prompt_tokens, generated_tokens, healthy (a consistent snapshot),
        and decoding's counters: decode_forwards (decoding chunks run, one per sequence per step),
        tokens_per_forward (tokens they committed, per chunk: 1 without speculation), and with
        speculative decoding drafted_tokens, accepted_tokens and acceptance_rate (NaN before any draft);
        shared_prefix_keys: key reads per layer that decode steps saved by reading blocks several
        sequences share once for all of them ((sequences - 1) x keys per shared segment, summed over
        steps; treeattn.engine.shared_prefix)."""
        self._require_driver()
        with self._lock:
            out = dict(self._stats)
        out["healthy"] = self.healthy
        return out

    def rank_measurements(self, reset: bool = False) -> list[RankMeasurements]:
        """Every rank's RankMeasurements (treeattn.engine.measure), in rank order: steps run, bytes
        communicated by prefill and decode steps, KV cache bytes, resident memory and its peak, since
        the last reset. reset=True starts the counters (and the peak) anew after reading them;
        e.g. call it with reset=True, run requests, call it again. Waits for the driver's current
        step to end. Raises EngineError when the engine has failed or is closed."""
        self._require_driver()
        if self._failure is not None or self._closed:
            raise EngineError(self._failure or "the engine is closed")
        box: list = []
        done = threading.Event()
        self._post(("measure", (reset, box, done)))
        self._wait_for_driver(done)
        if not box:
            raise EngineError(self._failure or "the engine closed before the ranks were measured")
        return box[0]

    def clear_prefix_cache(self) -> None:
        """Evict every cached block no running request uses (waits for the driver to do it).
        Raises EngineError when the engine has failed or is closed (or fails meanwhile)."""
        self._require_driver()
        if self._failure is not None or self._closed:
            raise EngineError(self._failure or "the engine is closed")
        done = threading.Event()
        self._post(("clear", done))
        self._wait_for_driver(done)
        if self._failure is not None:
            raise EngineError(self._failure)

    def _wait_for_driver(self, done: threading.Event) -> None:
        """Wait for the driver to set `done`; EngineError if the driver thread ends first (a message
        posted after it drained its inbox for the last time would never be answered)."""
        while not done.wait(0.5):
            if not self._driver.is_alive() and not done.is_set():
                raise EngineError(self._failure or "the engine is closed")

    def close(self) -> None:
        """Cancel what is still pending, stop the ranks and wait for them to exit."""
        if not self.is_driver or self._closed:
            return
        self._closed = True
        self._post(("close", None))
        self._driver.join()
        self._channel.close()
        self.healthy = False

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if getattr(self, "_driver", None) is not None and not self._closed:
                self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------------------ driver

    def _post(self, message) -> None:
        self._inbox.put(message)

    def _drive(self) -> None:
        """The driver thread: take messages, plan a step, run it on the ranks, deliver events."""
        self._update_stats()
        try:
            while True:
                block = not self.scheduler.has_work
                if not self._take_messages(block):
                    break
                if not self.scheduler.has_work:
                    self._update_stats()  # a cancel or a refused request changed the counts
                    continue
                plan = self.scheduler.schedule()
                if not plan.chunks:
                    self._fail_stuck_head()
                    continue
                outcome = self._channel.run(plan)
                self._counters["shared_prefix_keys"] += outcome.shared_prefix_keys
                self._last_contact = time.monotonic()
                now = time.perf_counter()
                committed: dict[int, int] = {}  # seq_id -> tokens committed so far in this step
                for seq, token, reason in self.scheduler.complete(plan, outcome.tokens):  # one per committed token
                    index = committed[seq.seq_id] = committed.get(seq.seq_id, -1) + 1
                    logprob = outcome.logprobs[seq.seq_id][index] if seq.seq_id in outcome.logprobs else None
                    request = self._by_seq.get(seq.seq_id)
                    if request is not None:  # None: a stop string ended it earlier in this run of tokens
                        try:
                            self._on_token(request, token, reason, now, logprob)
                        except Exception as exc:  # noqa: BLE001 -- this request's alone (its text, its callback)
                            self._fail_request(request, exc)
                self._update_stats()
        except BaseException as exc:  # noqa: BLE001 -- every failure must reach the requests
            self._failure = f"engine failed: {type(exc).__name__}: {exc}"
            logger.error("%s\n%s", self._failure, traceback.format_exc())
            self.healthy = False
        finally:
            reason = self._failure or "the engine was closed"
            while not self._inbox.empty():  # submissions that raced with the end
                kind, payload = self._inbox.get()
                if kind == "submit":
                    self._requests[payload.handle.request_id] = payload
                elif kind == "clear":
                    payload.set()
                elif kind == "measure":
                    payload[2].set()
            for request in list(self._requests.values()):
                self._finish(request, "error" if self._failure else "cancelled", time.perf_counter(),
                             error=reason if self._failure else None)
            self._update_stats()

    def _take_messages(self, block: bool) -> bool:
        """Handle queued submissions, cancels and commands; False when closing."""
        while True:
            try:
                kind, payload = self._inbox.get(block=block, timeout=0.2 if block else None)
            except queue.Empty:
                if block and not self._channel.alive():  # idle, and the ranks are gone
                    raise EngineError("the engine's rank processes ended")
                if block:
                    if time.monotonic() - self._last_contact > self.config.timeout_s / 4:
                        self._channel.run(KEEPALIVE)  # idle ranks wait in a collective: keep it short of the timeout
                        self._last_contact = time.monotonic()
                    continue
                return True
            block = False
            if kind == "close":
                return False
            if kind == "submit":
                try:
                    self._start(payload)
                except Exception as exc:  # noqa: BLE001 -- this request's alone
                    self._fail_request(payload, exc)
            elif kind == "cancel":
                request = self._requests.get(payload)
                if request is not None:
                    self._finish(request, "cancelled", time.perf_counter())
            elif kind == "measure":
                reset, box, done = payload
                try:
                    box.append(self._channel.run(_Measure(reset)))
                finally:
                    done.set()
            elif kind == "clear":
                if self.prefix_cache is not None:
                    self.prefix_cache.clear()
                self._update_stats()
                payload.set()

    def _start(self, request: _Request) -> None:
        self._requests[request.handle.request_id] = request
        need = len(request.prompt) + request.params.max_new_tokens
        if need > self.max_context:
            limit = ("max_context is" if self.max_context == self.config.max_context
                     else "the KV cache holds" if self.max_context == self.pool.max_tokens_per_sequence
                     else "the model's max_position_embeddings is")
            self._finish(request, "error", time.perf_counter(), error=(
                f"prompt of {len(request.prompt)} tokens + max_new_tokens={request.params.max_new_tokens} needs {need} "
                f"positions, but {limit} {self.max_context} (engine.max_context)"))
            return
        stop_ids = set(request.params.stop_token_ids)
        if not request.params.ignore_eos:
            stop_ids |= set(self.model_info.eos_token_ids)
        request.seq = self.scheduler.add(request.prompt, request.params, frozenset(stop_ids))
        self._by_seq[request.seq.seq_id] = request
        self._counters["prompt_tokens"] += len(request.prompt)

    def _on_token(self, request: _Request, token: int | None, reason: str | None, now: float,
                  logprob: TokenLogprob | None = None) -> None:
        if token is None:
            self._finish(request, "error", now, error=(
                "the model's logits for this request were not finite (NaN or inf); no token was produced"))
            return
        if request.first_token_at is None:
            request.first_token_at = now
        request.token_ids.append(token)
        if logprob is not None:
            request.logprobs.append(logprob)
        self._counters["generated_tokens"] += 1
        text, stopped = self._text(request)
        if stopped:  # a stop string ends it, even on its last token
            if reason is None:
                self.scheduler.finish(request.seq, "stop")
            reason = "stop"
        if reason is None:
            held = _held_back(text, request.params.stop)  # could begin a stop string: not delivered yet
            text = text[: len(text) - held]
        delta = text[len(request.text):] if len(text) > len(request.text) else ""
        request.text = request.text + delta
        if reason is None:
            request.handle._emit(TokenEvent(request.handle.request_id, token, delta, logprob=logprob))
            if request.handle._callback_error is not None:
                self._finish(request, "error", now, error=request.handle._callback_error)
        else:
            self._finish(request, reason, now, token=token, delta=delta, logprob=logprob)

    def _text(self, request: _Request) -> tuple[str, bool]:
        """(the request's text so far, whether a stop string ended it): the decoded tokens without
        an incomplete multi-byte character at the end, cut right before the first occurrence of any
        stop string (stopped)."""
        if self.tokenizer is None:
            return "", False
        text = self.tokenizer.decode(request.token_ids)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
            text = text.rstrip("\ufffd")
        cut = min((i for i in (text.find(s) for s in request.params.stop) if i >= 0), default=-1)
        return (text[:cut], True) if cut >= 0 else (text, False)

    def _finish(self, request: _Request, reason: str, now: float, *, token: int | None = None, delta: str = "",
                error: str | None = None, logprob: TokenLogprob | None = None) -> None:
        """End a request: free its sequence (if the scheduler still has it) and deliver the result."""
        self._requests.pop(request.handle.request_id, None)
        seq = request.seq
        if seq is not None:
            self._by_seq.pop(seq.seq_id, None)
        if seq is not None and seq.finish_reason is None:
            self.scheduler.finish(seq, reason)
        first = request.first_token_at
        result = RequestResult(
            request_id=request.handle.request_id, token_ids=list(request.token_ids), text=request.text,
            finish_reason=reason, prompt_tokens=len(request.prompt),
            cached_prompt_tokens=(seq.cached_prompt_tokens or 0) if seq is not None else 0,
            ttft_s=(first - request.submitted) if first is not None else float("nan"),
            decode_s=(now - first) if first is not None else 0.0, error=error,
            speculation=self._speculation(seq) if seq is not None and self.config.speculate else {},
            logprobs=list(request.logprobs) if request.params.logprobs is not None else None)
        event = TokenEvent(request.handle.request_id, token, delta, finished=True, finish_reason=reason, error=error,
                           logprob=logprob)
        request.handle._emit(event, result)

    def _fail_request(self, request: _Request, exc: Exception) -> None:
        """An exception while the driver served one request (not a step on the ranks): that
        request finishes with "error", the engine goes on."""
        logger.error("request %s failed: %s: %s", request.handle.request_id, type(exc).__name__, exc, exc_info=exc)
        if request.handle.done:
            return
        self._finish(request, "error", time.perf_counter(), error=f"serving this request failed: {type(exc).__name__}: {exc}")

    def _speculation(self, seq: _Seq) -> dict:
        """A request's speculative decoding, as GenerationResult.speculation reports it."""
        out = {"method": self.config.speculate, "draft_tokens": self.config.draft_tokens, "drafted": seq.drafted,
               "accepted": seq.accepted, "acceptance_rate": seq.accepted / seq.drafted if seq.drafted else float("nan"),
               "decoded_tokens": seq.decode_tokens, "decode_forwards": seq.decode_forwards,
               "tokens_per_forward": seq.decode_tokens / seq.decode_forwards if seq.decode_forwards else float("nan")}
        if self.config.draft_model is not None:
            from treeattn.draft_model import describe

            out["draft_model"] = describe(self.config.draft_model)
        return out

    def _fail_stuck_head(self) -> None:
        """Nothing could run although requests wait: fail the head (cannot happen for requests
        that fit alone; kept so that the driver can never spin)."""
        seq = self.scheduler.waiting[0]
        request = self._by_seq[seq.seq_id]
        self._finish(request, "error", time.perf_counter(), error=(
            f"no room in the KV cache for this request ({len(request.prompt)} prompt tokens; "
            f"{self.pool.num_free} of {self.pool.num_blocks} blocks free)"))

    def _update_stats(self) -> None:
        stats = self.scheduler.stats()
        stats.update(self._counters)
        with self._lock:
            self._stats = stats

    def _require_driver(self) -> None:
        if not self.is_driver:
            raise EngineError("this process is a serving rank of the engine's group, not its driver (group rank 0)")

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is a string but the engine has no tokenizer; pass token ids")
            prompt = self.tokenizer.encode(prompt).ids
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)) or len(prompt) == 0:
            raise ValueError(f"prompt must be a non-empty string or list of token ids, got {prompt!r:.80}")
        vocab = self.model_info.vocab_size
        for t in prompt:
            if not _is_id(t) or not 0 <= t < vocab:
                raise ValueError(f"prompt: token ids must be ints in [0, {vocab}), got {t!r}")
        return list(prompt)


# ---------------------------------------------------------------------------------- the ranks


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could be the beginning of a stop string (the
    longest such suffix): they are delivered only once no stop string can start there (vLLM's
    rule), so that no delivered text is ever taken back."""
    held = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:k]):
                held = k
                break
    return held


def _sampling_params(params: SamplingParams | None, fields: dict) -> SamplingParams:
    """`params`, or a SamplingParams of the keyword `fields` (not both)."""
    if params is None:
        return SamplingParams(**fields)
    if fields:
        raise TypeError(f"give params or SamplingParams' fields as keywords, not both (got {sorted(fields)})")
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    return params


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _check_model(model) -> None:
    from treeattn.models.deepseek import DeepseekModel
    from treeattn.models.llama import LlamaModel

    if isinstance(model, (LlamaModel, DeepseekModel)):
        return
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be a LlamaModel, a DeepseekModel or a checkpoint path, got {type(model).__name__}")
    if not Path(model).exists():
        raise ValueError(f"model: no such file or directory: {model}")


def _drafter(speculate: str | None):
    """The scheduler's drafter for EngineConfig.speculate."""
    if speculate == "ngram":
        return NgramDrafter()
    if speculate == "draft":
        from treeattn.engine.draft import DraftSlots

        return DraftSlots()
    return None


def _model_files(model):
    """What the checks need of the model (.config, .tokenizer): a loaded model itself, or its
    checkpoint's config and tokenizer, read without the weights."""
    if isinstance(model, (str, os.PathLike)):
        from treeattn.models.loader import read_model_files

        return read_model_files(model)
    return model


def _check_decode_step_device(model, config: EngineConfig, group, joined: bool) -> None:
    """decode_step="graph" needs the model on a CUDA device (a checkpoint path is loaded on the CPU),
    and on several ranks an NCCL group (gloo's collectives cannot be captured); ConfigError naming
    decode_step."""
    if config.decode_step != "graph":
        return
    device = torch.device("cpu") if isinstance(model, (str, os.PathLike)) else model.device
    if device.type != "cuda":
        raise ConfigError("decode_step", f"decode_step='graph' records CUDA graphs: the model must be on a CUDA device, got "
                          f"{device} (decode_step='static' runs the same steps without graphs)")
    backend = dist.get_backend(group) if joined else "gloo"
    if config.nproc > 1 and backend != "nccl":
        raise ConfigError("decode_step", f"decode_step='graph' on {config.nproc} ranks captures the combines in CUDA graphs, "
                          f"which needs an NCCL process group, got {backend} (decode_step='static' runs without graphs)")


def _check_draft_model(target, config: EngineConfig) -> None:
    """The draft model against the model (`target`: _model_files) before any rank starts (ConfigError
    naming draft_model): the same tokenizer, and a context window reaching every position the engine runs."""
    from treeattn.draft_model import check_draft_model, read_draft_model

    draft = read_draft_model(config.draft_model) if isinstance(config.draft_model, str) else config.draft_model
    check_draft_model(draft, target, positions=config.max_context_tokens(target.config.max_position_embeddings),
                      needed_by="positions the engine runs (max_context: the model's context window, or cache_tokens if fewer)")


def _check_memory(model, model_config, config: EngineConfig) -> None:
    """The weights and cache blocks the ranks on this machine hold (the draft model's too) against its
    memory; ValueError naming the option to change."""
    dtype = config.dtype or (torch.float32 if isinstance(model, (str, os.PathLike)) else model.dtype)
    slots = config.blocks_per_rank(model_config.max_position_embeddings) * config.block_size
    weights, cache = model_bytes(model, dtype), slots * kv_bytes_per_token(model_config, dtype)
    draft = 0
    if config.draft_model is not None:
        draft = model_bytes(config.draft_model, dtype) + slots * kv_bytes_per_token(_model_files(config.draft_model).config, dtype)
    here = int(os.environ.get("LOCAL_WORLD_SIZE", config.nproc))
    memory = device_memory_bytes("cpu" if isinstance(model, (str, os.PathLike)) else model.device)
    total = here * (weights + cache + draft)
    if memory is None or total <= memory:
        return
    option = ("draft_model" if here * (weights + cache) <= memory else "nproc" if weights + cache + draft <= memory
              else "cache_tokens")
    drafted = f" + {format_bytes(draft)} of draft model and its cache" if config.draft_model is not None else ""
    raise ConfigError(option, f"{option}: {here} rank(s) x ({format_bytes(weights)} of weights + {format_bytes(cache)} of KV cache"
                              f"{drafted}) = {format_bytes(total)}, more than the {format_bytes(memory)} of memory of this machine")


def _load_model(model, dtype):
    from treeattn.models import load_model

    if isinstance(model, (str, os.PathLike)):
        return load_model(model, dtype=dtype or torch.float32)
    return model if dtype is None else model.to(dtype)


def _model_info(model) -> ModelInfo:
    c = model.config
    return ModelInfo(c.vocab_size, c.max_position_embeddings, tuple(c.eos_token_ids))


def _make_runner(model, config: EngineConfig, group=None) -> RankRunner:
    draft = None
    if config.draft_model is not None:  # in the model's dtype and on its device
        from treeattn.models import load_model

        draft = config.draft_model
        draft = load_model(draft, dtype=model.dtype, device=model.device) if isinstance(draft, str) else draft.to(model.device, model.dtype)
    return RankRunner(model, group=group, blocks_per_rank=config.blocks_per_rank(model.config.max_position_embeddings),
                      block_size=config.block_size, decode=config.decode if config.nproc > 1 else "local", method=config.method,
                      shared_memory=config.shared_memory, timeout_s=config.timeout_s, draft_model=draft,
                      decode_step=config.decode_step, prefill=config.prefill, max_batch_size=config.max_batch_size)


def _broadcast_plan(plan, rank: int, group=None):
    """Rank 0's plan (or None, the end) on every rank of `group`; `rank` is the group rank."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        box = [plan if rank == 0 else None]
        src = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]
    return plan


# A plan that runs nothing: the idle driver sends one every timeout_s / 4 so that ranks waiting for
# the next plan in a collective never reach the group's timeout.
KEEPALIVE = "keepalive"


@dataclass(frozen=True)
class _Measure:
    """A plan that makes every rank report its RankMeasurements (rank 0 answers with all of them)."""

    reset: bool


def _run(runner: RankRunner, plan):
    """What every rank does with a plan: a step (its StepOutcome), a keepalive (nothing), or a
    measurement (every rank's RankMeasurements, gathered on every rank)."""
    if plan == KEEPALIVE:
        return StepOutcome()
    if isinstance(plan, _Measure):
        mine = runner.measurements(plan.reset)
        if runner.world_size == 1:
            return [mine]
        everyone = [None] * runner.world_size
        dist.all_gather_object(everyone, mine, group=runner.group)
        return everyone
    return runner.step(plan)


def _serve_steps(runner: RankRunner, receive, reply) -> None:
    """A rank's loop: take the next plan (rank 0 from `receive`, the others by broadcast), run it,
    (rank 0) `reply` with what it gave. Ends on a None plan."""
    rank = runner.rank
    while True:
        plan = _broadcast_plan(receive() if rank == 0 else None, rank, runner.group)
        if plan is None:
            return
        try:
            outcome = _run(runner, plan)
        except BaseException as exc:
            if rank == 0:
                reply(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
            raise
        if rank == 0:
            reply(("ok", outcome))


def _rank_main(rank: int, world_size: int, address, authkey: bytes, model, config: EngineConfig) -> None:
    """Body of a spawned rank: build the model and cache, then serve steps until the driver ends."""
    torch.set_num_threads(config.threads_per_rank or max(1, (os.cpu_count() or 1) // world_size))
    model = _load_model(model, config.dtype)
    runner = _make_runner(model, config)
    if rank != 0:
        _serve_steps(runner, None, None)
        return
    with Client(address, authkey=authkey) as conn:
        conn.send(("ready", _model_info(model)))

        def receive():
            try:
                return conn.recv()
            except (EOFError, OSError):  # the driver is gone: end every rank
                return None

        _serve_steps(runner, receive, conn.send)


class _SpawnedRanks:
    """The rank processes of an Engine started with ta.spawn, and the driver's line to rank 0."""

    def __init__(self, model, config: EngineConfig) -> None:
        from treeattn.parallel.spawn import spawn

        self.config = config
        self._authkey = os.urandom(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=self._authkey)
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._spawn, args=(spawn, model), name="treeattn-engine-ranks", daemon=True)
        self._thread.start()
        accepted: list = []
        acceptor = threading.Thread(target=lambda: accepted.append(self._listener.accept()), daemon=True)
        acceptor.start()
        deadline = time.monotonic() + max(config.timeout_s, 120.0)
        while not accepted:
            if not self._thread.is_alive():
                self._listener.close()
                raise EngineError(f"the engine's ranks failed to start: {self.failure}")
            if time.monotonic() > deadline:
                self._listener.close()
                raise EngineError("the engine's ranks did not start in time")
            acceptor.join(0.05)
        self._conn = accepted[0]
        kind, info = self._recv()
        self.info: ModelInfo = info

    def _spawn(self, spawn, model) -> None:
        try:
            spawn(_rank_main, self.config.nproc, self._listener.address, self._authkey, model, self.config,
                  timeout=self.config.timeout_s)
        except BaseException as exc:  # noqa: BLE001
            self.failure = exc

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _recv(self):
        while not self._conn.poll(0.05):
            if not self._thread.is_alive():
                raise EngineError(f"the engine's ranks ended: {self.failure}")
        try:
            message = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise EngineError("rank 0 of the engine is gone (its connection closed)") from exc
        if message[0] == "error":
            raise EngineError(f"a step failed on rank 0: {message[1]}")
        return message

    def run(self, plan) -> StepOutcome:
        try:
            self._conn.send(plan)
        except OSError as exc:
            raise EngineError("rank 0 of the engine is gone (its connection closed)") from exc
        return self._recv()[1]

    def close(self) -> None:
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._thread.join()
        self._conn.close()
        self._listener.close()


class _GroupChannel:
    """An Engine inside an existing process group: rank 0 drives, every rank runs its share."""

    def __init__(self, model, config: EngineConfig, group) -> None:
        model = _load_model(model, config.dtype)
        self.group = group
        self.runner = _make_runner(model, config, group)
        self.info = _model_info(model)

    def serve(self) -> None:
        _serve_steps(self.runner, None, None)

    def alive(self) -> bool:
        return True

    def run(self, plan) -> StepOutcome:
        return _run(self.runner, _broadcast_plan(plan, 0, self.group))

    def close(self) -> None:
        _broadcast_plan(None, 0, self.group)
