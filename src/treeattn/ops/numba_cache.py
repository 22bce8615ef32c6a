"""numba's on-disk cache, safe when several processes save to it at once.

numba (0.60-0.68, `numba.core.caching.IndexDataCacheFile.save`) saves a new signature of a kernel by reading the
kernel's index file, taking the first data file number the index does not name, rewriting the index and writing that
data file. Two processes saving two signatures of one kernel at the same moment both take the same number: one
signature's index entry is lost, and the entry left can name the data file the other process wrote last, so that a
later process loads one signature's machine code for another's argument types. That happens here: `python -m
treeattn.ops.warmup` compiles in two processes, the test suite compiles head shapes in a background process while
the tests compile others, and the ranks of a fresh install compile side by side.

lock_cache_saves() makes every save of this process hold an exclusive lock (flock) on the cache's directory for the
whole read-index, write-index, write-data sequence; processes that all hold it cannot interleave. Every treeattn
kernel module calls it when imported, before it defines a cached kernel. Loads take no lock: numba replaces each file
whole (a temporary file, then os.replace), so a reader sees an index and data files that a saver finished.
"""

from __future__ import annotations

import os

_locked = False


def lock_cache_saves() -> bool:
    """Make numba's cache saves in this process hold an exclusive flock on the cache directory, from now on.
    Idempotent. Returns whether saves are locked: False without fcntl (not POSIX), without numba, or with a numba
    whose cache has no IndexDataCacheFile.save (then nothing is changed).

    >>> lock_cache_saves() in (True, False)
    True
    >>> lock_cache_saves() == lock_cache_saves()
    True
    """
    global _locked
    if _locked:
        return True
    try:
        import fcntl

        from numba.core import caching
    except ImportError:
        return False
    save = getattr(getattr(caching, "IndexDataCacheFile", None), "save", None)
    if save is None:
        return False

    def locked_save(self, key, data):
        fd = os.open(os.path.dirname(self._index_path), os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return save(self, key, data)
        finally:
            os.close(fd)  # releases the lock

    locked_save.__wrapped__ = save
    caching.IndexDataCacheFile.save = locked_save
    _locked = True
    return True


__all__ = ["lock_cache_saves"]
