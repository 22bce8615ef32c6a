"""Bad input across ranks fails loudly and the same way on every rank; a dead rank never hangs the rest.

- Ranks that disagree on q's shape, dtype, scale, head counts, method, topology or positions all
  raise the same ValueError (the cross-rank metadata check).
- A rank whose own inputs are malformed raises its own error; the others name it.
- A rank that dies mid-collective makes the others raise within the group timeout (< 60 s).
- spawn reports which rank failed and with what.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from unittest import mock

import pytest
import torch

import treeattn as ta
from treeattn.parallel import SpawnError

B, SQ, HQ, HKV, D = 2, 1, 4, 2, 16


def make_inputs(rank: int, *, Hq=HQ, Hkv=HKV, Dk=D, dtype=torch.float32, Sq=SQ, Sk=5):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Sq, Hq, Dk, generator=g).to(dtype)
    g.manual_seed(10 + rank)
    k = torch.randn(B, Sk, Hkv, Dk, generator=g).to(dtype)
    v = torch.randn(B, Sk, Hkv, Dk, generator=g).to(dtype)
    return q, k, v


def mismatch_cases(rank: int):
    """name -> (callable run on this rank, substring every error must contain)."""
    base = make_inputs(rank)
    q, k, v = base
    shared_k = make_inputs(0)[1]  # the same on every rank
    return {
        "Hq": (lambda: ta.tree_decode(*make_inputs(rank, Hq=8 if rank == 1 else HQ)), "Hq (q.shape[2])"),
        "Hkv": (lambda: ta.tree_decode(*make_inputs(rank, Hkv=1 if rank == 1 else HKV), method="tree"), "Hkv (k.shape[2])"),
        "D": (lambda: ta.tree_decode(*make_inputs(rank, Dk=8 if rank == 2 else D)), "D (q.shape[3])"),
        "dtype": (lambda: ta.tree_decode(*make_inputs(rank, dtype=torch.bfloat16 if rank == 2 else torch.float32)), "dtype"),
        "scale": (lambda: ta.tree_decode(q, k, v, scale=0.5 if rank == 0 else None), "scale"),
        "method": (lambda: ta.tree_decode(q, k, v, method="tree" if rank == 1 else "allreduce"), "method"),
        "topology": (
            lambda: ta.tree_decode(q, k, v, method="twolevel", topology=ta.Topology(1 if rank == 0 else 3)),
            "ranks_per_node",
        ),
        "positions": (
            lambda: ta.tree_decode(q, k, v, q_pos=torch.tensor([9]),
                                   kv_pos=torch.arange(5)) if rank == 2 else ta.tree_decode(q, k, v),
            "positions given",
        ),
        "ring_decode Sq": (lambda: ta.ring_decode(*make_inputs(rank, Sq=2 if rank == 0 else 1)), "Sq (q.shape[1])"),
        "ring_decode pass_kv": (lambda: ta.ring_decode(q, k, v, pass_kv=rank != 1), "pass_kv"),
        # q, its positions and the decoded K/V must be the same on every rank: a checksum travels
        # with the metadata (a different q would otherwise be silently mixed into one result)
        "q values": (lambda: ta.tree_decode(q + 0.5 if rank == 1 else q, k, v), "same q,"),
        "q batch rows swapped": (lambda: ta.tree_decode(q.flip(0) if rank == 2 else q, k, v, method="tree"), "same q,"),
        "ring_decode q": (lambda: ta.ring_decode(q * 1.1 if rank == 0 else q, k, v, pass_kv=False), "same q,"),
        "q_pos values": (
            lambda: ta.tree_decode(q, k, v, q_pos=torch.tensor([5 if rank == 1 else 4]), kv_pos=torch.arange(5)),
            "same q_pos,",
        ),
        "bifurcated decode_k": (
            lambda: ta.sharded_bifurcated_attention(q, k[:1], v[:1], shared_k + (rank == 2), shared_k),
            "same decode_k,",
        ),
        "ring_attention dtype": (
            lambda: ta.ring_attention(*make_inputs(rank, dtype=torch.bfloat16 if rank == 1 else torch.float32, Sq=5)),
            "dtype",
        ),
    }


def run_and_capture(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return (type(exc).__name__, str(exc))
    return ("no error", "")


def errors_worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    report = {}
    for name, (fn, _) in mismatch_cases(rank).items():
        report[name] = run_and_capture(fn)
    q, k, v = make_inputs(rank)
    # a malformed tensor on rank 0 only
    report["local k on rank 0"] = run_and_capture(lambda: ta.tree_decode(q, k[0] if rank == 0 else k, v))
    report["local k on rank 0, ring"] = run_and_capture(lambda: ta.ring_decode(q, k[0] if rank == 0 else k, v))
    # the same bad argument everywhere
    report["unknown method"] = run_and_capture(lambda: ta.tree_decode(q, k, v, method="butterfly"))
    report["indivisible topology"] = run_and_capture(lambda: ta.tree_decode(q, k, v, method="twolevel", topology=ta.Topology(2)))
    report["q_pos without kv_pos"] = run_and_capture(lambda: ta.ring_decode(q, k, v, q_pos=torch.tensor([4])))
    # degenerate shapes: zero heads are refused on every rank; an empty batch is an empty result
    report["Hq=0 everywhere"] = run_and_capture(lambda: ta.tree_decode(*make_inputs(rank, Hq=0)))
    report["empty batch"] = [
        tuple(ta.tree_decode(q[:0], k[:0], v[:0], method=method)[0].shape) for method in ("allreduce", "tree")
    ] + [tuple(ta.ring_decode(q[:0], k[:0], v[:0], pass_kv=pass_kv)[0].shape) for pass_kv in (True, False)]
    # a q computed differently on each rank, equal up to rounding, is not an error
    report["q off by rounding"] = run_and_capture(lambda: ta.tree_decode(q * (1 + 3e-7 * rank), k, v))
    report["check_qkv calls"] = count_validations(lambda check: ta.tree_decode(q, k, v, check_inputs=check))
    # after all of that the group still works, and nested comm_stats both record
    with ta.comm_stats() as outer:
        with ta.comm_stats() as inner:
            out, lse = ta.tree_decode(q, k, v, method="tree")
    report["after"] = (out, lse, outer.as_dict(), inner.as_dict())
    return report


def count_validations(fn) -> dict[bool, int]:
    """check_inputs -> how many times fn(check_inputs) ran check_qkv (in the op's preamble or in
    the local attention)."""
    attention_module = importlib.import_module("treeattn.ops.attention")  # (the package exports a function of that name)
    inputs_module = importlib.import_module("treeattn.parallel.inputs")

    calls = []

    def counting(check):
        def wrapper(*args):
            calls.append(1)
            return check(*args)
        return wrapper

    counts = {}
    with mock.patch.object(attention_module, "check_qkv", counting(attention_module.check_qkv)), \
            mock.patch.object(inputs_module, "check_qkv", counting(inputs_module.check_qkv)):
        for check in (True, False):
            calls.clear()
            fn(check)
            counts[check] = len(calls)
    return counts


@pytest.fixture(scope="module")
def error_reports():
    return ta.spawn(errors_worker, 3, timeout=60)


@pytest.mark.parametrize("name", list(mismatch_cases(0)))
def test_disagreeing_ranks_all_raise_the_same_error(error_reports, name):
    expected = mismatch_cases(0)[name][1]
    outcomes = [r[name] for r in error_reports]
    assert all(kind == "ValueError" for kind, _ in outcomes), outcomes
    assert len({message for _, message in outcomes}) == 1, outcomes  # the same message on every rank
    assert expected in outcomes[0][1] and "rank 0" in outcomes[0][1] and "rank 2" in outcomes[0][1]


@pytest.mark.parametrize("name", ["local k on rank 0", "local k on rank 0, ring"])
def test_a_rank_with_bad_local_input_is_named_by_the_others(error_reports, name):
    own, *others = [r[name] for r in error_reports]
    assert own[0] == "ValueError" and "k must have 4 dims" in own[1]
    for kind, message in others:
        assert kind == "ValueError" and "rank(s) [0]" in message


@pytest.mark.parametrize(
    "name, expected",
    [("unknown method", "method must be one of"), ("indivisible topology", "multiple of"), ("q_pos without kv_pos",
                                                                                            "given together")],
)
def test_the_same_bad_argument_raises_everywhere(error_reports, name, expected):
    for kind, message in (r[name] for r in error_reports):
        assert kind == "ValueError" and expected in message


def test_check_inputs_false_validates_once(error_reports):
    """check_inputs=False skips the preamble's validation: only the local attention validates."""
    assert [r["check_qkv calls"] for r in error_reports] == [{True: 2, False: 1}] * 3


