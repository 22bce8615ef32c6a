"""Run a function on every rank of a fresh process group: ``ta.spawn(fn, nprocs, *args)``.

    def work(rank, world_size, n):
        ...                      # torch.distributed is initialized; group=None is the world
        return result            # picklable; comes back to the parent

    results = ta.spawn(work, 4, 1024)          # [result of rank 0, ..., result of rank 3]

Locally, spawn starts `nprocs` processes that rendezvous through a TCPStore the parent opens on a
free localhost port, so there is no port race. Each rank sends its result (or its error) back
through a pipe; nothing is written to disk. Under torchrun (RANK and WORLD_SIZE in the environment),
or when torch.distributed is already initialized, it starts nothing: it joins that group and calls
fn in this process.

Start methods. A "spawn"ed rank starts an interpreter and imports torch again: about 3 s of CPU
per rank. A fork of this process starts in milliseconds but inherits its state, and that is only
safe from a fresh process: a forked child inherits GNU OpenMP's thread pool without its threads (its
first parallel region of 2+ threads never ends once this process ran one), CUDA cannot be used in a
fork of a process that touched it, a lock held by another thread at the fork stays held in the child
forever, and a fork of a process that has run many MKL matrix products can spin in MKL's allocator
(seen in a full test run, 2026-11-26: two forked ranks spun for 12 minutes in mkl_serv_allocate ->
mm_account_ptr_by_tid under an sgemm, forked from a pytest process that had run hundreds of tests'
products on 2 threads).

- ta.spawn's new CPU ranks (gloo) come from a fork server on Linux (`method="forkserver"`, the
  default; `_new_rank_method`): one process per parent, started (spawned) the first time it is needed,
  that imports torch and treeattn and makes numba's CPU target ready (`FORKSERVER_PRELOAD`) and then
  only forks ranks; it never runs a tensor operation or a kernel, so each rank is a fork of a clean
  process. The first spawn pays one interpreter start; each rank after that starts in tens of
  milliseconds. Such a rank gets this process's environment, working directory and sys.path as they
  are at the spawn (not the server's; numba's settings are read again from it), and may run any
  number of torch threads. Its parent is the fork server, which exits when this process does
  (multiprocessing closes its pipe); the rank has the parent-death signal tied to the server and its
  watchdog also checks this process.
- NCCL ranks, and every rank off Linux, are spawned.
- StartedRanks (`treeattn serve`'s ranks, started before the server has multiplied a matrix) are
  forked from this process where `_start_method` says a fork is safe: CPU ranks of one torch thread,
  one Python thread here, CPU default device, CUDA not initialized. Their work is in their memory,
  not pickled, and they start before the TCPStore's server thread exists (the store takes over a
  socket bound earlier). method="fork" asks the same of ta.spawn.

Faults (docs/faults.md states what the tests check):

- An exception in any rank, or a rank that dies, ends in a SpawnError in the parent that names
  every failed rank with its error and traceback. After the first failure the other ranks get a
  short grace period (`GRACE_S`, at most `timeout`) to finish or fail on their own (a rank blocked
  in a collective with a dead peer errors out: gloo notices the closed connection), then they are
  killed; at once where the caller gives the ranks up after the failure (StartedRanks.abandon:
  ta.Engine closing or restarting its ranks after one failed).
- A rank that stops answering (SIGSTOP, a deadlock holding the GIL) is noticed by its heartbeat:
  every rank beats every `HEARTBEAT_S` from a thread of its own; a rank silent for `timeout`
  seconds is killed and named first in the SpawnError ("stopped answering"), ahead of the healthy
  ranks whose collectives timed out waiting for it.
- The ranks die with the parent: on Linux the kernel kills them when the parent dies (parent-death
  signal, even for SIGKILL), and on every platform their watchdog thread exits the rank once its
  parent is gone. SIGTERM and SIGHUP in the parent (when spawn runs in the main thread) end the
  ranks first and are then delivered as before: with the default disposition the parent dies of
  the signal. SIGINT raises KeyboardInterrupt, which ends the ranks likewise.

Ranks started ahead of their work (a server's start-up: the ranks' start overlaps the parent's own)::

    ranks = StartedRanks(2)                    # now: forked (CPU ranks on Linux) or spawned, waiting for work
    ...                                        # the parent goes on (checks, imports)
    results = spawn(fn, 2, *args, ranks=ranks) # adopted: the same rendezvous, supervision and faults
    ranks.close()                              # ends those never given work (idempotent)

Started ranks are tied to the parent from their start (parent-death signal, watchdog, heartbeat),
so a parent that dies or fails before it calls spawn leaves none behind; a StartedRanks serves one
spawn of exactly its `nprocs` (anything else is a ValueError before any work).

Ranks supervised from another thread (ta.Engine), started in this one, where the start method is judged::

    group = start(fn, 2, *args)                # the ranks start now, with their work
    results = group.join()                     # from any thread: what spawn(fn, 2, *args) returns
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import importlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from treeattn.parallel.shared_memory import remove_segments_of

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0
GRACE_S = 5.0  # after the first failure, how long the other ranks may run on (at most `timeout`)
HEARTBEAT_S = 0.5  # how often a rank's watchdog thread beats and checks for its parent
# what the fork server imports once, for every rank (numba's CPU target made ready: fork_server_numba); the last
# removes its socket file when it exits
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "treeattn", "treeattn.parallel.fork_server_numba",
                      "treeattn.parallel.fork_server_exit")
STARTUP_S = 120.0  # a rank that has not beaten yet (still importing) is silent for at most this long
HOST = "127.0.0.1"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PR_SET_NAME = 15


class SpawnError(RuntimeError):
    """One or more ranks failed.

    Attributes:
        failures: rank -> description (exception type, message and traceback, or what happened to
            the process), the cause first: a rank that stopped answering comes before the ranks
            that timed out waiting for it; otherwise in the order the failures were seen.
        results: rank -> return value of the ranks that finished.
    """

    def __init__(self, failures: dict[int, str], results: dict[int, Any]) -> None:
        self.failures = failures
        self.results = results
        lines = [f"{len(failures)} of the ranks failed; first: {self.summary}"]
        lines += [f"--- rank {rank}: {text}" for rank, text in failures.items()]
        super().__init__("\n".join(lines))

    @property
    def first_rank(self) -> int:
        return next(iter(self.failures))

    @property
    def summary(self) -> str:
        """One line: the first failed rank and the first line of its error."""
        first = self.first_rank
        return f"rank {first}: {self.failures[first].splitlines()[0] if self.failures[first] else 'failed'}"


def under_torchrun() -> bool:
    """Whether this process was launched by torchrun (RANK and WORLD_SIZE in its environment)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def local_ranks(world_size: int) -> int:
    """Ranks on this machine: LOCAL_WORLD_SIZE under torchrun, else all `world_size` (ta.spawn starts them here)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if under_torchrun() else world_size


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = DEFAULT_TIMEOUT_S,
    ranks: StartedRanks | None = None,
    threads: int | None = None,
    method: str | None = None,
    on_failure: Callable[[int, int | None, str], None] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on `nprocs` ranks of a new process group.

    Args:
        fn: module-level function (it is pickled to the child processes).
        nprocs: number of ranks, >= 1.
        *args: passed to fn after (rank, world_size); must be picklable.
        backend: torch.distributed backend: "gloo" (CPU tensors), "nccl" (CUDA tensors; rank r
            uses cuda:r % device_count), or a mapping string like "cpu:gloo,cuda:nccl".
        timeout: seconds; the process group's timeout for every collective, and how long a rank
            may show no sign of life (no heartbeat) before it is killed and named. After the first
            failure the other ranks get min(GRACE_S, timeout) seconds more.
        ranks: processes started earlier (StartedRanks(nprocs)) to run fn instead of new ones; they
            serve this one call (None: start `nprocs` processes now).
        threads: torch threads of each new rank, set before fn runs; None: rank_threads(nprocs), that is
            OMP_NUM_THREADS when set, else cores // nprocs (at least 1), as torchrun's ranks and the
            engine's run, so that the ranks do not oversubscribe the host's cores. A fn that sets
            its own thread count passes it here too: it decides the start method.
        method: multiprocessing start method of new ranks, "forkserver", "spawn" or "fork"; None:
            "forkserver" for gloo ranks on Linux, else "spawn" (the module doc says why). Ask for
            "spawn" when the ranks must start as new processes: e.g. to read environment variables
            that only a process start reads (glibc's MALLOC_*).
        on_failure: called once, from the supervising thread, with (rank, pid, description) of the
            first rank seen failing (a rank that died before one that raised, when seen together),
            as soon as it is seen, before the other ranks' grace period (ta.Engine's liveness).

    A rank started by the fork server or spawned imports the main module again, so a script calls
    spawn under `if __name__ == "__main__":` (unguarded, every rank would call spawn itself), and
    `fn` is a function defined at a module's top level; it sees this process's environment variables
    as they are at the call. A rank forked from this process (method="fork") starts from its state
    instead (its imported modules and their settings, torch's random state, monkeypatches) with the
    signal handlers reset as a new process has them, and it refuses torch.set_num_threads(n > 1) in
    one line (ValueError) rather than hang in OpenMP.

    Returns:
        The list of fn's return values, index = rank. Under torchrun only this rank's entry is
        filled (the others are None).

    Raises:
        SpawnError: naming each failed rank and its error (the cause first).

    Example (fn(rank, world_size, *args) on 2 gloo ranks; fn must be importable, here the builtin pow)::

        >>> import treeattn as ta
        >>> ta.spawn(pow, 2, 10)                      # [pow(0, 2, 10), pow(1, 2, 10)]: index = rank
        [0, 1]
    """
    _check_arguments(nprocs, timeout, threads, method)
    if ranks is not None:
        ranks.check_adoptable(nprocs)
        if method is not None:
            raise ValueError(f"method: the started ranks' processes exist already ({ranks.method}); pass method=None with ranks")
    if dist.is_available() and (dist.is_initialized() or under_torchrun()):
        if ranks is not None:
            raise ValueError("ranks: started processes cannot join an existing process group (torchrun); pass ranks=None")
        return _run_in_existing_group(fn, nprocs, args, backend, timeout)
    threads, method = _threads_and_method(nprocs, backend, threads, method, ranks)
    return _supervised(lambda: RankGroup(fn, nprocs, args, backend, float(timeout), ranks, threads, method, on_failure), nprocs)


