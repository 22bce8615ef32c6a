"""The calling thread's OpenMP worker threads, released when another thread will run the parallel work.

    released = release_thread_pool()   # True where torch's libgomp is loaded (Linux), else False

torch's CPU operators and numba's "omp" threading layer (the paged attention kernel, the LM head) share the
GNU OpenMP runtime torch loaded. libgomp keeps one pool of worker threads per thread that opened a parallel
region, and it counts all of them: once it manages more threads than the process has CPUs, every pool's idle
workers spin only about 1,000 times (gomp_throttled_spin_count_var) before they sleep on a futex, instead of
GOMP_SPINCOUNT's 300,000 (libgomp's config/linux/wait.h). A one-rank engine builds and warms its rank in the
caller's thread and then steps it in the engine's driver thread: two pools of 2 threads on 2 CPUs, so each
of a decode step's ~32 parallel regions woke a sleeping worker (64 voluntary context switches a step, SmolLM2
at 4K; docs/bench_weights.md, "Session 19 (dec19)"). release_thread_pool() frees the calling thread's pool
(omp_pause_resource_all, OpenMP 5.0), so the driver thread's is the only one; a later parallel region in the
calling thread starts a new pool. It changes when threads wait, never what they compute. Where the waiting
workers should not spin (a machine shared with other work), OMP_WAIT_POLICY=passive makes them sleep at once.
"""

from __future__ import annotations

import ctypes
import sys

OMP_PAUSE_HARD = 2
"""omp_pause_resource_t's omp_pause_hard (OpenMP 5.0): free the threads (libgomp treats soft alike)."""


def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process loaded (torch's), found in /proc/self/maps; None when none is loaded."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)  # already loaded: the same handle, no second runtime
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):
            return lib
    return None


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker threads (libgomp's omp_pause_resource_all); True if done.

    Call it from a thread that opened parallel regions (torch ops, numba kernels) and now hands the parallel
    work to another thread. False (nothing done) without a loaded libgomp that has it (not Linux, another
    OpenMP runtime) or when the runtime refuses (inside a parallel region).

    >>> import torch
    >>> _ = torch.ones(1 << 16).sum()
    >>> release_thread_pool() in (True, False)
    True
    """
    lib = _libgomp()
    if lib is None:
        return False
    return lib.omp_pause_resource_all(ctypes.c_int(OMP_PAUSE_HARD)) == 0
