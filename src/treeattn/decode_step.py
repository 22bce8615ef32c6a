"""A decode step with static shapes and no host synchronization, capturable in a CUDA graph.

A normal decode step (treeattn.generate) grows the cache views by one token per step, claims the
new slot with host integers, and lets attention choose its path from the data. Each of those
reads or writes host state, so on a GPU the step waits on the device several times per layer, and
it cannot be captured in a CUDA graph. DecodeStep runs the same model over fixed buffers:

    inputs   tokens     int64 (B, 1)   the new token of every sequence, copied in before each call
    state    slot       int64 (1,)     the global cache slot of the new token
             positions  int64 (B, 1)   its position in each sequence
             kv_len     int64 (B,)     this rank's cache slots in use (the new token included
                                       during the step)
    outputs  hidden     (B, hidden_size) in the model dtype, the final hidden state of the token
             logits     float32 (B, vocab_size), if asked for

The step advances slot, positions and kv_len itself, on the device. Inside it:

- the placement decides on the device which rank stores the token and where
  (ShardedKVCache.locate); a rank that does not hold the slot writes back what it had;
- attention reads this rank's whole preallocated shard (ShardedKVCache.static_layer), whose
  unused slots sit at INVISIBLE_POSITION, so shapes never change; sliding windows hide keys by
  position (GraphSafeDecodeAttention);
- tree_decode and ring_decode run with check_inputs=False and graph_safe=True: the local attention
  is graph_safe_attention (on CUDA the Triton kernel, which reads only the first kv_len slots), the
  ring takes its shard lengths from the placement instead of gathering them.

Sampling is not part of the step: it reads logits on the host.

    step = DecodeStep(model, cache, next_positions, decode="tree", group=group)
    step.capture()            # CUDA only: warm up, then record one step in a CUDA graph
    logits = step(tokens)     # copy tokens in, replay (or run eagerly), advance

Every call writes into the same output buffers: copy what you keep. The cost of static shapes:
every step reads the whole capacity's positions and (off CUDA, or in the ring) keys and values,
and ring pass-KV sends every rank's whole preallocated shard; size the cache capacity to the run.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from treeattn.cache.sharded import ShardedKVCache, StaticCacheUpdate
from treeattn.models.attention import DECODE_KINDS, attention_backend
from treeattn.models.llama import LlamaModel
from treeattn.parallel import comm
from treeattn.parallel.tree_decode import METHODS

logger = logging.getLogger(__name__)


def graph_safe_reason(model: LlamaModel, batch_size: int = 1) -> str | None:
    """Why a DecodeStep cannot run `model` on its device without host synchronization, or None.

    Off CUDA the step always runs (graph_safe_attention's dense path). On CUDA the Triton decode
    kernel must take the model's attention: triton installed, float16/bfloat16/float32, a head dim
    that is a power of two from 16 to 256.
    """
    if not isinstance(model, LlamaModel):
        return f"the static step runs LlamaModel only, not {type(model).__name__}"
    if model.device.type != "cuda":
        return None
    from treeattn.ops.attention import _triton_decode_module

    triton_decode = _triton_decode_module()
    if triton_decode is None:
        return "triton is not installed (pip install 'treeattn[triton]'), so the Triton decode kernel is unavailable"
    c = model.config
    q = torch.empty(batch_size, 1, c.num_heads, c.head_dim, dtype=model.dtype, device=model.device)
    kv = torch.empty(batch_size, 1, c.num_kv_heads, c.head_dim, dtype=model.dtype, device=model.device)
    reason = triton_decode.unsupported_reason(q, kv, kv)
    return None if reason is None else f"the Triton decode kernel does not take {reason}"


class DecodeStep:
    """One decode step of `model` over `cache`, with static shapes and no host synchronization.

    Args:
        model: a LlamaModel, the same weights on every rank.
        cache: this rank's ShardedKVCache, already holding the context (prefill). The step writes
            into it from slot cache.length on; its slots past cache.local_length are cleared here
            (ShardedKVCache.clear_unused). Change it only through this step afterwards.
        positions: int64 (B,), the position of the first token the step will run, per sequence.
        decode: "tree" (tree_decode), "ring" (ring_decode, pass-KV) or "local" (one process).
            Without an initialized process group the step is "local".
        method: tree_decode method: "allreduce", "tree" or "twolevel".
        group: process group (None: the default world group).
        topology: Topology for method "twolevel".
        logits: also compute float32 logits (B, vocab_size) inside the step.

    Raises:
        ValueError / TypeError: bad arguments; on CUDA, a model the Triton kernel does not take
            (graph_safe_reason).
    """

    def __init__(
        self,
        model: LlamaModel,
        cache: ShardedKVCache,
        positions: torch.Tensor,
        *,
        decode: str = "tree",
        method: str = "allreduce",
        group: dist.ProcessGroup | None = None,
        topology=None,
        logits: bool = True,
    ) -> None:
        if not isinstance(model, LlamaModel):
            raise TypeError(f"model must be a LlamaModel, got {type(model).__name__}")
        if not isinstance(cache, ShardedKVCache):
            raise TypeError(f"cache must be a ShardedKVCache, got {type(cache).__name__}")
        c = model.config
        expected = (c.num_layers, c.num_kv_heads, c.head_dim, model.dtype, model.device)
        actual = (cache.num_layers, cache.num_kv_heads, cache.head_dim, cache.dtype, cache.device)
        if expected != actual:
            raise ValueError(f"cache does not fit the model: (layers, Hkv, D, dtype, device) expected {expected}, got {actual}")
        B = cache.batch_size
        if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64 or positions.numel() != B:
            described = f"{positions.dtype} {tuple(positions.shape)}" if isinstance(positions, torch.Tensor) else type(positions).__name__
            raise ValueError(f"positions must be an int64 tensor of B={B} positions, got {described}")
        if decode not in DECODE_KINDS:
            raise ValueError(f"decode must be one of {DECODE_KINDS}, got {decode!r}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if not isinstance(logits, bool):
            raise TypeError(f"logits must be a bool, got {type(logits).__name__}")
        reason = graph_safe_reason(model, B)
        if reason is not None:
            raise ValueError(f"the graph-safe decode step cannot run this model on {model.device}: {reason}")
        distributed = dist.is_available() and dist.is_initialized()
        world_size = dist.get_world_size(group) if distributed else 1
        if world_size != cache.world_size:
            raise ValueError(f"cache is sharded over {cache.world_size} ranks, but the group has {world_size}")
        if decode == "local" and world_size > 1:
            raise ValueError(f"decode='local' runs on one rank, but the group has {world_size}; use 'tree' or 'ring'")
        self.kind = decode if distributed else "local"
        self.model, self.cache, self.group = model, cache, group
        self.graph: torch.cuda.CUDAGraph | None = None
        self.step_comm: comm.CommStats | None = None  # one captured step's traffic (CUDA graph)
        self._length = cache.length  # the cache length the next call expects (host)
        device = model.device
        with torch.inference_mode():
            cache.clear_unused()
            self.tokens = torch.zeros(B, 1, dtype=torch.int64, device=device)
            self.positions = positions.reshape(B, 1).to(device, copy=True)
            self.slot = torch.full((1,), cache.length, dtype=torch.int64, device=device)
            self.kv_len = torch.full((B,), cache.local_length, dtype=torch.int64, device=device)
            self.hidden = torch.zeros(B, c.hidden_size, dtype=model.dtype, device=device)
            self.logits = torch.zeros(B, c.vocab_size, dtype=torch.float32, device=device) if logits else None
        self.attend = attention_backend(
            self.kind, method=method, group=group, topology=topology, graph_safe=True, kv_len=self.kv_len,
            shard_lengths=[cache.placement.local_capacity(r) for r in range(cache.world_size)],
        )

    def __call__(self, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step: copy `tokens` in, run it (replay the graph once captured), advance.

        Args:
            tokens: int64 (B,) or (B, 1), the new token of every sequence (any device); None:
                use what self.tokens holds.

        Returns:
            self.logits (float32 (B, vocab_size)) if the step computes logits, else self.hidden
            ((B, hidden_size)): buffers the next call overwrites.

        Raises:
            ValueError: the cache is full. RuntimeError: the cache was changed outside this step.
        """
        if self.cache.length != self._length:
            raise RuntimeError(
                f"the cache holds {self.cache.length} tokens, but this DecodeStep expected {self._length}: it was "
                "changed outside the step (extend/truncate); build a new DecodeStep"
            )
        self.cache.check_room(1)
        with torch.inference_mode():
            if tokens is not None:
                if not isinstance(tokens, torch.Tensor) or tokens.dtype != torch.int64 or tokens.numel() != self.tokens.numel():
                    described = f"{tokens.dtype} {tuple(tokens.shape)}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
                    raise ValueError(f"tokens must be an int64 tensor of B={self.tokens.shape[0]} ids, got {described}")
                self.tokens.copy_(tokens.reshape(self.tokens.shape))
            if self.graph is not None:
                self.graph.replay()
                comm.record_replay(self.step_comm)
            else:
                self._step()
        self.cache.advance(1)
        self._length += 1
        return self.logits if self.logits is not None else self.hidden

    def capture(self, *, warmup: int = 2, capture_error_mode: str = "global") -> None:
        """Record one step in a CUDA graph; later calls replay it. Call on every rank together.

        The step first runs `warmup` times on a side stream (Triton compiles its kernels, NCCL
        connects its peers, cuBLAS picks its kernels), each time putting the counters back; a
        warmup step writes the slot the next real step rewrites, so the cache is unchanged. Then
        one step is captured (nothing runs during capture). Communication is recorded once, as
        self.step_comm, and added to the open comm_stats blocks at each replay.

        Args:
            warmup: eager steps before capture, >= 1.
            capture_error_mode: passed to torch.cuda.graph ("global", "thread_local", "relaxed").

        Raises:
            RuntimeError: not on CUDA, or already captured.
        """
        if self.hidden.device.type != "cuda":
            raise RuntimeError(f"capture() records a CUDA graph: the model must be on a CUDA device, got {self.hidden.device}")
        if self.graph is not None:
            raise RuntimeError("this DecodeStep is already captured")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"warmup must be an int >= 1, got {warmup!r}")
        counters = (self.slot, self.positions, self.kv_len)
        with torch.inference_mode(), comm.separate_comm_stats():
            saved = [t.clone() for t in counters]
            side = torch.cuda.Stream(device=self.hidden.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    self._step()
                    for t, value in zip(counters, saved):
                        t.copy_(value)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with comm.separate_comm_stats() as captured:
                with torch.cuda.graph(graph, capture_error_mode=capture_error_mode):
                    self._step()
        self.graph, self.step_comm = graph, captured
        logger.info("decode step captured in a CUDA graph (%s, %d warmup steps)", self.kind, warmup)

    def _step(self) -> None:
        """The step itself: device work only, every shape fixed, no host read of a device value."""
        local_slot, owned = self.cache.locate(self.slot)
        self.cache.store_positions_at(local_slot, owned, self.positions)
        self.kv_len.add_(owned.to(torch.int64))
        store = StaticCacheUpdate(self.cache, local_slot, owned)
        hidden = self.model(self.tokens, self.positions, store, self.attend)[:, -1]
        self.hidden.copy_(hidden)
        if self.logits is not None:
            self.logits.copy_(self.model.logits(hidden))
        self.slot.add_(1)
        self.positions.add_(1)
