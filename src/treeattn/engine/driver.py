"""The engine's driver loop: one thread that plans each step, runs it on the ranks and turns its tokens into events.

    driver = Driver(config, channel, tokenizer, layer_windows)   # owns the scheduler, block pool and prefix cache
    driver.post(("submit", RequestState(...)))                   # any thread: submit, cancel, measure, decode, clear, close
    driver.join()                                                # after ("close", None)

Every message goes through one queue, so only the driver thread touches the scheduler. Each turn
takes the queued messages, asks the scheduler for a StepPlan, sends it to the ranks through the
transport (transport.py) and completes it: every committed token goes through its request's
RequestState (output.py: detokenizing, stop strings) and out as a TokenEvent. While idle the driver
sends KEEPALIVE plans every timeout_s / 4, so that ranks waiting in a collective stay short of the
group's timeout. A step that fails on spawned ranks (a rank raised or died) fails that step's
requests alone: the ranks are restarted and every other request prefills its tokens again
(_recover). Any other exception fails every pending request with finish_reason "error" and sets
healthy False; the Engine's calls then raise EngineError.
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import threading
import time
import traceback

from treeattn.cache.blocks import ShardedBlockPool
from treeattn.cache.prefix import PrefixCache
from treeattn.cache.window import hybrid_windows
from treeattn.engine.config import EngineConfig
from treeattn.engine.output import RequestState
from treeattn.engine.plan_message import KEEPALIVE, Measure, SetDecode
from treeattn.engine.errors import EngineError, StepFailed
from treeattn.engine.request import TokenEvent, TokenLogprob
from treeattn.engine.config import idle_prefill_chunk
from treeattn.engine.scheduler import Scheduler, Sequence
from treeattn.engine.speculate import NgramDrafter
from treeattn.engine.structured import Grammars

logger = logging.getLogger(__name__)


class Driver:
    """The driver thread and everything it owns (see the module docstring).

    Args:
        config: the engine's EngineConfig (nproc already the group's size).
        channel: the transport to the ranks (transport.SpawnedRanks or GroupChannel); its .info
            is the ModelInfo rank 0 reported.
        tokenizer: the model's tokenizer (for text and stop strings), or None.
        layer_windows: the model's per-layer sliding windows (config.idle_prefill_chunk).
    """

    def __init__(self, config: EngineConfig, channel, tokenizer, layer_windows) -> None:
        info = self.model_info = channel.info
        self.config, self.channel, self.tokenizer = config, channel, tokenizer
        self.pool = ShardedBlockPool(world_size=config.kv_ranks,
                                     blocks_per_rank=config.blocks_per_rank(info.max_position_embeddings),
                                     block_size=config.block_size, placement=config.placement,
                                     span_blocks=config.span_blocks(info.max_position_embeddings))
        # A hybrid model's window layers (treeattn.cache.window) start a cached prefix from a window checkpoint, at
        # most max_batch_size of them kept (the memory check counts them); a linear hybrid's states (treeattn.linear)
        # are kept for no cached prefix: its prefix cache is off.
        checkpoints = config.max_batch_size if hybrid_windows(tuple(layer_windows)) else None
        self.prefix_cache = (PrefixCache(self.pool, checkpoints=checkpoints, record_new=config.kv_store is not None)
                             if config.prefix_cache and not info.linear_layers else None)
        self.tier = self._store_tier()  # the prefix cache's second tier (treeattn.engine.kv_tier)
        self.scheduler = Scheduler(self.pool, max_batch_size=config.max_batch_size, prefill_chunk=config.prefill_chunk,
                                   prefix_cache=self.prefix_cache, drafter=_drafter(config.speculate),
                                   draft_tokens=config.draft_tokens, draft_cache=config.speculate == "draft",
                                   idle_prefill_chunk=idle_prefill_chunk(config.prefill, config.nproc if config.tp is None else 1,
                                                                        layer_windows))
        self.grammars = Grammars(tokenizer, info.vocab_size, info.eos_token_ids, config.speculate)  # structured outputs
        self.max_context = config.max_context_tokens(info.max_position_embeddings)
        if self.max_context > info.max_position_embeddings:
            logger.warning("max_context=%d exceeds the model's max_position_embeddings=%d: positions beyond it run "
                           "(the model was not trained there)", self.max_context, info.max_position_embeddings)
        self.healthy = True
        self.failure: str | None = None
        self.ids = itertools.count()  # request ids "req-N"
        self._inbox: queue.Queue = queue.Queue()
        self._requests: dict[str, RequestState] = {}  # by request id, until finished
        self._by_seq: dict[int, RequestState] = {}  # the same, by scheduler sequence id
        self._last_contact = time.monotonic()  # of the driver with the ranks (see KEEPALIVE)
        self._decode = (config.decode, config.method)  # what the ranks decode with (set_decode may change it)
        self._counters = {"prompt_tokens": 0, "generated_tokens": 0, "shared_prefix_keys": 0, "rank_restarts": 0}
        self._restarts_in_a_row = 0
        self._lock = threading.Lock()
        self._update_stats()
        self._thread = threading.Thread(target=self._drive, name="treeattn-engine-driver", daemon=True)
        self._thread.start()

    def _store_tier(self):
        """The KV store's driver side for config.kv_store, or None (none asked, or refused: one warning)."""
        from treeattn.engine.kv_tier import StoreTier, store_refusal

        info = self.model_info
        if self.config.kv_store is None:
            return None
        refusal = store_refusal(info.linear_layers, self.config.tp or 1)
        if refusal is not None or info.kv_store_namespace is None:
            logger.warning("--kv-store is off for this model: %s", refusal or "its ranks made no store")
            return None
        return StoreTier(self.config.kv_store, info.kv_store_namespace, self.pool, self.prefix_cache, self.channel.run)

    def post(self, message: tuple) -> None:
        """Queue a message for the driver thread: ("submit", RequestState), ("cancel", request_id),
        ("measure", (reset, box, done)), ("decode", (decode, method, box, done)), ("clear", done) or
        ("close", None). Thread-safe."""
        self._inbox.put(message)

    def stats(self) -> dict:
        """A consistent snapshot of the scheduler's and the driver's counters (Engine.stats)."""
        with self._lock:
            return dict(self._stats)

    def join(self) -> None:
        self._thread.join()

    def alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------------------ the loop

    def _drive(self) -> None:
        """The driver thread: take messages, plan a step, run it on the ranks, deliver events."""
        self._update_stats()
        try:
            while True:
                if not self._take_messages(block=not self.scheduler.has_work):
                    break
                if self.tier is not None:  # blocks cached since the last step to disk, waiting requests' from it
                    self.tier.flush()
                    self.tier.promote(self.scheduler)
                if not self.scheduler.has_work:
                    self._update_stats()  # a cancel or a refused request changed the counts
                    continue
                plan = self.grammars.mark(self.scheduler.schedule())  # structured outputs: masks follow the plan
                self._mark_scheduled(plan)
                if not plan.chunks:
                    self._fail_stuck_head()
                    continue
                try:
                    outcome = self.channel.run(plan, masks=functools.partial(self.grammars.masks, plan))
                except StepFailed as exc:
                    self._recover(plan, exc)
                    continue
                self._restarts_in_a_row = 0
                self._complete(plan, outcome)
                if self.tier is not None:
                    self.tier.flush(plan)
                self._update_stats()
        except BaseException as exc:  # noqa: BLE001 -- every failure must reach the requests
            self.failure = f"engine failed: {type(exc).__name__}: {exc}"
            logger.error("%s\n%s", self.failure, traceback.format_exc())
            self.healthy = False
        finally:
            self._end()

    def _mark_scheduled(self, plan) -> None:
        """Note when each request first runs (RequestResult.queue_s)."""
        now = time.perf_counter()
        for chunk in plan.chunks:
            request = self._by_seq.get(chunk.seq_id)
            if request is not None and request.scheduled_at is None:
                request.scheduled_at = now

    def _complete(self, plan, outcome) -> None:
        """Commit a step's tokens: one event per committed token of every sequence."""
        self._counters["shared_prefix_keys"] += outcome.shared_prefix_keys
        self._last_contact = time.monotonic()
        now = time.perf_counter()
        committed: dict[int, int] = {}  # seq_id -> tokens committed so far in this step
        self._record_prompt_logprobs(outcome, now)
        completed = self.scheduler.complete(plan, outcome.tokens)
        self._report_prefill(plan)
        for seq, token, reason in completed:  # one per committed token
            index = committed[seq.seq_id] = committed.get(seq.seq_id, -1) + 1
            logprob = outcome.logprobs[seq.seq_id][index] if seq.seq_id in outcome.logprobs else None
            request = self._by_seq.get(seq.seq_id)
            if request is not None:  # None: a stop string ended it earlier in this run of tokens
                try:
                    if token is None and seq.seq_id in outcome.errors:  # rank 0 failed to sample this request
                        self._finish(request, "error", now, error=outcome.errors[seq.seq_id])
                        continue
                    self._on_token(request, token, reason, now, logprob)
                except Exception as exc:  # noqa: BLE001 -- this request's alone (its text, its callback)
                    self._fail_request(request, exc)

    def _record_prompt_logprobs(self, outcome, now: float) -> None:
        """Put a step's prompt log-probabilities into their requests (a recomputed prefill writes the
        same positions again); a request whose values were not finite fails alone."""
        for seq_id, (position, entries) in outcome.prompt_logprobs.items():
            request = self._by_seq.get(seq_id)
            if request is None or request.prompt_logprobs is None:
                continue
            if entries is None:
                self._finish(request, "error", now, error="the model's prompt log-probabilities for this request were not "
                                                          "finite (NaN or inf)")
                continue
            request.prompt_logprobs[position : position + len(entries)] = entries

    def _recover(self, plan, exc: StepFailed) -> None:
        """A step failed on the ranks: its requests fail, the ranks restart with empty caches and
        every other request prefills its tokens again (as after a preemption) and goes on. Ranks
        that the driver cannot restart (an existing group), or a third failure in a row with no
        step completed between, fail the engine."""
        if not getattr(self.channel, "restartable", False) or self._restarts_in_a_row >= 2:
            raise exc
        self._restarts_in_a_row += 1
        self._counters["rank_restarts"] += 1
        logger.error("%s\nfailing the step's %d requests and restarting the ranks", exc, len(plan.chunks))
        now = time.perf_counter()
        for chunk in plan.chunks:
            request = self._by_seq.get(chunk.seq_id)
            if request is not None:
                self._finish(request, "error", now, error=f"a step with this request failed on the engine's ranks "
                                                          f"({exc.summary}); the engine restarted its ranks")
        self.scheduler.recompute_all()
        if self.tier is not None:  # the restarted ranks hold none of the blocks not yet saved
            self.tier.discard()
        self.channel.restart()
        if self._decode != (self.config.decode, self.config.method):  # the restarted ranks start from the config's
            self.channel.run(SetDecode(*self._decode))
        self._last_contact = time.monotonic()
        self._update_stats()

    def _report_prefill(self, plan) -> None:
        """Tell each request whose prompt this step advanced how far its prefill is."""
        for chunk in plan.chunks:
            request = self._by_seq.get(chunk.seq_id)
            if request is None or request.seq is None or chunk.start >= len(request.prompt):
                continue
            total = len(request.prompt)
            request.handle.prefill_progress(min(request.seq.num_computed, total), total)

    def _end(self) -> None:
        """The loop has ended (closed or failed): every request still pending finishes."""
        reason = self.failure or "the engine was closed"
        while not self._inbox.empty():  # submissions that raced with the end
            kind, payload = self._inbox.get()
            if kind == "submit":
                self._requests[payload.request_id] = payload
            elif kind == "clear":
                payload.set()
            elif kind == "measure":
                payload[2].set()
            elif kind == "decode":
                payload[3].set()
        for request in list(self._requests.values()):
            self._finish(request, "error" if self.failure else "cancelled", time.perf_counter(),
                         error=reason if self.failure else None)
        self._update_stats()

    def _take_messages(self, block: bool) -> bool:
        """Handle queued submissions, cancels and commands; False when closing."""
        while True:
            try:
                kind, payload = self._inbox.get(block=block, timeout=0.2 if block else None)
            except queue.Empty:
                if not block:
                    return True
                if not self.channel.alive():  # idle, and a rank is gone: named where the channel knows it
                    raise EngineError(getattr(self.channel, "death", None) and f"the engine's {self.channel.death}"
                                      or "the engine's rank processes ended")
                if time.monotonic() - self._last_contact > self.config.timeout_s / 4:
                    self.channel.run(KEEPALIVE)  # idle ranks wait in a collective: keep it short of the timeout
                    self._last_contact = time.monotonic()
                continue
            block = False
            if kind == "close":
                return False
            self._handle(kind, payload)

    def _handle(self, kind: str, payload) -> None:
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
                box.append(self.channel.run(Measure(reset)))
            finally:
                done.set()
        elif kind == "decode":
            decode, method, box, done = payload
            try:
                if self._requests:
                    box.append(ValueError(f"set_decode({decode!r}, {method!r}): {len(self._requests)} request(s) still "
                                          "pending; switch the decode between requests"))
                else:
                    self.channel.run(SetDecode(decode, method))
                    self._decode = (decode, method)
            finally:
                done.set()
        elif kind == "clear":
            if self.prefix_cache is not None:
                self.prefix_cache.clear()
            self._update_stats()
            payload.set()

    def _start(self, request: RequestState) -> None:
        self._requests[request.request_id] = request
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
        self.grammars.start(request.seq.seq_id, request.params.structured, stop_ids)
        self._counters["prompt_tokens"] += len(request.prompt)

    def _on_token(self, request: RequestState, token: int | None, reason: str | None, now: float,
                  logprob: TokenLogprob | None = None) -> None:
        if token is None:
            self._finish(request, "error", now, error=(
                "the model's logits for this request were not finite (NaN or inf); no token was produced"))
            return
        self._counters["generated_tokens"] += 1
        self.grammars.advance(request.seq.seq_id, token)
        delta, stopped = request.add_token(token, logprob, self.tokenizer, now, last=reason is not None)
        if stopped:  # a stop string ends it, even on its last token
            if reason is None:
                self.scheduler.finish(request.seq, "stop")
            reason = "stop"
        if reason is None:
            request.handle.emit(TokenEvent(request.request_id, token, delta, logprob=logprob))
            if request.handle.callback_error is not None:
                self._finish(request, "error", now, error=request.handle.callback_error)
        else:
            self._finish(request, reason, now, token=token, delta=delta, logprob=logprob)

    def _finish(self, request: RequestState, reason: str, now: float, *, token: int | None = None, delta: str = "",
                error: str | None = None, logprob: TokenLogprob | None = None) -> None:
        """End a request: free its sequence (if the scheduler still has it) and deliver the result."""
        self._requests.pop(request.request_id, None)
        seq = request.seq
        if seq is not None:
            self._by_seq.pop(seq.seq_id, None)
            self.grammars.release(seq.seq_id)
        if seq is not None and seq.finish_reason is None:
            self.scheduler.finish(seq, reason)
        speculation = self._speculation(seq) if seq is not None and self.config.speculate else {}
        result = request.result(reason, now, error=error, speculation=speculation)
        request.handle.emit(TokenEvent(request.request_id, token, delta, finished=True, finish_reason=reason, error=error,
                                       logprob=logprob), result)

    def _fail_request(self, request: RequestState, exc: Exception) -> None:
        """An exception while the driver served one request (not a step on the ranks): that
        request finishes with "error", the engine goes on."""
        logger.error("request %s failed: %s: %s", request.request_id, type(exc).__name__, exc, exc_info=exc)
        if request.handle.done:
            return
        self._finish(request, "error", time.perf_counter(), error=f"serving this request failed: {type(exc).__name__}: {exc}")

    def _speculation(self, seq: Sequence) -> dict:
        """A request's speculative decoding, as GenerationResult.speculation reports it."""
        out = {"method": self.config.speculate, "draft_tokens": self.config.draft_tokens, "drafted": seq.drafted,
               "accepted": seq.accepted, "acceptance_rate": seq.accepted / seq.drafted if seq.drafted else float("nan"),
               "decoded_tokens": seq.decode_tokens, "decode_forwards": seq.decode_forwards,
               "tokens_per_forward": seq.decode_tokens / seq.decode_forwards if seq.decode_forwards else float("nan")}
        if self.config.draft_model is not None:
            from treeattn.engine.draft_model import describe

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
        if self.tier is not None:
            stats.update(self.tier.stats())
        with self._lock:
            self._stats = stats


def _drafter(speculate: str | None):
    """The scheduler's drafter for EngineConfig.speculate."""
    if speculate == "ngram":
        return NgramDrafter()
    if speculate == "draft":
        from treeattn.engine.speculate import DraftSlots

        return DraftSlots()
    return None
