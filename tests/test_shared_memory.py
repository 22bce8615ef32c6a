"""treeattn.parallel.shared_memory: collectives through one shared mapping, on real gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import treeattn as ta
from treeattn.parallel import comm
from treeattn.parallel import shared_memory as shm_module
from treeattn.parallel.shared_memory import SharedMemoryGroup
from treeattn.parallel.spawn import SpawnError
from treeattn.parallel.tree_decode import METHODS


def _segments_of(pids: set[int]) -> set[str]:
    """The shared-memory segments in /dev/shm made by these processes (the name holds its maker's pid:
    treeattn-<pid>-<random>): only this test's ranks, not those of a test running beside it (pytest-xdist)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith(tuple(f"treeattn-{pid}-" for pid in pids))}


def _collectives(rank: int, world_size: int) -> dict:
    group = SharedMemoryGroup.create(None, capacity_bytes=256)
    assert isinstance(group, SharedMemoryGroup)
    gen = torch.Generator().manual_seed(rank)
    out = {}
    for name, dtype in (("f64", torch.float64), ("f32", torch.float32), ("i64", torch.int64), ("bf16", torch.bfloat16)):
        x = (torch.randn(3, 5, generator=gen) * 100).to(dtype)
        mine, reference = x.clone(), x.clone()
        comm.all_reduce(mine, dist.ReduceOp.SUM, group)
        dist.all_reduce(reference, op=dist.ReduceOp.SUM)
        top, top_ref = x.clone(), x.clone()
        comm.all_reduce(top, dist.ReduceOp.MAX, group)
        dist.all_reduce(top_ref, op=dist.ReduceOp.MAX)
        out[name] = (mine, reference, top, top_ref)
    out["gather"] = comm.all_gather(torch.tensor([rank, 10 * rank]), group)
    out["broadcast"] = comm.broadcast(torch.full((4,), float(rank)), 2, group)
    big = torch.full((100,), float(rank + 1), dtype=torch.float64)  # 800 bytes > 256: through gloo
    out["big"] = comm.all_reduce(big, dist.ReduceOp.SUM, group)
    out["fits"] = (group.fits(big), group.fits(torch.zeros(4)), group.fits(torch.zeros(4), dist.ReduceOp.MIN))
    return out


SHM_METHODS = [m for m in METHODS if m != "twolevel"]


def _three_ranks(rank: int, world_size: int) -> dict:
    """One spawn for the 3-rank tests (rank start-up dominates): the collectives, then tree_decode
    through shared memory by every method, each on a SharedMemoryGroup of its own."""
    return {"collectives": _collectives(rank, world_size),
            "tree_decode": {method: _tree_decode_over_shm(rank, world_size, method) for method in SHM_METHODS},
            "pid": os.getpid()}


@pytest.fixture(scope="module")
def three_ranks() -> tuple[list[dict], set[str]]:
    """(each rank's results, the shared-memory segments its ranks made still in /dev/shm after the spawn)."""
    results = ta.spawn(_three_ranks, 3)
    return results, _segments_of({r["pid"] for r in results})


def test_collectives_match_gloo_and_are_identical_on_every_rank(three_ranks):
    per_rank, left = three_ranks
    results = [r["collectives"] for r in per_rank]
    for rank, out in enumerate(results):
        for name in ("f64", "f32", "i64", "bf16"):  # bfloat16: torch's reduction, the others numpy's
            mine, reference, top, top_ref = out[name]
            tolerance = 2 ** -7 if name == "bf16" else 1e-6  # gloo may round bfloat16 partial sums elsewhere
            torch.testing.assert_close(mine, reference, rtol=tolerance, atol=1e-4 if name != "bf16" else 1.0)
            assert torch.equal(mine, results[0][name][0])  # the same bytes on every rank
            assert torch.equal(top, top_ref)
        assert [t.tolist() for t in out["gather"]] == [[0, 0], [1, 10], [2, 20]]
        assert out["broadcast"].tolist() == [2.0] * 4
        assert out["big"].tolist() == [6.0] * 100
        assert out["fits"] == (False, True, False)
    assert left == set()  # each name is unlinked once every rank has mapped it


def _hosts_differ(rank: int, world_size: int, monkey: bool):
    if monkey:
        shm_module._host_key = lambda: f"host-{rank}"  # as if every rank ran on its own machine
    return SharedMemoryGroup.create(None) is None


def test_ranks_on_different_hosts_get_none_on_every_rank(two_ranks):
    assert [r["hosts differ"] for r in two_ranks] == [True, True]


def _missing_rank(rank: int, world_size: int) -> str:
    group = SharedMemoryGroup.create(None, timeout_s=0.5)
    if rank == 1:
        return "skipped"  # never joins the collective below
    try:
        comm.all_reduce(torch.ones(3), dist.ReduceOp.SUM, group)
    except TimeoutError as exc:
        return str(exc)
    return "returned"


def test_a_missing_rank_times_out_naming_it(two_ranks):
    message, skipped = (r["missing rank"] for r in two_ranks)
    assert skipped == "skipped"
    assert "rank(s) [1] did not arrive within 0.5 s" in message


def _counted_waits(rank: int, world_size: int) -> tuple:
    SharedMemoryGroup.count_waits = True  # this rank's process only
    group = SharedMemoryGroup.create(None)
    SharedMemoryGroup.count_waits = False
    comm.all_reduce(torch.ones(3), dist.ReduceOp.SUM, group)  # sequence 1: stamps in word _STAMP + 1
    stamps = [group._flags[i + shm_module._STAMP + 1] for i in group._flag_indices]
    return group.waits, stamps, group._flags[group._flag_indices[rank] + shm_module._STAMP + 1]


