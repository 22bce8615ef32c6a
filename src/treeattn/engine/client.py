"""ta.Engine: many requests at once over a KV cache sharded across ranks (the engine's public face).

    with ta.Engine(model, nproc=4, decode="tree", max_batch_size=16, prefix_cache=True, block_size=256) as engine:
        results = engine.generate(prompts, max_new_tokens=64)          # list of RequestResult
        for event in engine.stream(prompt, max_new_tokens=64): ...     # TokenEvent as they come
        handle = engine.submit(prompt, SamplingParams(...))            # thread-safe; handle.cancel()

The engine's pieces, one job each (after vLLM v1's client / core / output processor):

    config.py     EngineConfig: how it runs, validated once, shipped to the ranks
    checks.py     what a rank would refuse, checked in the caller's process before any rank starts
    client.py     this: Engine, the calls of any thread; they only queue messages for the driver
    driver.py     the driver thread: scheduler, block pool and prefix cache; plans and runs each step
    output.py     each request's handle, text, stop strings and result
    transport.py  how the driver reaches the ranks: spawned rank processes, or an existing group
    rank.py       one rank's loop: receive a plan, run it (runner.py), reply

Processes. The Engine object lives in the caller's process. It starts `nproc` rank processes with
ta.spawn; each builds the model and its share of the cache. Every step the driver sends the step's
plan to rank 0, rank 0 broadcasts it to the group, every rank runs the same batched forward pass
(tree_decode across the ranks in every attention layer), and rank 0 answers with the sampled
tokens. submit() and cancel() only queue a message for the driver thread, so they are safe from
any thread, and events are delivered from that thread (on_event) or through the handle.

Speculative decoding: the scheduler appends up to draft_tokens drafts to each decoding sequence's
chunk, rank 0 answers with the accepted drafts and the next token, and the driver emits one
TokenEvent per committed token (docs/engine.md). speculate="ngram" drafts by prompt lookup on the
driver; speculate="draft" reserves the drafts' slots and every rank runs a draft model over its own
cache of the same blocks, filling them in before the verification (treeattn.engine.worker.draft).

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

import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from treeattn.engine.checks import Checked, check_engine, check_model, with_device
from treeattn.engine.config import EngineConfig, given_or_built
from treeattn.engine.device import backend_for, rank_device
from treeattn.engine.driver import Driver
from treeattn.engine.measure import RankMeasurements
from treeattn.engine.output import RequestHandle, RequestState
from treeattn.engine.errors import EngineError
from treeattn.engine.request import RequestResult, SamplingParams, TokenEvent
from treeattn.engine.transport import GroupChannel, SpawnedRanks
from treeattn.parallel.spawn import StartedRanks, rank_threads, under_torchrun


class Engine:
    """The serving core (see the module docstring).

    Args:
        model: a LlamaModel, or a checkpoint directory or .gguf file (loaded on every rank with
            ta.load_model).
        config: an EngineConfig; or leave it None and give its fields as keywords (**options:
            nproc, decode, method, placement, max_batch_size, cache_tokens, prefix_cache,
            block_size, prefill_chunk, dtype, timeout_s, threads_per_rank, speculate,
            draft_tokens, draft_model, shared_memory, decode_step, prefill, max_context, kv_cache_dtype,
            weight_format, kv_store, kv_store_bytes; see
            EngineConfig). Inside an existing process group nproc is the group's size. A
            checks.Checked (what ta.generate hands on) is trusted for its model instead of checked again.
        group: inside an existing process group only: the ranks that share the cache (None:
            the world); its rank 0 is the driver.
        ranks: rank processes started earlier (ta.parallel.spawn.StartedRanks(nproc)), which the
            engine's spawn adopts instead of starting new ones (treeattn serve starts them first
            thing, so their start overlaps the checks); None: started here. Only with nproc > 1
            outside a process group. A restart after a failed step starts new ones.

    In a script, an engine with nproc > 1 must be created under `if __name__ == "__main__":`: rank
    processes (forks of a fork server on Linux, spawned interpreters elsewhere) import the main
    module again in every rank (unguarded, each rank would start an engine of its own; ranks started
    earlier with StartedRanks may be forks of this process instead: treeattn.parallel.spawn's module
    doc)::

        import treeattn as ta

        if __name__ == "__main__":
            with ta.Engine("model.gguf", nproc=2) as engine:
                print(engine.generate("The capital of France is", max_new_tokens=8)[0].text)

    Example (one rank, a random-weight model, token ids in and out)::

        >>> import treeattn as ta
        >>> from treeattn.models.llama import LlamaConfig, random_model
        >>> model = random_model(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
        ...                                  num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=128))
        >>> with ta.Engine(model, nproc=1, block_size=16, cache_tokens=128) as engine:
        ...     result = engine.generate([1, 2, 3], max_new_tokens=4)[0]
        >>> len(result.token_ids), result.finish_reason
        (4, 'length')
    """

    def __init__(self, model, config: EngineConfig | Checked | None = None, *, group: dist.ProcessGroup | None = None,
                 ranks: StartedRanks | None = None, **options) -> None:
        proof = None
        if isinstance(config, Checked):  # checked already (ta.generate, a rank of `treeattn generate`): not again
            proof, config = config, config.config
        config = given_or_built(EngineConfig, config, options, "config")
        if proof is None:
            check_model(model)
        config, joined, self._owns_group = _join(with_device(model, config), group)  # device: "cpu" or "cuda" from here on
        if ranks is not None and (joined or config.nproc == 1):
            raise ValueError(f"ranks: started rank processes need nproc > 1 outside a process group, got nproc={config.nproc}"
                             f"{' in a process group' if joined else ''}")
        if ranks is not None:
            ranks.check_adoptable(config.nproc)
            threads = config.threads_per_rank or rank_threads(config.nproc)  # what rank_main will set
            if ranks.method == "fork" and threads > 1:  # StartedRanks' doc: the forked OpenMP pool hangs
                raise ValueError(f"ranks: forked rank processes run one torch thread each, but threads_per_rank would be "
                                 f"{threads}; start them with StartedRanks({config.nproc}, threads={threads})")
        self.config = config
        from treeattn.models.gguf import shared_readers

        if proof is not None and proof.vouches_for(model, config):
            files = proof.files
        else:
            with shared_readers():  # the checks read a GGUF file's config, tokenizer and sizes: one parse of it
                files = check_engine(model, config, group=group if joined else None, joined=joined)  # before any rank starts
        self.tokenizer = getattr(files, "tokenizer", None)
        self.is_driver = True
        self._closed = False
        self._driver: Driver | None = None
        if joined or config.nproc == 1:  # one rank needs no process of its own: it runs in the driver thread
            self._channel = GroupChannel(model, config, group if joined else None)
            if joined and dist.get_rank(group) != 0:
                self.is_driver = False
                try:
                    self._channel.serve()
                finally:
                    _leave(self._owns_group)
                return
        else:
            self._channel = SpawnedRanks(model, config, ranks)
        self._driver = Driver(config, self._channel, self.tokenizer, files.config.layer_windows)
        self.model_info = self._driver.model_info
        self.pool, self.prefix_cache, self.scheduler = self._driver.pool, self._driver.prefix_cache, self._driver.scheduler
        self.max_context = self._driver.max_context

    @property
    def healthy(self) -> bool:
        """Whether the engine takes requests: set up, not failed, not closed."""
        return self._driver is not None and self._driver.healthy and not self._closed

    @property
    def failure(self) -> str | None:
        """Why the engine failed (one line: e.g. the rank that died, its pid and signal), None while it has not."""
        failure = self._driver.failure if self._driver is not None else None
        return failure.strip().splitlines()[0] if failure else None

    # ------------------------------------------------------------------------------ public

    def submit(self, prompt, params: SamplingParams | None = None, *, on_event: Callable[[TokenEvent], None] | None = None,
               request_id: str | None = None, on_prefill: Callable[[int, int], None] | None = None) -> RequestHandle:
        """Queue one request; returns at once. Thread-safe.

        Args:
            prompt: a string (needs a tokenizer) or a list of token ids.
            params: SamplingParams (default: greedy, 64 new tokens).
            on_event: called with each TokenEvent from the engine's driver thread.
            request_id: a name for it (default: a fresh "req-N").
            on_prefill: called as on_prefill(computed, prompt_tokens) from the driver thread after
                each step that advanced this prompt's prefill (chunked prefill: once per chunk;
                computed includes the tokens found in the prefix cache), for progress displays.

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
        outside = next((t for t, _ in params.logit_bias if t >= self.model_info.vocab_size), None)
        if outside is not None:
            raise ValueError(f"logit_bias: token id {outside} is outside the vocabulary [0, {self.model_info.vocab_size})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none (use stop_token_ids)")
        if params.prompt_logprobs is not None and self.config.tp is not None and self.config.nproc > 1:
            raise ValueError(f"prompt_logprobs: not with tp={self.config.tp} (the Helix layout splits the LM head by "
                             "vocabulary, and prompt rows are scored whole on one rank); run without tp")
        self._require_running()
        request_id = request_id or f"req-{next(self._driver.ids)}"
        handle = RequestHandle(request_id, self._driver.post, on_event, on_prefill)
        self._driver.post(("submit", RequestState(handle, ids, params, time.perf_counter())))
        return handle

    def prepare_structured_outputs(self) -> None:
        """Build the grammar's view of the vocabulary now rather than on the first constrained request
        (SamplingParams.structured; seconds for a large vocabulary, with the GIL held: see
        treeattn.engine.structured.Grammars.prepare). Needs the model's tokenizer: ValueError without."""
        self._require_driver()
        if self.tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer; this engine has none")
        self._driver.grammars.prepare()

    def generate(self, prompts, params: SamplingParams | None = None, **sampling) -> list[RequestResult]:
        """Run a list of prompts (strings or token-id lists) together; their results in order.
        A single prompt (a string or one list of ints) gives a list of one result. `params`, or
        SamplingParams' fields as keywords (max_new_tokens=64, temperature=0.0, top_p, top_k, seed,
        stop, stop_token_ids, ignore_eos, logprobs), apply to every prompt."""
        params = given_or_built(SamplingParams, params, sampling, "params")
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
        if self._driver.failure is not None:
            raise EngineError(self._driver.failure)
        return results

    def stream(self, prompt, params: SamplingParams | None = None, **sampling) -> Iterator[TokenEvent]:
        """One prompt's TokenEvents as they come (the last one has finished=True). Leaving the loop
        early cancels the request. `params` or its fields as keywords, as for generate()."""
        params = given_or_built(SamplingParams, params, sampling, "params")
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
        """blocks_total, blocks_used, blocks_free, blocks_cached, blocks_active (held by running requests), running, waiting,
        prefix_hit_tokens, preemptions, prompt_tokens, generated_tokens, healthy (a consistent snapshot),
        and decoding's counters: decode_forwards (decoding chunks run, one per sequence per step),
        tokens_per_forward (tokens they committed, per chunk: 1 without speculation), and with
        speculative decoding (only then) drafted_tokens, accepted_tokens and acceptance_rate (NaN before any draft);
        shared_prefix_keys: key reads per layer that decode steps saved by reading blocks several
        sequences share once for all of them ((sequences - 1) x keys per shared segment, summed over
        steps; treeattn.engine.worker.shared_prefix); rank_restarts: how many times a step failed on the
        ranks and they were restarted (its requests failed, the others recomputed); with kv_store, the
        tiers' counters (treeattn.engine.kv_tier.COUNTERS: arena_/store_ hit and miss blocks, bytes,
        seconds; docs/kv_store.md)."""
        self._require_driver()
        out = self._driver.stats()
        out["healthy"] = self.healthy
        return out

    def rank_measurements(self, reset: bool = False) -> list[RankMeasurements]:
        """Every rank's RankMeasurements (treeattn.engine.measure), in rank order: steps run, bytes
        communicated by prefill and decode steps, KV cache bytes, resident memory and its peak, since
        the last reset. reset=True starts the counters (and the peak) anew after reading them;
        e.g. call it with reset=True, run requests, call it again. Waits for the driver's current
        step to end. Raises EngineError when the engine has failed or is closed."""
        self._require_driver()
        self._require_running()
        box: list = []
        done = threading.Event()
        self._driver.post(("measure", (reset, box, done)))
        self._wait_for_driver(done)
        if not box:
            raise EngineError(self._driver.failure or "the engine closed before the ranks were measured")
        return box[0]

    def set_decode(self, decode: str, method: str | None = None) -> None:
        """Decode the requests that come next with `decode` ("tree" or "ring") and tree_decode's
        `method` (None: the default, EngineConfig.method's), keeping the caches: a prompt asked
        again is found in the prefix cache, so several decode methods can answer one prefill
        (treeattn.eval.runner.decode_methods). One rank (nproc=1) decodes locally whatever is
        asked. Only between requests: waits for the driver, then engine.config names the new decode.

        Raises:
            ValueError: a decode or method EngineConfig refuses, a request still pending, or an
                engine with a draft model or static decode steps (they keep the decode they were built with).
            EngineError: the engine has failed or is closed (or fails meanwhile).
        """
        self._require_driver()
        if self.config.speculate == "draft" or self.config.decode_step != "dynamic":
            raise ValueError(f"set_decode({decode!r}): an engine with speculate='draft' or decode_step="
                             f"{self.config.decode_step!r} keeps the decode it was built with")
        config = replace(self.config, decode=decode if self.config.nproc > 1 else "local", method=method)  # its checks
        self._require_running()
        box: list = []
        done = threading.Event()
        self._driver.post(("decode", (config.decode, config.method, box, done)))
        self._wait_for_driver(done)
        if self._driver.failure is not None:
            raise EngineError(self._driver.failure)
        if box:
            raise box[0]
        self.config = config

    def clear_prefix_cache(self) -> None:
        """Evict every cached block no running request uses (waits for the driver to do it).
        Raises EngineError when the engine has failed or is closed (or fails meanwhile)."""
        self._require_driver()
        self._require_running()
        done = threading.Event()
        self._driver.post(("clear", done))
        self._wait_for_driver(done)
        if self._driver.failure is not None:
            raise EngineError(self._driver.failure)

    def _wait_for_driver(self, done: threading.Event) -> None:
        """Wait for the driver to set `done`; EngineError if the driver thread ends first (a message
        posted after it drained its inbox for the last time would never be answered)."""
        while not done.wait(0.5):
            if not self._driver.alive() and not done.is_set():
                raise EngineError(self._driver.failure or "the engine is closed")

    def close(self) -> None:
        """Cancel what is still pending, stop the ranks and wait for them to exit."""
        if not self.is_driver or self._closed:
            return
        self._closed = True
        try:
            self._driver.post(("close", None))
            self._driver.join()
            self._channel.close()
        finally:
            _leave(self._owns_group)

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

    # ------------------------------------------------------------------------------ helpers

    def _require_driver(self) -> None:
        if not self.is_driver:
            raise EngineError("this process is a serving rank of the engine's group, not its driver (group rank 0)")

    def _require_running(self) -> None:
        if self._driver.failure is not None or self._closed:
            raise EngineError(self._driver.failure or "the engine is closed")

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


