"""The graph-safe pieces the engine's static decode step stands on (treeattn.engine.worker.static_step).

On the CPU:
- generate(decode_step="static") gives the tokens of generate() on p = 1 and 2 gloo ranks, tree and
  ring, with a sliding window that bites; the step itself against the dynamic step, with the guard:
  tests/test_engine_static_step.py;
- `no_host_sync()` (conftest), a guard that fails on any host read of a tensor (.item(),
  .tolist(), .cpu(), bool(), int(), ...), is shown to catch the host reads of the dynamic path
  (ops.attention's checks, ring_decode's gather);
- graph_safe_attention against the float64 reference, and its CUDA branch (the Triton kernel with
  kv_len as the paged seq_lens) through Triton's interpreter;
- ring_decode's shard_lengths (no gather), tree_decode's kv_len, the static cache API.
One spawn of 2 ranks runs every multi-rank case.

Marked gpu (skipped without CUDA): generate(decode_step="graph") equals generate().
"""

from __future__ import annotations

import pytest
import torch

from conftest import HAS_CUDA, HostSyncError, gpu, interpreted_triton_decode, no_host_sync, use_triton_interpreter

use_triton_interpreter()  # the kernel branch runs on CPU tensors through Triton's interpreter (see test_triton_decode)

from treeattn.cache import INVISIBLE_POSITION, ShardedKVCache  # noqa: E402
from treeattn.engine.generate import generate  # noqa: E402
from treeattn.models import LlamaConfig, random_model  # noqa: E402
from treeattn.ops import attention, reference_attention  # noqa: E402
from treeattn.ops.graph_safe import graph_safe_attention, kernel_attention  # noqa: E402
from treeattn.parallel import comm, comm_stats, ring_decode, spawn, tree_decode  # noqa: E402

# every layer windowed (Mistral-like): a window layer beside a global one makes a hybrid cache, which
# static steps refuse since issue 27 (docs/engine.md)
CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, layer_windows=(6, 6))
PROMPTS = [[5, 17, 3, 42, 8, 23, 61, 9, 30], [11, 2, 50, 7, 19]]  # left-padded to 9
CAPACITY, BLOCK, STEPS = 24, 4, 6  # contiguous on 2 ranks: the decode tokens cross from rank 0 to rank 1

def make_model(dtype=torch.float32, device="cpu"):
    return random_model(CONFIG, seed=3, std=0.2, dtype=dtype).to(device)


# ---------------------------------------------------------------- multi-rank (one spawn)

def _ranks_main(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    model = make_model()
    out: dict = {}
    for decode in ("tree", "ring"):
        # method="allreduce": the static step's default; the dynamic default (onepass) sends other bytes
        options = dict(max_new_tokens=8, decode=decode, method="allreduce", max_context=CAPACITY, block_size=BLOCK,
                       prefill="split")
        dynamic = generate(model, PROMPTS, **options)
        static = generate(model, PROMPTS, decode_step="static", **options)
        out[f"generate-{decode}"] = (dynamic.generated_ids, static.generated_ids, dynamic.token_logprobs,
                                     static.token_logprobs, dynamic.comm_bytes_per_rank, static.comm_bytes_per_rank,
                                     static.decode_step)
    out.update(_parallel_cases(rank))
    return out


def _errors(fn) -> str | None:
    try:
        fn()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _parallel_cases(rank: int) -> dict:
    """ring_decode with shard_lengths, graph-safe tree_decode with kv_len, the guard on the dynamic path."""
    out = {}
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 1, 4, 16, generator=g)
    lengths = [5, 3]
    shards = [(torch.randn(2, n, 2, 16, generator=g), torch.randn(2, n, 2, 16, generator=g)) for n in lengths]
    k, v = shards[rank]
    kv_pos = torch.arange(sum(lengths[:rank]), sum(lengths[: rank + 1])).expand(2, -1)
    q_pos = torch.tensor([[6], [7]])

    default, _ = ring_decode(q, k, v, q_pos=q_pos, kv_pos=kv_pos)
    with comm_stats() as unchecked:
        given, _ = ring_decode(q, k, v, q_pos=q_pos, kv_pos=kv_pos, check_inputs=False, shard_lengths=lengths)
    with comm_stats() as checked:
        compared, _ = ring_decode(q, k, v, q_pos=q_pos, kv_pos=kv_pos, shard_lengths=lengths)
    with no_host_sync():
        graph_safe, _ = ring_decode(q, k, v, q_pos=q_pos, kv_pos=kv_pos, check_inputs=False, shard_lengths=lengths,
                                    graph_safe=True)
    out["ring-shard-lengths"] = (torch.equal(default, given), torch.equal(default, compared),
                                 unchecked.by_op["allgather"].calls, checked.by_op["allgather"].calls,
                                 float((graph_safe - default).abs().max()))
    disagreeing = [5, 99] if rank == 0 else [98, 3]
    out["ring-disagreeing-lengths"] = _errors(lambda: ring_decode(q, k, v, q_pos=q_pos, kv_pos=kv_pos, shard_lengths=disagreeing))
    out["ring-graph-safe-needs-lengths"] = _errors(
        lambda: ring_decode(q, k, v, q_pos=q_pos, kv_pos=kv_pos, check_inputs=False, graph_safe=True))
    out["tree-graph-safe-needs-unchecked"] = _errors(lambda: tree_decode(q, k, v, q_pos=q_pos, kv_pos=kv_pos, graph_safe=True))

    # kv_len hides the tail of a preallocated buffer even where its positions would be visible
    tail = 4
    k_buffer = torch.cat([k, torch.randn(2, tail, 2, 16, generator=g)], dim=1)
    v_buffer = torch.cat([v, torch.randn(2, tail, 2, 16, generator=g)], dim=1)
    pos_buffer = torch.cat([kv_pos, torch.zeros(2, tail, dtype=torch.int64)], dim=1)
    kv_len = torch.full((2,), lengths[rank])
    expected, expected_lse = tree_decode(q, k, v, q_pos=q_pos, kv_pos=kv_pos)
    with no_host_sync():
        got, got_lse = tree_decode(q, k_buffer, v_buffer, q_pos=q_pos, kv_pos=pos_buffer, check_inputs=False,
                                   graph_safe=True, kv_len=kv_len, method="allreduce")
    out["tree-kv-len"] = (float((got - expected).abs().max()), float((got_lse - expected_lse).abs().max()))

    # the guard sees the host reads of the dynamic path: ring_decode's gather of the shard lengths
    try:
        with no_host_sync():
            ring_decode(q, k, v, q_pos=q_pos, kv_pos=kv_pos, check_inputs=False)
        out["guard-on-gather"] = None
    except HostSyncError as exc:
        out["guard-on-gather"] = str(exc)
    return out