def start(fn: Callable[..., Any], nprocs: int, *args: Any, backend: str = "gloo", timeout: float = DEFAULT_TIMEOUT_S,
          threads: int | None = None, method: str | None = None,
          on_failure: Callable[[int, int | None, str], None] | None = None) -> RankGroup:
    """spawn in two halves: start the ranks now, in this thread; RankGroup.join() (from any thread,
    once) supervises them and returns or raises what spawn would. For a caller that supervises its
    ranks from a thread of its own (ta.Engine): whether a fork is safe is judged where the ranks
    start (the module doc), so they start here, before that thread exists.

    The arguments are spawn's. Not for torchrun or an initialized process group (spawn joins those):
    ValueError there, as for a bad argument.

    Example (the builtin pow on 2 ranks; join in another thread would do the same)::

        >>> from treeattn.parallel.spawn import start
        >>> start(pow, 2, 10).join()
        [0, 1]
    """
    _check_arguments(nprocs, timeout, threads, method)
    if dist.is_available() and (dist.is_initialized() or under_torchrun()):
        raise ValueError("start: this process is in a process group (torchrun) already; call spawn, which joins it")
    threads, method = _threads_and_method(nprocs, backend, threads, method, None)
    return RankGroup(fn, nprocs, args, backend, float(timeout), None, threads, method, on_failure)


