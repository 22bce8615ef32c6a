"""One rank's side of the engine: build the model and its share of the cache, then run the plans it is sent.

    runner = make_runner(load_model(model, config.dtype), config, group)   # a RankRunner (runner.py)
    serve_steps(runner, receive, reply)    # until a None plan: rank 0 receives and replies, the others follow

Every plan reaches the ranks in one encoding, int32 words (plan_message): the driver encodes it once, rank 0
decodes it and broadcasts its ranks' part as it came (plan_message.PlanWire: one broadcast per step, on the
device the group's backend needs, no pickling); each rank runs it
(run_plan): a StepPlan is a batched forward pass (RankRunner.step), KEEPALIVE is nothing (it keeps
ranks waiting in the broadcast short of the group's timeout), StoreOps saves and loads KV store
blocks (treeattn.engine.kv_tier; every rank's StoreReport gathered), Measure gathers every rank's
RankMeasurements and SetDecode switches every rank's decode attention (RankRunner.set_decode). rank_main is the body of a rank
process that ta.spawn started
(transport.SpawnedRanks); inside an existing group the ranks call serve_steps themselves
(transport.GroupChannel).
"""

from __future__ import annotations

import logging
import os
import socket
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Client

import torch
import torch.distributed as dist

from treeattn.engine.config import EngineConfig, resolve_kv_cache_dtype
from treeattn.engine.device import rank_device
from treeattn.engine.plan_message import KEEPALIVE, Measure, PlanWire, SetDecode, StoreOps, decode, encode, is_masks, plan_device
from treeattn.engine.structured import StepMasks
from treeattn.engine.worker.runner import RankRunner, StepOutcome
from treeattn.models.packed import fuse_projections, pack_arena, set_activation_format, set_prefill_dtype
from treeattn.parallel.spawn import rank_threads

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """What the driver needs to know of the model (rank 0 reports it)."""

    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    linear_layers: tuple[int, ...] = ()  # a hybrid linear model's (treeattn.linear): per-sequence states, no prefix cache
    kv_store_namespace: str | None = None  # the ranks' KV store namespace (treeattn.engine.kv_tier), None: no store
    bos_token_id: int | None = None  # the checkpoint's beginning-of-sequence token (GGUF tokenizer.ggml.bos_token_id)


def load_model(model, dtype, device: torch.device | None = None, weight_format: str = "auto", layout=None):
    """The model of a rank: a checkpoint path loaded with ta.load_model straight onto `device` (None:
    the CPU) in `dtype` (None: bfloat16 on CUDA, float32 on the CPU), tensor by tensor, its quantized
    weights held as `weight_format` says (EngineConfig.weight_format), without its tokenizer and chat
    template (model.tokenizer None: a rank runs token ids only); or a loaded model, moved to
    `device` and `dtype` where they are given. With a HelixLayout `layout` (tensor parallelism) a
    checkpoint's ranks read only their share of the weights (treeattn.engine.worker.tensor_parallel)."""
    from treeattn.engine.device import resolve_dtype
    from treeattn.models import load_model as load

    if isinstance(model, (str, os.PathLike)):
        device = device or torch.device("cpu")
        shard = None
        if layout is not None and layout.world_size > 1:
            from treeattn.engine.worker.tensor_parallel import tensor_parallel_cuts
            from treeattn.models.loader import read_config

            shard = tensor_parallel_cuts(read_config(model), layout)
        return load(model, dtype=resolve_dtype(dtype, device.type), device=device, weight_format=weight_format,
                    with_tokenizer=False, shard=shard)  # the driver holds the tokenizer (Engine: check_engine's model files)
    if device is not None and device != model.device:
        model = model.to(device)
    return model if dtype is None else model.to(dtype)


def model_info(model, runner: RankRunner | None = None) -> ModelInfo:
    from treeattn.linear.hybrid import linear_layers

    c = model.config
    store = getattr(runner, "block_store", None)
    return ModelInfo(c.vocab_size, c.max_position_embeddings, tuple(c.eos_token_ids), linear_layers(model),
                     None if store is None else store.namespace, getattr(c, "bos_token_id", None))