def test_degenerate_shapes_across_ranks(error_reports):
    for report in error_reports:
        kind, message = report["Hq=0 everywhere"]
        assert kind == "ValueError" and message.startswith("head counts must be positive, got Hq=0")
        assert report["empty batch"] == [(0, SQ, HQ, D)] * 4


def test_q_equal_up_to_rounding_is_accepted(error_reports):
    assert [r["q off by rounding"] for r in error_reports] == [("no error", "")] * 3


def test_group_still_works_after_errors(error_reports):
    outs = [r["after"] for r in error_reports]
    q, _, _ = make_inputs(0)
    k = torch.cat([make_inputs(r)[1] for r in range(3)], dim=1)
    v = torch.cat([make_inputs(r)[2] for r in range(3)], dim=1)
    ref_out, ref_lse = ta.attention(q, k, v)
    for out, lse, outer, inner in outs:
        torch.testing.assert_close(out, ref_out, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
        assert outer == inner and outer["by_op"]["allgather"]["calls"] == 1 and outer["by_op"]["p2p"]["calls"] >= 2


# ----------------------------------------------------------------------------- dead ranks


def dying_worker(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    q, k, v = make_inputs(rank)
    ta.tree_decode(q, k, v)  # everyone alive: works
    if rank == 1:
        time.sleep(1.0)  # the others are now waiting in the next collective
        os._exit(7)
    for _ in range(100):
        ta.tree_decode(q, k, v, method="allreduce")


def test_killed_rank_makes_the_others_fail():
    """No hang: the survivors' collectives raise. Checked by the cause (a backend error, not spawn
    terminating them), not by a wall-clock bound that a loaded machine can miss."""
    with pytest.raises(SpawnError) as raised:
        ta.spawn(dying_worker, 3, timeout=30)
    failures = raised.value.failures
    assert set(failures) == {0, 1, 2}
    assert "code 7" in failures[1]
    for rank in (0, 2):  # they raised (a backend error), they were not killed by spawn
        assert "terminated" not in failures[rank] and "Error" in failures[rank].splitlines()[0], failures[rank]


def raising_worker(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("boom on purpose")
    return rank * 10


def test_spawn_names_the_failed_rank_and_keeps_the_results():
    with pytest.raises(SpawnError) as raised:
        ta.spawn(raising_worker, 2)
    error = raised.value
    assert list(error.failures) == [1] and error.results == {0: 0}
    assert "rank 1" in str(error) and "ValueError: boom on purpose" in str(error)


def tensor_worker(rank: int, world: int) -> dict:
    return {"rank": rank, "tensor": torch.full((300, 300), float(rank)), "threads": torch.get_num_threads()}


def test_spawn_returns_tensors(monkeypatch):
    """Results travel by value: a tensor sent as a shared-memory handle could not be opened once
    the rank process had exited. Each rank runs cores // nprocs torch threads (the ranks share the
    host's cores)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    results = ta.spawn(tensor_worker, 2)
    for rank, result in enumerate(results):
        assert result["rank"] == rank and torch.equal(result["tensor"], torch.full((300, 300), float(rank)))
        assert result["threads"] == max(1, (os.cpu_count() or 1) // 2)


def test_spawn_threads_follow_omp_num_threads(monkeypatch):
    """OMP_NUM_THREADS, when set, decides the ranks' torch threads (as torch reads it), not spawn."""
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert [r["threads"] for r in ta.spawn(tensor_worker, 2)] == [3, 3]


def numba_state_worker(rank: int, world: int) -> tuple:
    """Whether numba's CPU target was made ready before this rank ran anything, and numba's OPT setting here."""
    ready = "numba.np.arraymath" in sys.modules  # loaded by the target's registries, never by `import treeattn`
    import numba

    return ready, numba.config.OPT


def test_fork_server_ranks_inherit_numbas_target_and_read_numba_settings_at_the_spawn(monkeypatch):
    """The fork server makes numba's CPU target ready once (parallel.fork_server_numba: about a second of CPU each
    rank paid at its first kernel call), and a rank still reads NUMBA_* from the environment of its spawn, not
    the one the server started with."""
    pytest.importorskip("numba")
    if importlib.import_module("treeattn.parallel.spawn")._new_rank_method("gloo") != "forkserver":
        pytest.skip("ranks come from a fork server on Linux only")
    assert all(ready for ready, _ in ta.spawn(numba_state_worker, 2))
    monkeypatch.setenv("NUMBA_OPT", "1")  # after the server started (the spawn above, or an earlier test's)
    assert [opt for _, opt in ta.spawn(numba_state_worker, 2)] == [1, 1]


def test_spawn_rejects_bad_arguments():
    with pytest.raises(ValueError, match="nprocs"):
        ta.spawn(raising_worker, 0)
    with pytest.raises(ValueError, match="timeout"):
        ta.spawn(raising_worker, 2, timeout=0)
    with pytest.raises(ValueError, match="threads must be a positive int"):
        ta.spawn(raising_worker, 2, threads=0)
    with pytest.raises(ValueError, match="method must be one of"):
        ta.spawn(raising_worker, 2, method="vfork")
    with pytest.raises(ValueError, match=r"threads: forked ranks run one torch thread each.*threads=2"):
        ta.spawn(raising_worker, 2, threads=2, method="fork")  # before any process starts


START_MARK = "a fresh interpreter"  # a forked rank sees the parent's value instead (monkeypatched below)


def start_worker(rank: int, world: int) -> tuple:
    import signal

    handlers = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)]
    return START_MARK, torch.get_num_threads(), all(h in (signal.SIG_DFL, signal.SIG_IGN) for h in handlers)


def test_one_thread_cpu_ranks_are_forked_and_the_others_spawned(monkeypatch):
    """A forked rank shares the parent's state (here a module global); a spawned one imports afresh.
    ta.spawn forks on request (method="fork"); by default its ranks come from a fork server (Linux) or are
    spawned, and either imports this module afresh (see spawn's module doc). In a forked rank the
    parent's Python signal handlers (ta.spawn's own SIGTERM/SIGHUP ones among them) are back to the
    default, as in a new process. (Ranks of 2+ threads are spawned: test_spawn_threads_follow_omp_num_threads,
    and the rule itself in test_started_ranks.)"""
    monkeypatch.setattr(sys.modules[__name__], "START_MARK", "the parent's state")
    forked = "the parent's state" if sys.platform.startswith("linux") else "a fresh interpreter"
    assert ta.spawn(start_worker, 2, threads=1,
                    method="fork" if forked != "a fresh interpreter" else None) == [(forked, 1, True)] * 2
    assert ta.spawn(start_worker, 2, threads=1) == [("a fresh interpreter", 1, True)] * 2


def fork_server_worker(rank: int, world: int) -> tuple:
    with open(f"/proc/{os.getpid()}/comm") as f:
        name = f.read().strip()
    x = torch.randn(256, 256)
    (x @ x).sum()  # a parallel region of 2 threads: it ends (the server never started OpenMP's pool)
    return os.environ.get("TREEATTN_TEST_PROBE"), torch.get_num_threads(), name, os.getppid()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is the Linux default")
def test_the_fork_server_gives_ranks_the_callers_environment_and_any_thread_count(monkeypatch):
    """ta.spawn's default on Linux: ranks forked from one fork server (not from this process, which
    has run matrix products), with this process's environment as it is at each call, 2 torch threads
    allowed, named treeattn-rankN; the same server serves the next call."""
    torch.ones(512, 512) @ torch.ones(512, 512)  # this process has run a parallel region
    monkeypatch.setenv("TREEATTN_TEST_PROBE", "first")
    first = ta.spawn(fork_server_worker, 2, threads=2)
    monkeypatch.setenv("TREEATTN_TEST_PROBE", "second")
    second = ta.spawn(fork_server_worker, 2, threads=1)
    assert [r[:3] for r in first] == [("first", 2, "treeattn-rank0"), ("first", 2, "treeattn-rank1")]
    assert [r[:3] for r in second] == [("second", 1, "treeattn-rank0"), ("second", 1, "treeattn-rank1")]
    servers = {r[3] for r in first + second}
    assert len(servers) == 1 and os.getpid() not in servers  # one server, the ranks' parent


KERNEL_IN_A_RANK = """
import torch, treeattn as ta

def attend(rank, world):
    q, k = torch.randn(1, 1, 4, 16), torch.randn(1, 512, 2, 16)
    return ta.attention(q, k, k)[0].shape  # decode-sized: numba's compiled kernel, 2 threads

if __name__ == "__main__":
    print(ta.spawn(attend, 1, threads=2))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is the Linux default")
def test_a_fork_server_rank_that_ran_the_compiled_kernel_leaves_no_semaphore(tmp_path):
    """numba's threading layer takes a named semaphore when the start method is "fork*"; a rank ends
    with os._exit, so the caller's resource tracker would warn at exit. The ranks' own start method is
    "spawn", and the caller's stderr stays clean."""
    pytest.importorskip("numba")
    import subprocess

    script = tmp_path / "kernel_in_a_rank.py"
    script.write_text(KERNEL_IN_A_RANK)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[torch.Size([1, 1, 4, 16])]"
    assert "leaked" not in done.stderr and "Warning" not in done.stderr, done.stderr[-3000:]


def more_threads_worker(rank: int, world: int) -> None:
    torch.set_num_threads(2)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks ranks")
def test_a_forked_rank_refuses_more_torch_threads_instead_of_hanging():
    """A forked rank inherited the parent's OpenMP pool without its threads: torch.set_num_threads(2)
    there raises (its first parallel region would never end once the parent ran one)."""
    torch.ones(512, 512) @ torch.ones(512, 512)  # the parent has run a parallel region
    with pytest.raises(SpawnError) as raised:
        ta.spawn(more_threads_worker, 2, threads=1, method="fork")
    assert sorted(raised.value.failures) == [0, 1]
    assert "ValueError: torch.set_num_threads(2) in a forked rank" in raised.value.summary
    assert "pass threads=2 (or method='spawn') to ta.spawn" in raised.value.summary


# ----------------------------------------------------------------------------- topology


def test_topology(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert ta.Topology().resolve(6) == 6  # one node
    assert ta.Topology(2).resolve(6) == 2
    assert ta.Topology(2).node_ranks(3, 6) == [2, 3] and ta.Topology(3).leaders(6) == [0, 3]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert ta.Topology().resolve(8) == 4
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        ta.Topology().resolve(6)
    with pytest.raises(ValueError, match="multiple of ranks_per_node"):
        ta.Topology(4).resolve(6)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="ranks_per_node"):
            ta.Topology(bad)


def stalling_worker(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    q, k, v = make_inputs(rank)
    if rank == 1:
        time.sleep(30)  # alive, but never joins the collective
    ta.tree_decode(q, k, v)


def test_a_stalled_rank_ends_in_the_group_timeout():
    """The others' collective fails after the group timeout (5 s here); spawn then ends the stalled rank
    (its 30 s sleep never runs out: it is terminated, not finished)."""
    with pytest.raises(SpawnError) as raised:
        ta.spawn(stalling_worker, 2, timeout=5)
    failures = raised.value.failures
    assert "terminated" not in failures[0] and "Error" in failures[0].splitlines()[0], failures[0]
    assert "terminated" in failures[1]


def failing_or_waiting_worker(rank: int, world: int) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 fails")
    time.sleep(60)  # healthy, but its caller will not use it again: it cannot end on its own in the test


def test_ranks_given_up_after_a_failure_end_at_once_not_after_the_grace():
    """StartedRanks.abandon (ta.Engine closing or restarting after a rank failed): the supervisor ends the rank
    still running at once; without it, rank 0 would be terminated GRACE_S after rank 1 failed. Checked by the
    failure's text, not by the time it took."""
    from treeattn.parallel.spawn import start

    group = start(failing_or_waiting_worker, 2, on_failure=lambda *_: group.ranks.abandon())
    with pytest.raises(SpawnError) as raised:
        group.join()
    failures = raised.value.failures
    assert "rank 1 fails" in failures[1]
    assert "terminated: still running when the caller gave up the group after rank 1 failed" in failures[0], failures[0]
