"""The engine's static decode step (decode_step="static" / "graph", treeattn.engine.worker.static_step).

On the CPU:
- greedy tokens with static decode steps equal each request alone (ta.generate, whose tokens are
  checked against an uncached recomputation; the dynamic engine equals them too, test_engine*.py)
  on p = 1, 2, 3 ranks (sub-groups of one spawn), tree (allreduce and tree combines) and ring
  decoding, both placements, the prefix cache on, under cache pressure; requests of different
  lengths join (staggered) and leave, so the batch bucket changes; sampled tokens equal the dynamic
  engine's with the same seeds;
- one static step equals the dynamic step on the same plan (three sequences padded to a bucket of
  four, one starting a new block, sequences spanning two ranks), and runs without any host read
  (conftest's no_host_sync guard); the paged read (CUDA's: the Triton paged kernel over
  the arena, no gather) gives the same through Triton's interpreter;
- bad options fail with one line naming the option.
Skipped without CUDA (no GPU was available when they were written, so they have not run yet): the
engine with decode_step="graph" gives the tokens of decode_step="static" and captures one graph per
shape, and a graphed step never synchronizes.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import treeattn as ta
from conftest import gpu, interpreted_triton_decode, no_host_sync, use_triton_interpreter
from helpers.speculate_engine import BLOCK, CONFIG, PLENTY, REQUESTS, SAMPLED, TIGHT, _greedy_alone, _model
from treeattn.cache.blocks import BlockRef
from treeattn.engine import SamplingParams
from treeattn.engine.config import ConfigError
from treeattn.engine.worker.batch import PagedBatch
from treeattn.engine.worker.runner import RankRunner
from treeattn.engine.scheduler import Chunk, StepPlan
from treeattn.engine.worker.static_step import StaticDecodeStep, StaticShape, batch_buckets, width_bucket
from treeattn.parallel import spawn

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one torch thread (conftest.py)

use_triton_interpreter()  # the paged read's kernel branch through Triton's interpreter, in the ranks too

CASES = [
    (1, dict(decode="local", placement="contiguous", **PLENTY)),
    (2, dict(decode="tree", placement="contiguous", **TIGHT)),  # sequences cross from rank 0 to rank 1
    (2, dict(decode="ring", placement="interleaved", shared_memory=False, **PLENTY)),
    (3, dict(decode="tree", method="tree", placement="interleaved", **TIGHT)),
    (3, dict(decode="ring", placement="contiguous", **PLENTY)),
]


def _run(engine) -> dict:
    """The greedy requests (four first, the rest once the fourth is decoding) and the sampled ones."""
    handles = [engine.submit(prompt, SamplingParams(max_new_tokens=n)) for prompt, n in REQUESTS[:4]]
    for _ in zip(handles[3], range(2)):
        pass
    handles += [engine.submit(prompt, SamplingParams(max_new_tokens=n)) for prompt, n in REQUESTS[4:]]
    sampled = [engine.submit(REQUESTS[i][0], params) for i, params in enumerate(SAMPLED)]
    return dict(tokens=[h.result(timeout=120).token_ids for h in handles],
                sampled=[h.result(timeout=120).token_ids for h in sampled])


def _engine_cases(rank: int, world_size: int) -> list[dict]:
    torch.set_num_threads(1)
    model = _model()
    groups = {1: dist.new_group([0]), 2: dist.new_group([0, 1]), 3: None}
    out = []
    for p, options in CASES:
        if rank >= p:
            continue
        with ta.Engine(model, group=groups[p], timeout_s=60, decode_step="static", **options) as engine:
            if not engine.is_driver:
                continue
            run = _run(engine)
            step = engine._channel.runner.static_step
            engine.clear_prefix_cache()
            out.append(dict(p=p, options=options, **run, static_steps=step.steps, shapes=step.shapes, method=engine.config.method,
                            stats=engine.stats()))
    one_step = _one_step(rank, groups[2]) if rank < 2 else None
    return dict(engine=out, one_step=one_step)


@pytest.fixture(scope="module")
def runs():
    return spawn(_engine_cases, 3, timeout=300)


@pytest.fixture(scope="module")
def references():
    return _greedy_alone(_model())


@pytest.fixture(scope="module")
def sampled_references():
    """The sampled requests on the dynamic engine (one rank), seed for seed."""
    with ta.Engine(_model(), nproc=1, cache_tokens=512, block_size=BLOCK) as engine:
        return [engine.submit(REQUESTS[i][0], params).result(timeout=60).token_ids for i, params in enumerate(SAMPLED)]


def test_every_configuration_ran_static_steps_of_several_shapes(runs):
    assert [(r["p"], r["options"]) for r in runs[0]["engine"]] == CASES
    for r in runs[0]["engine"]:
        assert r["method"] == ("tree" if r["options"].get("method") == "tree" else "allreduce")
        assert r["static_steps"] > 20
        assert len({s.batch for s in r["shapes"]}) >= 3  # the batch bucket changed as requests joined and left
        assert len({s.blocks for s in r["shapes"]}) >= 2


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"p{p}-{o['decode']}-{o['placement']}" for p, o in CASES])
def test_static_steps_give_each_request_its_greedy_tokens_alone(runs, references, case):
    assert runs[0]["engine"][case]["tokens"] == references


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"p{p}-{o['decode']}-{o['placement']}" for p, o in CASES])
def test_sampled_tokens_equal_the_dynamic_engine_seed_for_seed(runs, sampled_references, case):
    assert runs[0]["engine"][case]["sampled"] == sampled_references


def test_no_block_leaks(runs):
    for r in runs[0]["engine"]:
        assert r["stats"]["blocks_used"] == 0, r["stats"]


# ------------------------------------------------------------------------------ one step


def _plans(world_size: int = 2):
    """A prefill plan of three sequences (lengths 7, 4, 10) and the decode step after it; blocks of
    4 on 2 ranks of 4 blocks each: sequences 1 and 2 span both ranks; sequence 1's new token
    starts a new block (on rank 1). world_size=1: the same tables on one rank of 8 blocks (rank 1's
    block i becomes block 4 + i)."""
    g = torch.Generator().manual_seed(1)
    lengths = (7, 4, 10)
    tables = [(BlockRef(0, 0), BlockRef(0, 1)), (BlockRef(0, 2), BlockRef(1, 0)), (BlockRef(1, 1), BlockRef(1, 2),
                                                                                   BlockRef(0, 3))]
    if world_size == 1:
        tables = [tuple(BlockRef(0, 4 * ref.rank + ref.index) for ref in table) for table in tables]
    # sequence 2 is placed by hand (block 2 on rank 0) to cover a table whose local blocks are not the leading ones
    prompts = [torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist() for n in lengths]
    prefill = StepPlan(tuple(Chunk(i, tuple(p), 0, t, None) for i, (p, t) in enumerate(zip(prompts, tables))))
    decode = StepPlan(tuple(Chunk(i, (5 + i,), n, t, None) for i, (n, t) in enumerate(zip(lengths, tables))))
    return prefill, decode


@contextlib.contextmanager
def _cuda_paths():
    """The row-wise ops' torch path, the one a CUDA step runs (and a CUDA graph captures): their
    compiled CPU kernel reads numpy views of CPU tensors, which no_host_sync counts as host reads."""
    from treeattn.ops import rowwise

    kernel, rowwise._kernel = rowwise._kernel, lambda *args: None
    try:
        yield
    finally:
        rowwise._kernel = kernel


def _one_step(rank: int, group) -> dict:
    """On 2 ranks: the decode plan of _plans as one dynamic step (PagedBatch) and as one static step,
    gathered (allreduce and tree combines) and paged (the Triton kernel through its interpreter; also
    over an fp8 cache, whose dynamic step reads dequantized copies and the kernel codes and scales)."""
    prefill, decode = _plans()
    out = {}
    for read, method in (("gathered", "allreduce"), ("gathered", "tree"), ("paged", "allreduce"), ("paged-fp8", "allreduce")):
        runner = RankRunner(_model(), group=group, blocks_per_rank=4, block_size=BLOCK, decode="tree", method=method,
                            decode_step="static", max_batch_size=8,
                            kv_cache_dtype=torch.float8_e4m3fn if read == "paged-fp8" else None)
        if read.startswith("paged"):
            runner.static_step = StaticDecodeStep(runner.model, runner.cache, rank=rank, max_batch_size=8, decode="tree",
                                                  group=group, kernel=interpreted_triton_decode())
        with torch.inference_mode():
            runner.step(prefill)  # dynamic: prompt chunks
            batch = PagedBatch(decode, rank, runner.cache, runner.attend, None)
            dynamic = runner.model(batch.tokens, batch.positions, batch.kv_store, batch.attend)[0]
            with _cuda_paths():  # the step and its replay alike
                static = runner.static_step(decode).clone()
                buffers = runner.static_step._buffers[runner.static_step.shape_of(decode)]
                with no_host_sync() if read == "gathered" else contextlib.nullcontext():  # the interpreter reads the host
                    runner.static_step._run(buffers)
            again = buffers.hidden[:3].clone()
        out[f"{read}-{method}"] = dict(diff=float((static - dynamic).abs().max()), again=torch.equal(again, static),
                           shape=runner.static_step.shape_of(decode), scale=float(dynamic.abs().max()))
    return out


def test_one_static_step_equals_the_dynamic_step_and_never_reads_the_host(runs):
    for result in (runs[0]["one_step"], runs[1]["one_step"]):
        assert sorted(result) == ["gathered-allreduce", "gathered-tree", "paged-allreduce", "paged-fp8-allreduce"]
        for method, r in result.items():
            assert r["shape"] == StaticShape(batch=4, blocks=2), method
            assert r["diff"] < 1e-5 * max(1.0, r["scale"]), (method, r)
            assert r["again"], method


def test_batch_and_width_buckets():
    assert batch_buckets(16) == (1, 2, 4, 8, 16)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert batch_buckets(1) == (1,)
    assert [width_bucket(n, 100) for n in range(1, 26)] == [1, 2, 3, 4, 6, 6, 8, 8, *[12] * 4, *[16] * 4, *[24] * 8, 32]
    assert (width_bucket(17, 20), width_bucket(5, 4)) == (20, 5)  # at most the pool, never fewer than needed


# ------------------------------------------------------------------------------ bad options


@pytest.mark.parametrize("options, option, match", [
    (dict(decode_step="fast"), "decode_step", r"decode_step must be one of \('dynamic', 'static', 'graph'\), got 'fast'"),
    (dict(decode_step="static", method="onepass"), "method", "method='onepass' reads one flag on the host.*decode_step='static'"),
    (dict(decode_step="static", speculate="ngram"), "speculate",
     "speculate='ngram' verifies several tokens.*decode_step='static'"),
    pytest.param(dict(decode_step="graph"), "decode_step", "decode_step='graph' records CUDA graphs: the model must be on a CUDA "
                 "device, got cpu", id="graph-on-cpu"),
])
def test_bad_options_fail_with_one_line_naming_the_option(options, option, match):
    with pytest.raises(ConfigError, match=match) as raised:
        ta.Engine(_model(), nproc=1, **options)
    assert raised.value.option == option and "\n" not in str(raised.value)


def test_static_steps_default_to_the_allreduce_combine():
    with ta.Engine(_model(), nproc=1, decode_step="static", cache_tokens=64, block_size=BLOCK) as engine:
        assert engine.config.method == "allreduce" and engine.config.decode_step == "static"
    with ta.Engine(_model(), nproc=1, cache_tokens=64, block_size=BLOCK) as engine:
        assert engine.config.method == "onepass" and engine.config.decode_step == "dynamic"


# ------------------------------------------------------------------------------ GPU


def _cuda_tokens(decode_step: str, dtype=torch.float32) -> tuple[list[list[int]], list]:
    model = _model().to("cuda", dtype)
    with ta.Engine(model, nproc=1, decode_step=decode_step, **PLENTY) as engine:
        handles = [engine.submit(prompt, SamplingParams(max_new_tokens=n)) for prompt, n in REQUESTS]
        tokens = [h.result(timeout=120).token_ids for h in handles]
        step = engine._channel.runner.static_step
        return tokens, [(s, step._buffers[s].graph is not None) for s in step.shapes]


@pytest.mark.gpu
@gpu
def test_gpu_graph_steps_give_the_tokens_of_static_steps(references):
    static, _ = _cuda_tokens("static")
    graphed, shapes = _cuda_tokens("graph")
    assert graphed == static == references
    assert len(shapes) >= 3 and all(captured for _, captured in shapes)


@pytest.mark.gpu
@gpu
def test_gpu_a_replayed_step_never_synchronizes():
    prefill, decode = _plans(world_size=1)
    runner = RankRunner(_model().to("cuda"), group=None, blocks_per_rank=8, block_size=BLOCK, decode="local", decode_step="graph",
                        max_batch_size=8)
    with torch.inference_mode():
        runner.step(prefill)
        expected = runner.static_step(decode).clone()  # captured here
        buffers = runner.static_step._buffers[runner.static_step.shape_of(decode)]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            buffers.graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        assert torch.equal(buffers.hidden[:3], expected)