def make_runner(model, config: EngineConfig, group=None) -> RankRunner:
    """This rank's RankRunner for `config` (the draft model, if any, loaded in the model's dtype and on its device;
    config.linear_maps' layers linearized with their feature maps first)."""
    if config.linear_maps is not None:
        from treeattn.linear.hybrid import load_feature_maps

        load_feature_maps(model, config.linear_maps)
    draft = None
    if config.draft_model is not None:
        from treeattn.models import load_model as load

        draft = config.draft_model
        draft = (load(draft, dtype=model.dtype, device=model.device, with_tokenizer=False) if isinstance(draft, str)
                 else draft.to(model.device, model.dtype))
    helix = None
    if config.tp is not None and config.nproc > 1:  # the Helix layout: this rank's share of the weights, its KV and TP groups
        from treeattn.engine.worker.tensor_parallel import helix_groups, shard_loaded

        helix = helix_groups(helix_layout(config, group), group)
        shard_loaded(model, helix.layout)
    fuse_projections(model)  # after sharding: each rank stacks its own q/k/v and gate/up rows (bit for bit the same products)
    pack_arena(model)  # its packed weights in one allocation of huge pages (the same values)
    set_activation_format(model, config.activation_format)  # how its packed layers multiply decode steps (EngineConfig)
    set_prefill_dtype(model, config.prefill_dtype)  # and prefill chunks
    runner = RankRunner(model, group=group, blocks_per_rank=config.blocks_per_rank(model.config.max_position_embeddings),
                        block_size=config.block_size, decode=config.decode if config.nproc > 1 else "local", method=config.method,
                        shared_memory=config.shared_memory, timeout_s=config.timeout_s, draft_model=draft,
                        decode_step=config.decode_step, prefill=config.prefill, max_batch_size=config.max_batch_size,
                        kv_cache_dtype=resolve_kv_cache_dtype(config.kv_cache_dtype, model.dtype), helix=helix)
    runner.block_store = None  # the prefix cache's disk tier (treeattn.engine.kv_tier): not for a linear hybrid
    if config.kv_store is not None and runner.linear_states is None:
        from treeattn.engine.kv_tier import RankKVStore

        runner.block_store = RankKVStore(runner.cache, model, config.kv_store, config.kv_store_bytes, runner.windows)
    return runner


def helix_layout(config: EngineConfig, group=None):
    """This rank's HelixLayout of `config` (config.tp set) in `group` (None: the world; rank 0 alone
    without torch.distributed)."""
    from treeattn.engine.worker.tensor_parallel import HelixLayout

    rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
    return HelixLayout(world_size=config.nproc, tp=config.tp, rank=rank)


def run_plan(runner: RankRunner, plan):
    """What every rank does with a plan: a step (its StepOutcome), a keepalive (nothing), a decode
    switch (nothing to return), or a measurement (every rank's RankMeasurements, gathered on every rank)."""
    if plan == KEEPALIVE:
        return StepOutcome()
    if isinstance(plan, SetDecode):
        runner.set_decode(plan.decode, plan.method)
        return StepOutcome()
    if isinstance(plan, (Measure, StoreOps)):
        mine = (runner.measurements(plan.reset) if isinstance(plan, Measure)
                else runner.block_store.apply(plan, runner.rank))
        if runner.world_size == 1:
            return [mine]
        everyone = [None] * runner.world_size
        dist.all_gather_object(everyone, mine, group=runner.group)
        return everyone
    return runner.step(plan)


def no_delay(conn) -> None:
    """Turn off Nagle's algorithm on the socket under a multiprocessing Connection (the driver's line to
    rank 0 is TCP on 127.0.0.1): the driver sends a step's plan and then its structured-output masks as
    two writes, and with Nagle the second waited for rank 0's delayed ACK, 10-15 ms a token."""
    with socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:  # a dup: the option is the socket's
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def serve_steps(runner: RankRunner, receive, reply) -> None:
    """A rank's loop: take the next plan (rank 0 from `receive`: the driver's encoded plan, bytes, or
    None when the driver is gone; the others by broadcast), run it, (rank 0) `reply` with what it gave.
    Ends on a None plan."""
    rank = runner.rank
    wire = PlanWire(plan_device(runner.group))
    while True:
        if rank == 0:
            message = receive()
            plan = wire.relay(encode(None) if message is None else message, runner.group)
        else:
            plan = wire.receive(runner.group)
        if plan is None:
            return
        try:
            outcome = run_plan(runner, plan)
        except BaseException as exc:
            if rank == 0:
                reply(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
            raise
        if rank == 0:
            reply(("ok", outcome))


def rank_main(rank: int, world_size: int, address, authkey: bytes, model, config: EngineConfig) -> None:
    """Body of a spawned rank: build the model and cache, then serve steps until the driver ends."""
    torch.set_num_threads(config.threads_per_rank or rank_threads(world_size))
    device = rank_device(config.device, rank)  # config.device is "cpu" or "cuda" here (Engine resolved "auto")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    layout = helix_layout(config) if config.tp is not None else None  # the world's group is up (ta.spawn)
    model = load_model(model, config.dtype, device, config.weight_format, layout)
    logger.debug("rank %d: model loaded", rank)
    runner = make_runner(model, config)
    logger.debug("rank %d: runner ready", rank)
    if rank != 0:
        serve_steps(runner, None, None)
        return
    with Client(address, authkey=authkey) as conn:
        no_delay(conn)
        conn.send(("ready", model_info(model, runner)))

        def receive():
            try:
                # The plan's words as the driver packed them, rank 0's sampling part included (plan_message).
                message = conn.recv_bytes()
                while is_masks(message):  # a failed step's masks, never read: not a plan
                    message = conn.recv_bytes()
                return message
            except (EOFError, OSError):  # the driver is gone: end every rank
                return None

        def receive_masks():
            """The step's structured-output masks: the driver's next message, sent after the plan while
            the step ran (engine.structured)."""
            message = decode(conn.recv_bytes())
            if not isinstance(message, StepMasks):
                raise RuntimeError(f"rank 0 expected the step's StepMasks from the driver, got {type(message).__name__}")
            return message

        runner.receive_masks = receive_masks
        serve_steps(runner, receive, conn.send)