def _check_arguments(nprocs, timeout, threads, method) -> None:
    """spawn's and start's arguments: one line naming the first bad one."""
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    if isinstance(timeout, bool) or not (isinstance(timeout, (int, float)) and 0 < timeout < float("inf")):
        raise ValueError(f"timeout must be a positive, finite number of seconds, got {timeout!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive int or None, got {threads!r}")
    if method is not None and method not in multiprocessing.get_all_start_methods():
        raise ValueError(f"method must be one of {multiprocessing.get_all_start_methods()} or None, got {method!r}")


def _threads_and_method(nprocs: int, backend: str, threads: int | None, method: str | None,
                        ranks: StartedRanks | None) -> tuple[int, str | None]:
    """The ranks' torch threads and the start method of new ranks (None with started ranks)."""
    threads = threads or rank_threads(nprocs)
    if (method or getattr(ranks, "method", None)) == "fork" and threads > 1:
        raise ValueError(f"threads: forked ranks run one torch thread each (see the module doc), got threads={threads}; "
                         + ("use method='spawn'" if ranks is None else f"start them with StartedRanks({nprocs}, "
                                                                       f"threads={threads})"))
    if ranks is not None:
        return threads, None
    return threads, method or _new_rank_method(backend)


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


# ------------------------------------------------------------------------------------ parent


