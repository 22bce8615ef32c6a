"""ops.numba_cache: numba's cache saves hold an flock on the cache directory, in every process that imports a
treeattn kernel (two processes saving signatures of one kernel at once could otherwise leave an index entry naming
the other signature's machine code)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("numba")

PROBE = textwrap.dedent("""
    import treeattn.ops.combine_cpu_kernel  # a kernel module: importing it locks this process's saves
    from numba import njit

    @njit(cache=True)
    def twice(x):
        return 2 * x
""")


def test_importing_a_kernel_module_locks_the_saves():
    from numba.core import caching

    import treeattn.ops.paged_cpu_kernel  # noqa: F401
    from treeattn.ops.numba_cache import lock_cache_saves

    assert hasattr(caching.IndexDataCacheFile.save, "__wrapped__")
    assert lock_cache_saves() is True


def _blocked_on_flock(pid: int) -> bool:
    with open("/proc/locks") as f:
        return any("->" in line and "FLOCK" in line and f" {pid} " in line for line in f)


@pytest.mark.skipif(not os.path.exists("/proc/locks"), reason="needs Linux's /proc/locks to see a waiting flock")
def test_a_save_waits_while_another_process_holds_the_cache_lock(tmp_path):
    """The test holds the lock on the probe module's cache directory; the probe process compiles a cached kernel
    and must wait for the lock before it writes numba's index; once the lock is released it saves. Without the
    lock the probe would save and exit at once (the test fails then: it exits before it is seen waiting)."""
    (tmp_path / "lockprobe.py").write_text(PROBE)
    cache = tmp_path / "__pycache__"
    cache.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    fd = os.open(cache, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    probe = subprocess.Popen([sys.executable, "-c", "import lockprobe; print(lockprobe.twice(21))"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600  # bounds a failure only (a hung probe), never a passing run
    try:
        while not _blocked_on_flock(probe.pid):  # the probe reaches its save, or ends without waiting (a failure)
            assert time.monotonic() < deadline, "the probe neither waited for the lock nor ended"
            assert probe.poll() is None, f"the probe saved without waiting for the lock: {probe.communicate()}"
            time.sleep(0.05)
        assert not list(cache.glob("*.nbi")), "an index was written while the lock was held"
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    out, err = probe.communicate(timeout=300)
    assert probe.returncode == 0, err
    assert out.strip() == "42"
    assert len(list(cache.glob("lockprobe.twice-*.nbi"))) == 1
