"""How long OpenMP's idle threads spin: set for this process before torch loads its OpenMP runtime.

torch's intra-op pool and numba's parallel kernels (the paged attention kernel on 2+ threads, the LM head's
packed product: numba's "omp" threading layer binds to the libgomp torch loaded) share one GNU OpenMP pool.
After each parallel region its idle workers spin GOMP_SPINCOUNT times (libgomp's default 300,000: a few
milliseconds) before they sleep, and a decode step opens one region a layer, so on one rank of 2 threads the
worker spins through the whole step, on the core that the step's other work and every other process need.
libgomp reads the variable once, when it loads (at `import torch`), so `import treeattn` imports this module
first, which calls limit_spin(): it puts SPIN_COUNT in the environment unless torch is imported already or the environment sets
GOMP_SPINCOUNT or OMP_WAIT_POLICY (yours win). Processes started from this one (the ranks) inherit it.
Measured under load on this project's 2-core AMD EPYC host (docs/bench_weights.md, "Session 18"): one rank's
SmolLM2 decode step at 4K took 62-73 ms of wall time with 10,000 spins against 400-460 ms with libgomp's
default. `GOMP_SPINCOUNT=300000 treeattn ...` restores libgomp's default.
"""

from __future__ import annotations

import os
import sys

SPIN_COUNT = 10_000
"""GOMP_SPINCOUNT that `import treeattn` sets where neither it nor OMP_WAIT_POLICY is set (see the module doc)."""


def limit_spin(environ=os.environ, modules=sys.modules) -> bool:
    """Set environ["GOMP_SPINCOUNT"] to SPIN_COUNT unless torch is in `modules` (its OpenMP runtime read the
    environment already) or environ sets GOMP_SPINCOUNT or OMP_WAIT_POLICY. Returns whether it did.

    >>> env = {}
    >>> limit_spin(env, modules={}), env
    (True, {'GOMP_SPINCOUNT': '10000'})
    >>> limit_spin({"OMP_WAIT_POLICY": "active"}, modules={}), limit_spin({}, modules={"torch": None})
    (False, False)
    """
    if "torch" in modules or "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return False
    environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    return True


limit_spin()

__all__ = ["SPIN_COUNT", "limit_spin"]