class _Signalled(BaseException):
    """SIGTERM or SIGHUP arrived while the ranks were running."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _ParentSignals:
    """While the ranks run, SIGTERM and SIGHUP raise _Signalled in the main thread (so the ranks
    get ended); while they are being ended, a signal is only remembered. Signals that were ignored
    (nohup) stay ignored. Outside the main thread nothing is installed (Python cannot)."""

    def __init__(self) -> None:
        self.previous: dict[int, Any] = {}
        self.pending: int | None = None
        self.deferring = False

    def _handler(self, signum: int, frame: Any) -> None:
        if self.deferring or self.pending is not None:
            self.pending = self.pending or signum
            return
        self.pending = signum
        raise _Signalled(signum)

    @contextlib.contextmanager
    def installed(self) -> Iterator[_ParentSignals]:
        if threading.current_thread() is threading.main_thread():
            for name in ("SIGTERM", "SIGHUP"):
                signum = getattr(signal, name, None)
                if signum is None or signal.getsignal(signum) in (signal.SIG_IGN, None):
                    continue
                self.previous[signum] = signal.signal(signum, self._handler)
        try:
            yield self
        finally:
            for signum, handler in self.previous.items():
                signal.signal(signum, handler)

    def redeliver(self) -> None:
        """Send the remembered signal again, to its previous handler (default: the process dies)."""
        if self.pending is not None:
            os.kill(os.getpid(), self.pending)


def _supervised(group: Callable[[], RankGroup], nprocs: int) -> list[Any]:
    """group().run() with the parent's signal handlers installed (main thread): the results, or
    SpawnError naming every rank as terminated when SIGTERM/SIGHUP came (then delivered again)."""
    signals = _ParentSignals()
    try:
        with signals.installed():
            return group().run(signals)
    except _Signalled:
        pass
    finally:  # the ranks are gone and the handlers restored: with the default disposition this process ends here
        signals.redeliver()
    name = signal.Signals(signals.pending).name
    raise SpawnError({rank: f"terminated: the parent received {name}" for rank in range(nprocs)}, {})


class StartedRanks:
    """`nprocs` rank processes started now, waiting for the work a later spawn(..., ranks=self) gives them.

    Args:
        nprocs: number of ranks, >= 1.
        device: the kind of device the ranks will use, "cpu" or "cuda" (a forked process cannot use
            CUDA once its parent has touched it, and torch.cuda.is_available() does).
        method: multiprocessing start method; None: "fork" for CPU ranks on Linux when this process
            runs one Python thread and each rank will run one torch thread (a fork of a process that
            has imported torch and treeattn starts in milliseconds and shares those pages; a "spawn"ed
            rank starts an interpreter and imports torch again, seconds of CPU), else "spawn". A
            forked rank must not run more threads: if this process ever ran an OpenMP parallel region,
            the child inherits its thread pool without the threads, and its first parallel region
            with 2 or more threads never ends (GNU libgomp; seen here).
        threads: the torch threads each rank will run (the engine's threads_per_rank); None:
            rank_threads(nprocs), what spawn gives its ranks.
        work: (rank -> the rank's work) to hand over at the start (ta.spawn's own ranks); None: the
            ranks wait for spawn to adopt them.
        preload: modules each waiting rank imports while it waits (what its work will import first,
            e.g. a model loader), so that the import is off the path once the work comes; an
            import that fails there is left for the work itself to raise.

    From its start each process is tied to this one (parent-death signal on Linux, a watchdog
    thread that exits it once its parent is gone, a heartbeat) and ignores SIGINT; one still waiting
    for work ends when its work pipe closes. close() kills those still running (SIGKILL) and is
    idempotent; the processes are daemonic, so an interpreter that exits without close() ends them too.
    """

    def __init__(self, nprocs: int, *, device: str = "cpu", method: str | None = None,
                 work: Callable[[int], tuple] | None = None, preload: tuple[str, ...] = (), threads: int | None = None) -> None:
        if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
            raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        if method is not None and method not in multiprocessing.get_all_start_methods():
            raise ValueError(f"method must be one of {multiprocessing.get_all_start_methods()}, got {method!r}")
        self.nprocs = nprocs
        self.method = method or _start_method(device, threads or rank_threads(nprocs))
        self.adopted = work is not None
        self.given = threading.Event()  # set once every rank has been handed its work
        self.abandoned = threading.Event()  # set by abandon(): no grace period after a failure
        self.closed = False
        ctx = multiprocessing.get_context(self.method)
        if self.method == "forkserver":
            ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))  # read when the server starts (once per process)
        environ = dict(os.environ) if self.method == "forkserver" else None  # a fork server's ranks get the caller's
        self.heartbeats = ctx.RawArray("Q", nprocs)  # beats counted by each rank's watchdog thread
        self.procs, self.readers, self.jobs = [], [], []
        try:
            for rank in range(nprocs):
                reader, writer = ctx.Pipe(duplex=False)
                job_reader, job_writer = ctx.Pipe(duplex=False) if work is None else (None, None)
                proc = ctx.Process(target=_rank_main, name=f"treeattn-rank{rank}", daemon=work is None,
                                   args=(rank, os.getpid(), self.heartbeats, writer, job_reader,
                                         None if work is None else work(rank),
                                         tuple(preload), self.method, environ))
                self.procs.append(proc)
                self.readers.append(reader)
                self.jobs.append(job_writer)
                try:
                    with _sigint_blocked():  # inherited: Ctrl-C in a terminal reaches the parent alone
                        proc.start()
                finally:
                    writer.close()  # the child holds its own end; EOF then means the child is gone
                    if job_reader is not None:
                        job_reader.close()
        except BaseException:
            self.close()
            raise

    def check_adoptable(self, nprocs: int) -> None:
        """Raise ValueError unless a spawn of `nprocs` ranks may adopt these processes."""
        if self.nprocs != nprocs:
            raise ValueError(f"ranks: {self.nprocs} process(es) were started, but spawn was asked for nprocs={nprocs}")
        if self.adopted or self.closed:
            raise ValueError("ranks: these processes were already given work or closed (a StartedRanks serves one spawn)")

    def give(self, work: Callable[[int], tuple]) -> None:
        """Hand each waiting rank its work: work(rank). A rank already gone is the caller's to notice
        (its process sentinel), so a closed pipe is not an error here."""
        self.adopted = True
        for rank, job in enumerate(self.jobs):
            with contextlib.suppress(OSError):
                job.send(work(rank))
            job.close()
        self.given.set()

    def abandon(self) -> None:
        """The caller will not use these ranks again (a rank failed, and it closes or restarts the group): once
        a rank has failed, the supervisor (RankGroup) ends the others at once instead of after the grace period,
        which lets a healthy rank fail on its own with its own error. Thread-safe; before a failure it changes nothing.

        >>> ranks = StartedRanks(1)
        >>> ranks.abandon()
        >>> ranks.abandoned.is_set()
        True
        >>> ranks.close()
        """
        self.abandoned.set()

    def kill(self, ranks: list[int]) -> None:
        """SIGKILL (works on stopped processes too) and reap the given ranks; then unlink any shared-memory
        segment a reaped rank made and had no time to unlink (killed during its group's start-up)."""
        for rank in ranks:
            proc = self.procs[rank]
            if proc.pid is not None and proc.is_alive():
                proc.kill()
            if proc.pid is not None:
                proc.join()
                remove_segments_of(proc.pid)

    def close(self) -> None:
        """Kill the ranks still running and close the parent's ends of their pipes."""
        if self.closed:
            return
        self.closed = True
        self.kill(list(range(len(self.procs))))
        for conn in self.readers + self.jobs:
            if conn is not None:
                conn.close()

    def __enter__(self) -> StartedRanks:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _start_method(device: str, threads: int) -> str:
    """"fork" where a fork is safe and cheap, else "spawn". Safe: CPU ranks of one torch thread each
    (the child never starts an OpenMP team from the parent's inherited pool), on Linux, from a
    process that runs one Python thread (no other thread can hold a lock the child would inherit),
    whose default torch device is the CPU and which has not initialized CUDA (a fork of it could not
    use CUDA, and its tensors would be made there)."""
    if (device == "cpu" and threads == 1 and sys.platform.startswith("linux") and threading.active_count() == 1
            and torch.get_default_device().type == "cpu" and not torch.cuda.is_initialized()):
        return "fork"
    return "spawn"


def _new_rank_method(backend: str) -> str:
    """ta.spawn's start method for new ranks: "forkserver" for gloo ranks on Linux (forks of a clean
    process that imported torch once: the module doc), else "spawn"."""
    if sys.platform.startswith("linux") and "nccl" not in backend and "forkserver" in multiprocessing.get_all_start_methods():
        return "forkserver"
    return "spawn"


class RankGroup:
    """The parent's view of one spawn: the processes (StartedRanks), their result pipes and heartbeats.

    Made by spawn, or by start() (then: join() supervises the ranks, close() ends them unsupervised).
    The ranks start when it is made (new ones: with their work, forked or spawned; started ones: they
    get their work in run), before the rendezvous store's server thread exists, so that a fork
    copies no such thread: the store takes over a socket bound first.
    """

    def __init__(self, fn, nprocs: int, args, backend: str, timeout: float, ranks: StartedRanks | None,
                 threads: int, method: str | None, on_failure=None) -> None:
        self.nprocs, self.timeout, self.on_failure = nprocs, timeout, on_failure
        self.grace = min(GRACE_S, timeout)
        self.listener = _loopback_listener()  # bound now, so the port is known; the store takes it over later
        port = self.listener.getsockname()[1]
        self.work = lambda rank: (nprocs, port, backend, timeout, fn, args, threads)
        self.store: dist.TCPStore | None = None
        self.outcomes: dict[int, tuple[str, Any]] = {}  # rank -> ("ok", result) | ("error", text), as received
        self.failures: dict[int, str] = {}
        self.results: dict[int, Any] = {}
        try:
            self.ranks = ranks if ranks is not None else StartedRanks(nprocs, method=method, work=self.work)
        except BaseException:
            self.listener.close()
            raise

    def join(self) -> list[Any]:
        """Supervise the ranks until they end: fn's results, index = rank (SpawnError as spawn raises it)."""
        return _supervised(lambda: self, self.nprocs)

    def close(self) -> None:
        """End the ranks unsupervised (a start() whose join never comes); idempotent."""
        self.ranks.close()
        self.listener.close()

    def run(self, signals: _ParentSignals) -> list[Any]:
        try:
            # the ranks connect to the bound socket meanwhile: the kernel queues them until the store accepts
            self.store = _loopback_store(self.listener, self.timeout)
            if not self.ranks.adopted:
                self.ranks.give(self.work)
            self.procs, self.readers, self.heartbeats = self.ranks.procs, self.ranks.readers, self.ranks.heartbeats
            self._watch()
        finally:
            signals.deferring = True  # a signal now must not interrupt the cleanup
            self.close()  # the listener: a no-op once the store took it over
            self.store = None
        if self.failures:
            raise SpawnError(self.failures, self.results)
        return [self.results[rank] for rank in range(self.nprocs)]

    def _watch(self) -> None:
        """Until every rank has finished or failed: collect outcomes, end the ranks that went
        silent, and end the rest `grace` seconds after the first failure."""
        running = set(range(self.nprocs))
        liveness = _Liveness(self.heartbeats)
        deadline = None
        while running:
            waiting = [self.readers[r] for r in running if r not in self.outcomes] + [self.procs[r].sentinel for r in running]
            ready = multiprocessing.connection.wait(waiting, timeout=0.2)
            now = time.monotonic()
            for rank in sorted(running):
                if rank not in self.outcomes and self.readers[rank] in ready:
                    self._receive(rank)
                if self.procs[rank].sentinel in ready:
                    self.procs[rank].join()
                    running.discard(rank)
                    self._settle(rank)
            liveness.update(now)
            silent = self._silent(running, liveness, now, first_failure=bool(self.failures) and deadline is None)
            if silent:
                self._blame_silent(silent)
                running -= set(silent)
            if self.failures and deadline is None:
                self._report_first_failure()
            if self.failures and deadline is None:
                deadline = now + self.grace
            if deadline is not None and running and (now > deadline or self.ranks.abandoned.is_set()):
                after = "when the caller gave up the group" if now <= deadline else f"{self.grace:.0f} s"
                for rank in sorted(running):
                    self.failures[rank] = f"terminated: still running {after} after rank {next(iter(self.failures))} failed"
                self.ranks.kill(sorted(running))
                running.clear()

    def _report_first_failure(self) -> None:
        """Call on_failure with the first failure: a rank that died or went silent before one that
        raised (the others' errors, a closed connection, are the consequence)."""
        if self.on_failure is None:
            return
        raised = {rank for rank, (kind, _) in self.outcomes.items() if kind == "error"}
        rank = next((r for r in self.failures if r not in raised), next(iter(self.failures)))
        text = self.failures[rank].strip().splitlines()
        self.on_failure(rank, self.procs[rank].pid, text[0] if text else "failed")

    def _silent(self, running: set[int], liveness: _Liveness, now: float, first_failure: bool) -> dict[int, float]:
        """rank -> seconds without a heartbeat, for the running ranks to be ended as silent: those
        quiet for `timeout` (max(timeout, STARTUP_S) before their first beat); and, when a first
        failure just arrived, those already quiet for 4 beats or stopped (it is likely the cause)."""
        silent = {}
        for rank in running:
            quiet = now - liveness.last[rank]
            limit = self.timeout if liveness.started(rank) else max(self.timeout, STARTUP_S)
            suspect = first_failure and (
                (liveness.started(rank) and quiet > 4 * HEARTBEAT_S) or _process_state(self.procs[rank].pid) == "T"
            )
            if quiet > limit or suspect:
                silent[rank] = quiet
        return silent

    def _receive(self, rank: int) -> None:
        try:
            data = self.readers[rank].recv_bytes()
        except (EOFError, OSError):  # the rank died before (or while) sending
            self.outcomes[rank] = ("none", None)
            return
        try:
            self.outcomes[rank] = pickle.loads(data)
        except Exception as exc:  # noqa: BLE001 -- e.g. a class the parent cannot import
            self.outcomes[rank] = ("error", f"the parent could not unpickle the rank's result: {type(exc).__name__}: {exc}")

    def _settle(self, rank: int) -> None:
        """Rank `rank`'s process has exited: record its result or its failure."""
        if rank not in self.outcomes and self.readers[rank].poll():
            self._receive(rank)
        kind, value = self.outcomes.get(rank, ("none", None))
        code = self.procs[rank].exitcode
        if kind == "ok" and code == 0:
            self.results[rank] = value
        elif kind == "error":
            self.failures[rank] = value
        else:
            self.failures[rank] = f"the process exited with {_describe_exit(code)} without returning or raising"

    def _blame_silent(self, silent: dict[int, float]) -> None:
        """Kill the ranks that stopped answering; they go first in the failures: the others'
        errors (timeouts, closed connections) are the consequence."""
        blamed = {}
        for rank, quiet_s in sorted(silent.items()):
            pid = self.procs[rank].pid
            state = _process_state(pid)
            how = f"; process state: {_STATES.get(state, state)}" if state else ""
            blamed[rank] = f"stopped answering (pid {pid}): no heartbeat for {quiet_s:.1f} s{how}; terminated"
        self.ranks.kill(list(silent))
        self.failures = blamed | self.failures


class _Liveness:
    """When each rank last showed life (its heartbeat counter moved), on this process's clock."""

    def __init__(self, counters) -> None:
        self.counters = counters
        self.seen = [0] * len(counters)
        self.last = [time.monotonic()] * len(counters)
        self._last_update = time.monotonic()

    def update(self, now: float) -> None:
        if now - self._last_update > 2.0:  # this process was itself stopped or starved: nobody's silence counts
            self.last = [now] * len(self.last)
        self._last_update = now
        for rank, count in enumerate(self.counters):
            if count != self.seen[rank]:
                self.seen[rank], self.last[rank] = count, now

    def started(self, rank: int) -> bool:
        return self.seen[rank] > 0


_STATES = {"T": "stopped by a signal (SIGSTOP/SIGTSTP)", "t": "stopped by a debugger", "D": "waiting on I/O (uninterruptible)",
           "R": "running", "S": "sleeping", "Z": "zombie"}


def _process_state(pid: int | None) -> str | None:
    """The one-letter state of a process from /proc (Linux), or None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def _loopback_listener() -> socket.socket:
    """A listening socket on a free port of the loopback, for the rendezvous store: TCPStore binds
    every interface when it opens its own socket. Ranks may connect before the store exists (the
    kernel queues them)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((HOST, 0))
        listener.listen(128)
    except OSError:
        listener.close()
        raise
    return listener


def _loopback_store(listener: socket.socket, timeout: float) -> dist.TCPStore:
    """The rendezvous store on `listener` (it takes the descriptor over; the socket object is detached)."""
    return dist.TCPStore(HOST, 0, world_size=None, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout), master_listen_fd=listener.detach())


# ------------------------------------------------------------------------------------- ranks


@contextlib.contextmanager
def _sigint_blocked():
    """Block SIGINT in this thread while a rank process starts: the child inherits the mask (and,
    from the start, never sees the SIGINT that Ctrl-C sends to the whole process group), so the
    parent alone decides what Ctrl-C does (KeyboardInterrupt, a server's drain) and ends the ranks
    itself. _rank_main then ignores SIGINT for good."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _gloo_on_loopback() -> None:
    """Local ranks talk over the loopback: gloo binds the address the host name resolves to (on
    many hosts a LAN address) unless GLOO_SOCKET_IFNAME names an interface, so name the loopback's
    when the user has not named one."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    loopback = next((name for _, name in socket.if_nameindex() if name in ("lo", "lo0")), None)
    if loopback is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback


def rank_threads(world_size: int) -> int:
    """torch threads of each of `world_size` local ranks: OMP_NUM_THREADS when it is a positive
    integer (set explicitly, so that a forked rank, whose torch was initialized by its parent, follows
    it too), else cores // world_size, at least 1: the ranks share this host's cores."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    return int(given) if given.isdigit() and int(given) > 0 else max(1, (os.cpu_count() or 1) // world_size)


def _rank_main(rank, parent_pid, heartbeats, result_pipe, job_pipe, work, preload=(), method="spawn", environ=None) -> None:
    """Body of one child process: tie its life to the parent's (`parent_pid`, the process that
    started the ranks), wait for its work if it has none yet (`job_pipe`, importing the `preload`
    modules meanwhile; closed without work: exit), join the group, run fn, send the result or the
    error back through the pipe. `environ`: the parent's environment (a fork server's ranks)."""
    _name_process(f"treeattn-rank{rank}")
    forked = method == "fork"
    if forked:
        _as_a_new_process()
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
        if "numba.core.config" in sys.modules:  # the fork server imported numba: read NUMBA_* from this environment
            sys.modules["numba.core.config"].reload_config()
    if method == "forkserver":
        # The processes this rank starts itself are spawned. Under a start method named "fork*",
        # numba's threading layer takes a named semaphore at its first parallel call, which a rank
        # ending with os._exit would leave to the resource tracker ("leaked semaphore" at exit).
        multiprocessing.set_start_method("spawn", force=True)
    faulthandler.enable(file=2)  # a native crash (SIGSEGV, SIGABRT) still prints the Python stack on stderr
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's (see _sigint_blocked)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # ignored now: nothing pending may kill it
    _die_with_parent(parent_pid, heartbeats, rank, via_server=method == "forkserver")
    if work is None:
        for name in preload:
            with contextlib.suppress(Exception):  # a failing import is the work's to raise, with its context
                importlib.import_module(name)
        try:
            work = job_pipe.recv()
        except (EOFError, OSError):  # the parent closed (or lost) this rank without giving it work
            exit_without_teardown(0)
        job_pipe.close()
    world_size, port, backend, timeout, fn, args, threads = work
    try:
        if forked:
            _refuse_more_threads()
        torch.set_num_threads(threads or rank_threads(world_size))
        if "nccl" in backend and torch.cuda.is_available():
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.TCPStore(HOST, port, world_size=None, is_master=False, timeout=timedelta(seconds=timeout))
        _gloo_on_loopback()
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        logger.debug("rank %d: process group ready", rank)
        result = fn(rank, world_size, *args)
        # plain pickle, by value: multiprocessing's own pickler would pass tensors as shared-memory
        # handles that the parent can only open while this process, about to exit, still runs
        result_pipe.send_bytes(pickle.dumps(("ok", result)))
        if world_size > 1:
            with contextlib.suppress(Exception):  # a peer that failed is the parent's to report
                dist.barrier()  # leave together: a rank closing its connections early fails a peer still setting up
    except BaseException as exc:  # noqa: BLE001 -- every failure must reach the parent
        text = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        with contextlib.suppress(Exception):
            result_pipe.send_bytes(pickle.dumps(("error", text)))
        exit_without_teardown(1)  # do not wait on a group whose peers may be gone
    dist.destroy_process_group()
    # Skip interpreter teardown: native threads of torch.distributed (store client, backend
    # workers) can abort the process at exit ("terminate called without an active exception")
    # after all work is done; the result is already sent.
    exit_without_teardown(0)


def _name_process(name: str) -> None:
    """Linux: this process's name as ps and top show it (the kernel keeps 15 bytes), so that a
    rank reads as one: a fork server's ranks otherwise carry the server's command line."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            _prctl(PR_SET_NAME, name.encode()[:15])


