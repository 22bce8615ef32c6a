"""treeattn.ops.openmp: the calling thread's OpenMP pool is freed, and the next parallel region starts a new one."""

from __future__ import annotations

import pytest
import torch

from treeattn.ops.openmp import _libgomp, release_thread_pool


def test_release_thread_pool_then_parallel_work_runs_again():
    if _libgomp() is None:
        pytest.skip("no libgomp loaded in this process (not Linux, or torch built with another OpenMP runtime)")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.arange(1 << 18, dtype=torch.float64)
        before = (x * 2).sum().item()  # a parallel region in this thread: its pool exists
        assert release_thread_pool() is True
        assert (x * 2).sum().item() == before == float((1 << 18) * ((1 << 18) - 1))  # a new pool, the same sum
        assert release_thread_pool() is True  # and again
    finally:
        torch.set_num_threads(threads)