@pytest.fixture(scope="module")
def ranks():
    return spawn(_ranks_main, 2, timeout=120)


def test_generate_static_decode_gives_the_tokens_of_generate(ranks):
    for decode in ("tree", "ring"):
        results = [ranks[r][f"generate-{decode}"] for r in range(2)]
        for dyn_ids, static_ids, dyn_lp, static_lp, dyn_bytes, static_bytes, kind in results:
            assert kind == "static"
            assert static_ids == dyn_ids
            assert max(abs(a - b) for x, y in zip(dyn_lp, static_lp) for a, b in zip(x, y)) < 1e-4
        if decode == "tree":  # the same collectives per step: no gather, nothing extra
            assert results[0][5] == results[0][4]


def test_ring_decode_takes_shard_lengths_instead_of_gathering(ranks):
    for rank in range(2):
        same_unchecked, same_checked, gathers_unchecked, gathers_checked, graph_safe_diff = ranks[rank]["ring-shard-lengths"]
        assert same_unchecked and same_checked
        assert gathers_unchecked == 0 and gathers_checked == 1
        assert graph_safe_diff < 1e-5


def test_ring_decode_shard_lengths_that_disagree_fail_on_every_rank(ranks):
    messages = [ranks[r]["ring-disagreeing-lengths"] for r in range(2)]
    assert messages[0] is not None and messages[0] == messages[1]
    assert "shard_lengths" in messages[0]


def test_graph_safe_refuses_what_would_synchronize(ranks):
    for rank in range(2):
        assert "needs shard_lengths" in ranks[rank]["ring-graph-safe-needs-lengths"]
        assert "needs check_inputs=False" in ranks[rank]["tree-graph-safe-needs-unchecked"]


def test_tree_decode_kv_len_hides_the_unused_tail(ranks):
    for rank in range(2):
        out_diff, lse_diff = ranks[rank]["tree-kv-len"]
        assert out_diff < 1e-5 and lse_diff < 1e-5


def test_the_guard_catches_the_gather_of_the_dynamic_ring(ranks):
    for rank in range(2):
        message = ranks[rank]["guard-on-gather"]  # the metadata row goes to the device, the table comes back
        assert message is not None and ("torch.tensor" in message or "tolist" in message)


# ----------------------------------------------------------------------- one process


def test_the_guard_catches_host_reads():
    x = torch.arange(4)
    for read in (lambda: x.sum().item(), lambda: x.tolist(), lambda: x.cpu(), lambda: bool(x[0]), lambda: int(x[1]),
                 lambda: float(x[1]), lambda: range(x[2]), lambda: torch.tensor([1])):
        with no_host_sync(), pytest.raises(HostSyncError):
            read()
    assert x.sum().item() == 6 and bool(x[1]) and int(x[2]) == 2  # restored
    q, k, v = torch.randn(1, 1, 2, 8), torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8)
    with no_host_sync(), pytest.raises(HostSyncError):  # the generic path's visibility checks
        attention(q, k, v, causal=True, q_pos=torch.tensor([4]), kv_pos=torch.arange(5))