def _join(config: EngineConfig, group) -> tuple[EngineConfig, bool, bool]:
    """Join torchrun's group when launched by it; inside a group nproc is the group's size.
    Returns (config, whether a process group is in use, whether this call created it: the engine then
    destroys it when it closes)."""
    created = False
    if dist.is_available() and not dist.is_initialized() and under_torchrun():  # join torchrun's group
        if config.device == "cuda":
            torch.cuda.set_device(rank_device("cuda", int(os.environ["RANK"])))
        dist.init_process_group(backend=backend_for(config.device), timeout=timedelta(seconds=config.timeout_s))
        created = True
    joined = dist.is_available() and dist.is_initialized()
    if group is not None and not joined:
        raise ValueError("group was given but torch.distributed is not initialized")
    if joined:
        if group is not None and dist.get_rank(group) < 0:
            raise ValueError("this process is not a member of `group`")
        config = replace(config, nproc=dist.get_world_size(group))
    return config, joined, created


def _leave(created: bool) -> None:
    """Destroy the process group _join created, once the engine's last collective is done. Left to the
    interpreter's exit, gloo's threads were sometimes destroyed while joinable there: std::terminate, a
    SIGABRT, and torchrun reporting the launch as failed after a clean shutdown (tests/test_launch.py)."""
    if created and dist.is_initialized():
        dist.destroy_process_group()


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)