def test_counted_waits_split_each_wait_into_the_peers_lateness_and_the_handoff():
    """SharedMemoryGroup.count_waits: every rank reads every rank's arrival time, so each rank's late_ns
    is the last arrival minus its own (the last rank's is 0) and its handoff is what remains of its wait."""
    results = ta.spawn(_counted_waits, 2)
    (waits0, stamps, _), (waits1, stamps1, _) = results
    assert stamps == stamps1 and all(s > 0 for s in stamps)
    assert [w.calls for w in (waits0, waits1)] == [1, 1]
    assert [w.late_ns for w in (waits0, waits1)] == [max(stamps) - mine for _, _, mine in results]
    assert min(waits0.late_ns, waits1.late_ns) == 0 and waits0.handoff_ns >= 0 and waits1.handoff_ns >= 0


def _tree_decode_over_shm(rank: int, world_size: int, method: str):
    group = SharedMemoryGroup.create(None)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 4, 8, generator=gen)
    k = torch.randn(2, 30, 2, 8, generator=gen)
    v = torch.randn(2, 30, 2, 8, generator=gen)
    q_pos = torch.arange(27, 30).expand(2, 3)
    kv_pos = torch.arange(30).expand(2, 30)
    shard = slice(10 * rank, 10 * rank + 10)
    out, lse = ta.tree_decode(q, k[:, shard], v[:, shard], group=group, method=method, q_pos=q_pos, kv_pos=kv_pos[:, shard])
    ref_out, ref_lse = ta.reference_attention(q.double(), k.double(), v.double(), causal=True, q_pos=q_pos, kv_pos=kv_pos)
    return (out.double() - ref_out).abs().max().item(), (lse.double() - ref_lse).abs().max().item(), out


@pytest.mark.parametrize("method", SHM_METHODS)
def test_tree_decode_through_shared_memory_is_exact(three_ranks, method):
    results = [r["tree_decode"][method] for r in three_ranks[0]]
    for err_out, err_lse, out in results:
        assert err_out < 1e-5 and err_lse < 1e-5
        assert torch.equal(out, results[0][2])


def _generate_both_ways(rank: int, world_size: int):
    from treeattn.models.llama import LlamaConfig, random_model

    model = random_model(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                                     num_kv_heads=2, head_dim=8, max_position_embeddings=256), seed=0)
    prompt = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    runs = {}
    for shared in (True, False):
        result = ta.generate(model, [prompt], max_new_tokens=6, shared_memory=shared)
        runs[shared] = (result.generated_ids, result.comm["rounds"])
    return runs


def test_generate_gives_the_same_tokens_and_rounds_with_and_without_shared_memory(two_ranks):
    for runs in (r["generate"] for r in two_ranks):
        assert runs[True] == runs[False]


def _two_ranks(rank: int, world_size: int) -> dict:
    """One spawn for three 2-rank checks (rank start-up dominates), in an order that leaves each the
    group it needs: generate with and without shared memory; ranks "on different hosts" (the host
    key restored after); a rank that never joins the collective (last: rank 1 leaves it)."""
    out = {"generate": _generate_both_ways(rank, world_size)}
    host_key = shm_module._host_key
    try:
        out["hosts differ"] = _hosts_differ(rank, world_size, True)
    finally:
        shm_module._host_key = host_key
    out["missing rank"] = _missing_rank(rank, world_size)
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return ta.spawn(_two_ranks, 2)


def test_the_option_must_be_a_bool():
    from treeattn.engine.config import EngineConfig

    with pytest.raises(ValueError, match="shared_memory must be a bool"):
        EngineConfig(shared_memory=1)


def _timeout_of_the_group(rank: int, world_size: int):
    from treeattn.parallel.shared_memory import group_timeout_s, shared_memory_group

    group = shared_memory_group(None)
    return group_timeout_s(None), group.timeout_s


def test_the_default_timeout_is_the_process_groups():
    for read, used in ta.spawn(_timeout_of_the_group, 2, timeout=17.0):
        assert read == used == 17.0


def test_docstring_examples_of_the_module():
    import doctest

    result = doctest.testmod(shm_module)
    assert result.failed == 0 and result.attempted > 0


def _die_holding_a_segment(rank: int, world_size: int, pid_file: str) -> None:
    """Rank 0 makes a segment as create()'s first rank does, then is SIGKILLed before it could unlink it (the
    start-up window: the others have not mapped it yet); rank 1 waits for it in a barrier."""
    import signal

    if rank == 0:
        path = f"{shm_module.SEGMENT_DIR}/{shm_module._segment_prefix(os.getpid())}startup"
        with open(path, "wb") as f:
            f.truncate(4096)
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_a_rank_killed_in_the_groups_start_up_leaves_no_segment(tmp_path):
    pid_file = tmp_path / "rank0.pid"
    with pytest.raises(SpawnError, match="rank 0"):
        ta.spawn(_die_holding_a_segment, 2, str(pid_file), timeout=60)
    pid = int(pid_file.read_text())
    assert _segments_of({pid}) == set()


def test_remove_segments_of_refuses_a_non_pid():
    with pytest.raises(ValueError, match="pid must be a process id"):
        shm_module.remove_segments_of(0)