def test_generate_static_decode_on_one_process_bf16():
    model = make_model(torch.bfloat16)
    options = dict(max_new_tokens=6, max_context=CAPACITY)
    dynamic, static = generate(model, PROMPTS, **options), generate(model, PROMPTS, decode_step="static", **options)
    assert static.decode_step == "static" and dynamic.decode_step == "dynamic"
    assert static.generated_ids == dynamic.generated_ids
    assert static.kv_bytes_per_rank == dynamic.kv_bytes_per_rank


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_len", [False, True])
def test_graph_safe_attention_matches_the_reference(heads, dtype, with_len):
    Hq, Hkv = heads
    g = torch.Generator().manual_seed(Hq * 10 + Hkv)
    B, Sq, Sk, D = 2, 3, 40, 16
    q = torch.randn(B, Sq, Hq, D, generator=g).to(dtype)
    k, v = (torch.randn(B, Sk, Hkv, D, generator=g).to(dtype) for _ in range(2))
    kv_pos = torch.randint(0, 30, (B, Sk), generator=g)
    kv_pos[1, 7] = INVISIBLE_POSITION
    q_pos = torch.tensor([[-1, 12, 29], [3, 20, 29]])  # query 0 of sequence 0 sees no key
    kv_len = torch.tensor([25, 40]) if with_len else None
    with no_host_sync():
        out, lse = graph_safe_attention(q, k, v, q_pos=q_pos, kv_pos=kv_pos, kv_len=kv_len)
    hidden = kv_pos.clone()
    if with_len:
        hidden[0, 25:] = INVISIBLE_POSITION
    ref_out, ref_lse = reference_attention(q, k, v, causal=True, q_pos=q_pos, kv_pos=hidden)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)) and bool(torch.isneginf(lse[0, :, 0]).all())
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)


def test_graph_safe_attention_edge_cases_and_bad_input():
    q = torch.randn(2, 1, 4, 16)
    empty = torch.randn(2, 0, 2, 16)
    out, lse = graph_safe_attention(q, empty, empty, kv_len=torch.zeros(2, dtype=torch.int64))
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())
    k = torch.randn(2, 5, 2, 16)
    no_positions, _ = graph_safe_attention(q, k, k)
    torch.testing.assert_close(no_positions, attention(q, k, k)[0])
    beyond, _ = graph_safe_attention(q, k, k, kv_len=torch.tensor([9, 5]))  # clamped to Sk on the device
    torch.testing.assert_close(beyond, no_positions)
    with pytest.raises(ValueError, match=r"kv_len must be a tensor of shape \(B,\) = \(2,\), got \(3,\)"):
        graph_safe_attention(q, k, k, kv_len=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="kv_len must be int32 or int64, got torch.float32"):
        graph_safe_attention(q, k, k, kv_len=torch.zeros(2))
    with pytest.raises(ValueError, match="given together"):
        graph_safe_attention(q, k, k, q_pos=torch.tensor([3]))


@pytest.mark.parametrize("with_len", [False, True])
def test_graph_safe_kernel_branch_through_the_triton_interpreter(with_len):
    """The CUDA branch (Triton kernel; kv_len as the paged seq_lens, one block per sequence)."""
    td = interpreted_triton_decode()
    device = "cuda" if HAS_CUDA else "cpu"
    g = torch.Generator().manual_seed(5)
    B, Sk, Hq, Hkv, D = 2, 37, 4, 2, 16
    q = torch.randn(B, 1, Hq, D, generator=g).to(device)
    k, v = (torch.randn(B, Sk, Hkv, D, generator=g).to(device) for _ in range(2))
    kv_pos = torch.arange(Sk).expand(B, Sk).clone()
    kv_pos[:, 30:] = INVISIBLE_POSITION
    q_pos = torch.tensor([[29], [12]])
    kv_len = torch.tensor([20, 30], device=device) if with_len else None
    out, lse = kernel_attention(td, q, k, v, scale=D ** -0.5, q_pos=q_pos.to(device), kv_pos=kv_pos.to(device), kv_len=kv_len)
    hidden = kv_pos.clone()
    if with_len:
        hidden[0, 20:] = INVISIBLE_POSITION
    ref_out, ref_lse = reference_attention(q.cpu(), k.cpu(), v.cpu(), causal=True, q_pos=q_pos, kv_pos=hidden)
    torch.testing.assert_close(lse.cpu().double(), ref_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.cpu().double(), ref_out, rtol=2e-5, atol=2e-5)


