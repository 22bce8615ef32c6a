"""The per-step plan as one list of int32 words (treeattn.engine.plan_message): exact round trips of every
field (a property test over random plans), the refusal of values past int32, and the broadcast and rank 0's
relay between real gloo ranks (one NCCL rank on a GPU)."""

import os
import tempfile

import dataclasses

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import treeattn as ta
from treeattn.cache.blocks import BlockRef
from treeattn.engine.plan_message import (CAPACITY, KEEPALIVE, Measure, PlanWire, SetDecode, StoreOps, decode, encode,
                                          is_masks, pack, plan_device)
from treeattn.engine.scheduler import Chunk, SampleSpec, StepPlan
from treeattn.engine.structured import StepMasks


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


INT32 = st.integers(-(2**31), 2**31 - 1)
FLOATS = st.floats(allow_nan=False) | st.sampled_from([0.0, -0.0, 1.0, 0.1, 1e-300, float("inf")])
MASKS = st.lists(st.binary(min_size=0, max_size=40), max_size=3).map(tuple)


@st.composite
def sample_specs(draw):
    return SampleSpec(draw(FLOATS), draw(INT32), draw(FLOATS), draw(st.integers(0, 2**64 - 1)),
                      draw(st.none() | st.integers(0, 20)), draw(FLOATS), draw(FLOATS), draw(FLOATS), draw(FLOATS),
                      tuple(draw(st.lists(st.tuples(INT32, FLOATS), max_size=4))),
                      tuple(draw(st.lists(INT32, max_size=30))), tuple(draw(st.lists(INT32, max_size=30))),
                      draw(st.none() | MASKS))


@st.composite
def chunks(draw):
    ints = st.lists(INT32, max_size=20).map(tuple)
    blocks = st.lists(st.builds(BlockRef, st.integers(0, 7), INT32), max_size=8).map(tuple)
    return Chunk(draw(INT32), draw(st.lists(INT32, min_size=1, max_size=40).map(tuple)), draw(INT32), draw(blocks),
                 draw(st.none() | sample_specs()), draw(st.integers(0, 8)), draw(ints),
                 draw(st.none() | st.integers(0, 20)), draw(ints))


@st.composite
def step_plans(draw):
    triples = st.lists(st.tuples(INT32, INT32, INT32), max_size=3).map(tuple)
    pairs = st.lists(st.tuples(INT32, INT32), max_size=3).map(tuple)
    return StepPlan(tuple(draw(st.lists(chunks(), max_size=5))), tuple(draw(st.lists(INT32, max_size=5))),
                    draw(triples), draw(pairs), tuple(draw(st.lists(INT32, max_size=5))))


KEYS = st.lists(st.tuples(INT32, INT32, st.binary(min_size=16, max_size=16)), max_size=3).map(tuple)
PLANS = (step_plans() | st.builds(StoreOps, KEYS, KEYS, KEYS, KEYS) | st.builds(Measure, st.booleans())
         | st.sampled_from([None, KEEPALIVE, SetDecode("tree", "onepass"), SetDecode("ring", "tree")]))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(PLANS)
def test_every_field_survives_the_round_trip(plan):
    """decode(encode(plan)) == plan for random plans: every SampleSpec field (penalties, logit bias, the tokens
    the penalties count, structured bitmasks of any byte length, 64-bit seeds, floats as bits: -0.0 and inf too),
    prompt-logprob requests, drafts, window checkpoints; and through the tensor the driver sends rank 0."""
    assert decode(encode(plan)) == plan
    assert decode(pack(plan).numpy()) == plan  # the int32 tensor the broadcast sends
    assert repr(decode(encode(plan))) == repr(plan)  # -0.0 stays -0.0 (== alone would not tell)


def _without_rank_0_fields(plan: StepPlan) -> StepPlan:
    """`plan` as the ranks other than 0 decode it: the SampleSpec fields past logprobs at their defaults."""
    def cut(s):
        return None if s is None else SampleSpec(s.temperature, s.top_k, s.top_p, s.seed, s.logprobs)
    return dataclasses.replace(plan, chunks=tuple(dataclasses.replace(c, sample=cut(c.sample)) for c in plan.chunks))


