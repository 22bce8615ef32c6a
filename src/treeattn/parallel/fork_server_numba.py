"""Imported by ta.spawn's fork server only (spawn.FORKSERVER_PRELOAD), never by anything else: numba's CPU
target made ready once in the server, so that each forked rank does not make it again.

A process's first call of a numba kernel, even one loaded from numba's cache, first fills numba's typing and target
contexts (numba.np.arraymath and the other registries, and scipy's BLAS that numba probes): about a second of CPU.
Every rank paid it at its first kernel call (the paged attention, the packed products): 0.78-0.91 s of CPU against
0.08-0.12 s in a fork of a process that had done it (Intel Xeon, 2 cores, under load;
benchmarks/parallel/rank_first_kernel.py, raw docs/data/fork_server/). Done here, the ranks inherit it. It runs no
kernel and starts no thread: scipy's OpenBLAS is loaded with one thread unless the environment asks for more
(OPENBLAS_NUM_THREADS), and the ranks never call it. Without numba, nothing is done.
"""

from __future__ import annotations

import contextlib
import os


def _ready_numba() -> None:
    """Fill numba's CPU typing and target contexts (their registries) in this process, if numba is installed."""
    try:
        from numba.core.registry import cpu_target
    except ImportError:  # numba is optional: the ranks run the torch paths
        return
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # the server's own: each rank gets its caller's environment
    with contextlib.suppress(Exception):  # an internal of numba's that moved must not stop the server
        cpu_target.typing_context.refresh()
        cpu_target.target_context.refresh()


_ready_numba()
