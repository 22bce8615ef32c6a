"""Run a function on every rank of a fresh process group: ``ta.spawn(fn, nprocs, *args)``.

    def work(rank, world_size, n):
        ...                      # torch.distributed is initialized; group=None is the world
        return result            # picklable; comes back to the parent

    results = ta.spawn(work, 4, 1024)          # [result of rank 0, ..., result of rank 3]

Locally, spawn starts `nprocs` processes (start method "spawn", so `fn` must be importable: a
module-level function) that rendezvous through a TCPStore the parent opens on a free localhost
port, so there is no port race. Under torchrun (RANK and WORLD_SIZE in the environment), or when
torch.distributed is already initialized, it starts nothing: it joins that group and calls fn in
this process.

Failures: an exception in any rank, or a rank that dies, ends in a SpawnError in the parent that
names every failed rank with its error and traceback. After the first failure the other ranks get
`timeout` seconds to finish or fail on their own (a rank blocked in a collective with a dead peer
errors out: gloo notices the closed connection, and every collective is bounded by the group
timeout), then they are terminated. Nothing can hang forever.
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0
HOST = "127.0.0.1"


class SpawnError(RuntimeError):
    """One or more ranks failed.

    Attributes:
        failures: rank -> description (exception type, message and traceback, or exit code), in
            the order the failures were seen.
        results: rank -> return value of the ranks that finished.
    """

    def __init__(self, failures: dict[int, str], results: dict[int, Any]) -> None:
        self.failures = failures
        self.results = results
        first = next(iter(failures))
        lines = [f"{len(failures)} of the ranks failed; first: rank {first}"]
        lines += [f"--- rank {rank}: {text}" for rank, text in failures.items()]
        super().__init__("\n".join(lines))


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on `nprocs` ranks of a new process group.

    Args:
        fn: module-level function (it is pickled to the child processes).
        nprocs: number of ranks, >= 1.
        *args: passed to fn after (rank, world_size); must be picklable.
        backend: torch.distributed backend: "gloo" (CPU tensors), "nccl" (CUDA tensors; rank r
            uses cuda:r % device_count), or a mapping string like "cpu:gloo,cuda:nccl".
        timeout: seconds; the process group's timeout for every collective, and how long the other
            ranks may run on after one rank failed.

    Returns:
        The list of fn's return values, index = rank. Under torchrun only this rank's entry is
        filled (the others are None).

    Raises:
        SpawnError: naming each failed rank and its error.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if dist.is_available() and (dist.is_initialized() or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)):
        return _run_in_existing_group(fn, nprocs, args, backend, timeout)
    return _run_local_processes(fn, nprocs, args, backend, timeout)


def _run_in_existing_group(fn, nprocs, args, backend, timeout) -> list[Any]:
    """Under torchrun (or an initialized group): call fn here as this process's rank."""
    created = False
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout))
        created = True
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if world != nprocs:
            raise ValueError(f"spawn: nprocs={nprocs} but the launcher's group has world size {world}")
        results: list[Any] = [None] * world
        results[rank] = fn(rank, world, *args)
        return results
    finally:
        if created:
            dist.destroy_process_group()


def _run_local_processes(fn, nprocs, args, backend, timeout) -> list[Any]:
    store = dist.TCPStore(HOST, 0, world_size=None, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout))
    workdir = tempfile.mkdtemp(prefix="treeattn-spawn-")
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_rank_main, args=(rank, nprocs, store.port, backend, timeout, workdir, fn, args), name=f"treeattn-rank{rank}")
        for rank in range(nprocs)
    ]
    failures: dict[int, str] = {}
    results: dict[int, Any] = {}
    try:
        for proc in procs:
            proc.start()
        running = dict(enumerate(procs))
        deadline = None
        while running:
            ready = multiprocessing.connection.wait([p.sentinel for p in running.values()], timeout=0.2)
            for rank, proc in list(running.items()):
                if proc.sentinel not in ready:
                    continue
                proc.join()
                del running[rank]
                outcome = _read_outcome(workdir, rank, proc.exitcode)
                if outcome[0] == "ok":
                    results[rank] = outcome[1]
                else:
                    failures[rank] = outcome[1]
                    if deadline is None:
                        deadline = time.monotonic() + timeout
            if deadline is not None and running and time.monotonic() > deadline:
                for rank, proc in running.items():
                    proc.kill()
                    proc.join()
                    failures[rank] = f"terminated: still running {timeout:.0f} s after the first failure"
                running = {}
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        shutil.rmtree(workdir, ignore_errors=True)
        del store
    if failures:
        raise SpawnError(failures, results)
    return [results[rank] for rank in range(nprocs)]


def _read_outcome(workdir: str, rank: int, exitcode: int | None) -> tuple[str, Any]:
    error_path = os.path.join(workdir, f"rank{rank}.error")
    result_path = os.path.join(workdir, f"rank{rank}.result")
    if os.path.exists(error_path):
        with open(error_path) as f:
            return "error", f.read()
    if exitcode == 0 and os.path.exists(result_path):
        with open(result_path, "rb") as f:
            return "ok", pickle.load(f)
    return "error", f"the process exited with code {exitcode} without returning or raising (killed or os._exit)"


def _rank_main(rank, world_size, port, backend, timeout, workdir, fn, args) -> None:
    """Body of one child process: join the group, run fn, leave the result or the error on disk."""
    faulthandler.enable()  # a native crash (SIGSEGV, SIGABRT) still prints the Python stack
    try:
        if "nccl" in backend and torch.cuda.is_available():
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.TCPStore(HOST, port, world_size=None, is_master=False, timeout=timedelta(seconds=timeout))
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
        result = fn(rank, world_size, *args)
        with open(os.path.join(workdir, f"rank{rank}.result.tmp"), "wb") as f:
            pickle.dump(result, f)
        os.replace(os.path.join(workdir, f"rank{rank}.result.tmp"), os.path.join(workdir, f"rank{rank}.result"))
    except BaseException as exc:  # noqa: BLE001 -- every failure must reach the parent
        text = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        with open(os.path.join(workdir, f"rank{rank}.error"), "w") as f:
            f.write(text)
        exit_without_teardown(1)  # do not wait on a group whose peers may be gone
    dist.destroy_process_group()
    # Skip interpreter teardown: native threads of torch.distributed (store client, backend
    # workers) can abort the process at exit ("terminate called without an active exception")
    # after all work is done; the result is already on disk.
    exit_without_teardown(0)


def exit_without_teardown(code: int) -> None:
    """Flush stdio and end the process now, skipping interpreter teardown (and with it the
    native-thread aborts of torch.distributed at exit). For rank processes whose work is done."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