def _prctl(option: int, arg) -> None:
    """Linux prctl(option, arg) through libc (OSError or AttributeError where there is none)."""
    ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)


def _as_a_new_process() -> None:
    """In a forked rank: the signal handlers a new process has. The Python handlers inherited from
    the parent (ta.spawn's own SIGTERM/SIGHUP handlers, a test runner's, a server's) go back to the
    default, as an exec would reset them; ignored signals stay ignored."""
    for signum in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):  # SIGKILL, SIGSTOP and the like cannot be set
            if callable(signal.getsignal(signum)):
                signal.signal(signum, signal.SIG_DFL)


def _refuse_more_threads() -> None:
    """In a forked rank: torch.set_num_threads(n > 1) raises a ValueError naming the way out. The
    rank inherited GNU OpenMP's thread pool without its threads; its first parallel region of 2 or
    more threads would never end (the module doc)."""
    set_num_threads = torch.set_num_threads

    def one_thread_only(n: int) -> None:
        if n > 1:
            raise ValueError(f"torch.set_num_threads({n}) in a forked rank: its OpenMP pool cannot start threads; "
                             f"pass threads={n} (or method='spawn') to ta.spawn")
        set_num_threads(n)

    torch.set_num_threads = one_thread_only


def _die_with_parent(parent_pid: int, heartbeats, rank: int, via_server: bool = False) -> None:
    """Make this rank end when the parent does: the Linux parent-death signal (SIGKILL, so it
    holds when the parent was SIGKILLed), and everywhere a watchdog thread that exits the process
    once its parent is gone. The same thread counts this rank's heartbeats.

    via_server: this rank's parent is the fork server of `parent_pid`, which exits when that process
    does; the signal and the watchdog then follow the server, and the watchdog checks
    `parent_pid` too."""
    server_pid = os.getppid() if via_server else None
    if via_server and (server_pid == 1 or not _alive(parent_pid)):
        os._exit(1)  # the parent (or its server) died before this rank started
    if sys.platform.startswith("linux"):
        try:
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            logger.warning("rank %d: prctl(PR_SET_PDEATHSIG) unavailable; relying on the watchdog thread", rank)

    expected = server_pid if via_server else parent_pid

    def watch() -> None:
        while True:
            if os.getppid() != expected or (via_server and not _alive(parent_pid)):  # re-parented: the parent is gone
                os._exit(1)
            heartbeats[rank] += 1
            time.sleep(HEARTBEAT_S)

    if os.getppid() != expected:  # the parent died before the signal was armed
        os._exit(1)
    threading.Thread(target=watch, name="treeattn-rank-watchdog", daemon=True).start()


def _alive(pid: int) -> bool:
    """Whether process `pid` exists (a zombie counts: its parent has not reaped it yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def exit_without_teardown(code: int) -> None:
    """Flush stdio and end the process now, skipping interpreter teardown (and with it the
    native-thread aborts of torch.distributed at exit). For rank processes whose work is done."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
