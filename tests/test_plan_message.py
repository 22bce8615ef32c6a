"""The per-step plan as one int32 tensor (treeattn.engine.plan_message): exact round trips, the
refusal of values past int32, and the broadcast between real gloo ranks (one NCCL rank on a GPU)."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import treeattn as ta
from treeattn.cache.blocks import BlockRef
from treeattn.engine.plan_message import CAPACITY, KEEPALIVE, Measure, PlanWire, SetDecode, decode, encode, plan_device
from treeattn.engine.scheduler import Chunk, SampleSpec, StepPlan


def sample_plans() -> list:
    greedy = SampleSpec(0.0, 0, 1.0, 0)
    odd = SampleSpec(0.7123456789012345, 50, 0.9000000000000001, 2**64 - 1, 5)
    long_prefill = Chunk(9, tuple(range(3000)), 0, tuple(BlockRef(r % 2, r) for r in range(12)), greedy)
    return [
        None, KEEPALIVE, Measure(True), Measure(False), SetDecode("ring", "allreduce"), SetDecode("tree", "twolevel"),
        StepPlan((), (3, 4)),
        StepPlan((Chunk(0, (17,), 4095, tuple(BlockRef(r % 2, r // 2) for r in range(16)), greedy),)),
        StepPlan((Chunk(1, (5, 6, 7), 40, (BlockRef(1, 2),), odd, num_draft=2, draft_prefix=(4,)),
                  Chunk(2, tuple(range(100, 164)), 0, (BlockRef(0, 0), BlockRef(1, 0)), None)), release=(7,)),
        StepPlan((long_prefill,)),  # longer than the buffer: it grows
        StepPlan((Chunk(3, (8,), 32, (BlockRef(0, 1),), greedy),), release=(1,), window_saves=((1, 32, 0), (2, 48, 5)),
                 window_restores=((3, 0),), window_drops=(4, 6, 7)),  # a hybrid model's window checkpoints
    ]


def test_round_trip_is_exact():
    for plan in sample_plans():
        assert decode(encode(plan)) == plan


def test_decode_ignores_words_past_the_message():
    plan = sample_plans()[6]
    assert decode(encode(plan) + [123] * 50) == plan


def test_values_past_int32_are_refused_before_sending(monkeypatch):
    monkeypatch.setattr(dist, "broadcast", lambda *a, **k: pytest.fail("nothing may be sent"))
    plan = StepPlan((Chunk(0, (2**31,), 0, (BlockRef(0, 0),), None),))
    with pytest.raises(ValueError, match="outside int32"):
        PlanWire().send(plan)


def test_anything_else_is_refused():
    with pytest.raises(TypeError, match="plan must be"):
        encode({"chunks": []})
    with pytest.raises(ValueError, match="SetDecode: decode must be one of .* got 'pipe' and 'onepass'"):
        encode(SetDecode("pipe", "onepass"))


def _follow(rank, world_size, plans):
    wire = PlanWire(plan_device())
    assert wire.device == torch.device("cpu")
    got = [wire.broadcast(plan if rank == 0 else None, rank) for plan in plans]
    return got, wire.buffer.numel()


def test_every_rank_gets_rank_zeros_plans():
    plans = sample_plans()[::-1] + sample_plans()  # the long one first, then short ones in the grown buffer
    for got, capacity in ta.spawn(_follow, 3, plans, timeout=60):
        assert got == plans
        assert capacity == 4096 > CAPACITY  # every rank grew its buffer the same way


def _one_rank_nccl(plans):
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)
        try:
            wire = PlanWire(plan_device())
            assert wire.buffer.is_cuda
            out = []
            for plan in plans:
                wire.send(plan)
                out.append(wire.receive())  # a group of one: the broadcast leaves rank 0's message in the buffer
            return out
        finally:
            dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nccl_buffer_on_the_gpu():
    plans = sample_plans()
    assert _one_rank_nccl(plans) == plans