def penalized_plan() -> StepPlan:
    spec = SampleSpec(0.8, 40, 0.95, 2**63 + 5, 3, 0.05, 0.5, -0.25, 1.3, ((7, -100.0), (9, 2.5)), tuple(range(900)),
                      (11, 12), (b"\xff\x00\x01\x80" * 300, b"\x01\x02\x03\x04" * 300))
    return StepPlan((Chunk(5, (1, 2), 77, (BlockRef(0, 3), BlockRef(1, 4)), spec, num_draft=1, prompt_logprobs=2,
                           targets=(8,)),), release=(2,))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(step_plans())
def test_the_ranks_part_is_the_plan_less_rank_0s_sampling_fields(plan):
    message = encode(plan)
    shared = memoryview(message).cast("i")[1]
    assert decode(message[: 4 * shared]) == _without_rank_0_fields(plan)


def test_rank_0s_sampling_fields_are_not_broadcast():
    words = memoryview(encode(penalized_plan())).cast("i")
    assert words[1] < 64 < len(words)  # 900 prompt ids and two 1200-byte masks stay past the ranks' part


def test_decode_ignores_words_past_the_message():
    plan = sample_plans()[6]
    assert decode(encode(plan) + bytes(range(200))) == plan


def test_values_past_int32_are_refused_before_sending(monkeypatch):
    monkeypatch.setattr(dist, "broadcast", lambda *a, **k: pytest.fail("nothing may be sent"))
    plan = StepPlan((Chunk(0, (2**31,), 0, (BlockRef(0, 0),), None),))
    with pytest.raises(ValueError, match="outside int32"):
        PlanWire().send(plan)
    spec = SampleSpec(1.0, 0, 1.0, 0, output_ids=(2**31,))  # rank 0's part too
    with pytest.raises(ValueError, match="outside int32"):
        encode(StepPlan((Chunk(0, (1,), 0, (BlockRef(0, 0),), spec),)))


def test_anything_else_is_refused():
    with pytest.raises(TypeError, match="plan must be"):
        encode({"chunks": []})
    with pytest.raises(ValueError, match="SetDecode: decode must be one of .* got 'pipe' and 'onepass'"):
        encode(SetDecode("pipe", "onepass"))


def _follow(rank, world_size, plans, relayed):
    wire = PlanWire(plan_device())
    assert wire.device == torch.device("cpu")
    got = [wire.broadcast(plan if rank == 0 else None, rank) for plan in plans]
    # SpawnedRanks' path: rank 0 relays the words the driver encoded, the others receive them
    relays = [wire.relay(bytes(encode(plan))) if rank == 0 else wire.receive() for plan in relayed]
    return got, wire.buffer.numel(), relays


def test_every_rank_gets_rank_zeros_plans():
    plans = sample_plans()[::-1] + sample_plans()  # the long one first, then short ones in the grown buffer
    relayed = [penalized_plan(), *sample_plans(), None]
    for rank, (got, capacity, relays) in enumerate(ta.spawn(_follow, 3, plans, relayed, timeout=60)):
        assert got == plans
        assert capacity == 4096 > CAPACITY  # every rank grew its buffer the same way
        if rank == 0:
            assert relays == relayed  # rank 0 samples with every field
        else:
            assert relays == [_without_rank_0_fields(p) if isinstance(p, StepPlan) else p for p in relayed]
            assert relays[0] != relayed[0]  # the penalties did not travel past rank 0, so the comparison can fail


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


@settings(max_examples=50, deadline=None)
@given(st.dictionaries(st.integers(0, 2**31 - 1), st.lists(st.binary(max_size=40), max_size=3).map(tuple), max_size=4))
def test_step_masks_travel_in_the_same_words(masks):
    """A step's structured-output masks (sent to rank 0 after the plan) round-trip exactly, odd byte lengths
    included, and is_masks tells them from every plan kind (rank 0 skips a failed step's stale masks)."""
    message = encode(StepMasks(masks))
    assert decode(message) == StepMasks(masks)
    assert is_masks(message)
    for plan in (None, KEEPALIVE, Measure(reset=True), SetDecode("tree", "onepass"), StepPlan((), ())):
        assert not is_masks(encode(plan))