def test_graph_safe_kernel_branch_refuses_what_the_kernel_does_not_take():
    td = interpreted_triton_decode()
    q, k = torch.randn(1, 1, 4, 24), torch.randn(1, 5, 2, 24)  # head dim 24: not a power of two
    with pytest.raises(ValueError,
                       match="graph-safe attention needs the Triton decode kernel, which does not take head dims D=24"):
        kernel_attention(td, q, k, k, scale=1.0, q_pos=None, kv_pos=None, kv_len=None)


@pytest.mark.parametrize("placement", ["contiguous", "interleaved"])
def test_cache_locates_on_the_device_as_the_placement_does_on_the_host(placement):
    caches = [ShardedKVCache(num_layers=1, num_kv_heads=1, head_dim=2, capacity=23, batch_size=1, placement=placement,
                             block_size=4, rank=r, world_size=3) for r in range(3)]
    for slot in range(23):
        owner = int(caches[0].placement.owner(torch.tensor([slot])))
        local = int(caches[0].placement.local_slot(torch.tensor([slot])))
        for r, cache in enumerate(caches):
            local_slot, owned = cache.locate(torch.tensor([slot]))
            assert bool(owned) == (r == owner)
            assert 0 <= int(local_slot) < cache.local_capacity
            if r == owner:
                assert int(local_slot) == local


def test_cache_static_writes_touch_only_the_owned_slot():
    cache = ShardedKVCache(num_layers=2, num_kv_heads=1, head_dim=2, capacity=8, batch_size=2, block_size=4)
    cache._arena.fill_(float("nan"))  # what torch.empty may leave
    slots = cache.extend(torch.tensor([0, 1, 2]))
    cache.write(0, slots, torch.ones(2, 3, 1, 2), torch.ones(2, 3, 1, 2))
    cache.clear_unused()
    k, v = cache.static_layer(0)
    assert k.shape == (2, 8, 1, 2) and not bool(torch.isnan(k[:, 3:]).any()) and bool((k[:, 3:] == 0).all())
    assert cache.static_kv_pos[:, 3:].eq(INVISIBLE_POSITION).all() and cache.static_kv_pos[:, :3].eq(torch.arange(3)).all()
    slot = torch.tensor([3])
    new = torch.full((2, 1, 1, 2), 7.0)
    cache.store_at(1, slot, torch.tensor([False]), new, new)
    cache.store_positions_at(slot, torch.tensor([False]), torch.tensor([3, 3]))
    assert bool((cache.static_layer(1)[0][:, 3] == 0).all()) and cache.static_kv_pos[0, 3] == INVISIBLE_POSITION
    cache.store_at(1, slot, torch.tensor([True]), new, 2 * new)
    cache.store_positions_at(slot, torch.tensor([True]), torch.tensor([3, 1]))
    k1, v1 = cache.static_layer(1)
    assert bool((k1[:, 3] == 7).all()) and bool((v1[:, 3] == 14).all()) and cache.static_kv_pos[:, 3].tolist() == [3, 1]
    assert bool((cache.static_layer(0)[0][:, 3] == 0).all())  # other layers untouched
    cache.advance(1)
    assert (cache.length, cache.local_length) == (4, 4)
    with pytest.raises(ValueError, match="KV cache full"):
        cache.advance(5)


def test_generate_refuses_a_graph_without_cuda():
    model = make_model()
    with pytest.raises(ValueError, match="decode_step='graph' records CUDA graphs: the model must be on a CUDA device, got cpu"):
        generate(model, PROMPTS[0], max_new_tokens=2, decode_step="graph")
    with pytest.raises(ValueError, match="decode_step must be one of"):
        generate(model, PROMPTS[0], max_new_tokens=2, decode_step="yes")


def test_replayed_steps_add_their_captured_traffic():
    with comm_stats() as outer:
        with comm.separate_comm_stats() as captured:
            comm._record("allreduce", payload=8, sent=4.0, received=4.0)
        assert outer.calls == 0 and captured.by_op["allreduce"].calls == 1
        comm.record_replay(captured)
        comm.record_replay(captured)
    assert outer.by_op["allreduce"].calls == 2 and outer.bytes_sent == 8.0 and outer.by_op["allreduce"].payload_bytes == 16


# ------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@gpu
def test_gpu_generate_with_a_cuda_graph_gives_the_tokens_of_generate():
    model = make_model(torch.float32, "cuda")
    options = dict(max_new_tokens=8, max_context=CAPACITY)
    dynamic, graphed = generate(model, PROMPTS, **options), generate(model, PROMPTS, decode_step="graph", **options)
    assert graphed.decode_step == "graph"
    assert graphed.generated_ids == dynamic.generated_ids
