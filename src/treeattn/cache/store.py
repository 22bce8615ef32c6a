"""The prefix cache's second tier: a directory of KV blocks on disk, kept across restarts and shared by processes.

    key = block_digest(parent_key, tokens[j * bs : (j + 1) * bs])   # the token-prefix hash chain (ROOT for j = 0)
    store = KVStore(directory, namespace, max_bytes=16 << 30)       # namespace: the model, KV dtype and layout
    store.put(key, payload)                                         # bytes, exactly as the arena holds them
    payload = store.get(key)                                        # None: absent, or corrupt (skipped, warned)

A block's key is the digest of the whole token prefix it ends (its parent's key and its own tokens),
so a block found under a key holds the keys and values of exactly that prefix, wherever it sits in
the sequence. Everything that makes two blocks of one prefix differ -- the model's weights, the KV
dtype, the block shape -- goes into the namespace, a hex digest that names a subdirectory: a store
of another model or dtype is another subdirectory and never matches (treeattn.engine.kv_tier makes
the namespace). A block's bytes do not depend on the rank that holds it, so the namespace holds no
rank: an engine of any rank count reads any block (a store is re-sharded by reading it).

    DIRECTORY/<namespace hex>/<key hex>.kvb     one block: a 64-byte header, then the payload
    DIRECTORY/.lock                             taken (fcntl.flock) by the eviction pass

Header: MAGIC (8 bytes), namespace (16), key (16), payload length (8, little-endian), blake2b-128
of the payload (16). get() checks all of them and the file's length; a file that fails (corrupt,
truncated, another namespace's) is logged as a warning, removed and reported as a miss, never
returned. File names are hex digests only, so nothing is written outside the directory.

Safe across processes: put() writes a temporary file in the same subdirectory and renames it into
place (os.replace, atomic on POSIX), so a reader sees a whole file or none, and two writers of one
key leave one whole file (the blocks are the same bytes). After its writes, a process with
max_bytes evicts under the directory's lock: it scans every namespace's files and deletes the
least recently used (by mtime: get() touches a file it reads; atime is often not kept) until the
directory holds at most max_bytes. Temporary files of a writer that died are removed by that pass
once STALE_TMP_S old. Files are not fsync'ed: a process that crashes leaves its finished writes in
the page cache (they survive); a power loss may leave a truncated file, which the checksum catches.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import struct
import tempfile
import time

logger = logging.getLogger(__name__)

DIGEST_SIZE = 16
ROOT = bytes(DIGEST_SIZE)
"""The parent key of a sequence's first block."""
MAGIC = b"TAKVBLK1"
HEADER = struct.Struct(f"<8s{DIGEST_SIZE}s{DIGEST_SIZE}sQ{DIGEST_SIZE}s")  # magic, namespace, key, length, checksum
SUFFIX = ".kvb"
STALE_TMP_S = 600.0
_HEX = re.compile(rf"[0-9a-f]{{{2 * DIGEST_SIZE}}}")


def block_digest(parent: bytes, tokens) -> bytes:
    """The key of a block: blake2b-128 of its parent's key and its token ids (int32, little-endian).

    >>> a = block_digest(ROOT, [1, 2, 3, 4])
    >>> len(a), a == block_digest(ROOT, (1, 2, 3, 4)), a == block_digest(ROOT, [1, 2, 3, 5])
    (16, True, False)
    """
    h = hashlib.blake2b(parent, digest_size=DIGEST_SIZE)
    h.update(struct.pack(f"<{len(tokens)}i", *tokens))
    return h.digest()


def chain_digests(tokens, block_size: int, num_blocks: int, parent: bytes = ROOT, first: int = 0) -> list[bytes]:
    """The keys of blocks first..num_blocks-1 of `tokens` (`parent`: the key of block first - 1).

    >>> keys = chain_digests(list(range(12)), 4, 3)
    >>> keys[1] == block_digest(keys[0], [4, 5, 6, 7]), chain_digests(list(range(12)), 4, 3, keys[0], 1) == keys[1:]
    (True, True)
    """
    out = []
    for j in range(first, num_blocks):
        parent = block_digest(parent, tokens[j * block_size : (j + 1) * block_size])
        out.append(parent)
    return out


def namespace(*parts) -> str:
    """A namespace: the hex blake2b-128 of the parts' reprs (strings, numbers, tuples of them).

    >>> ns = namespace("model digest", "bfloat16", (30, 2, 256, 3, 64))
    >>> len(ns), ns == namespace("model digest", "float32", (30, 2, 256, 3, 64))
    (32, False)
    """
    return hashlib.blake2b(repr(parts).encode(), digest_size=DIGEST_SIZE).hexdigest()


class KVStore:
    """One namespace of a directory of KV blocks (see the module docstring).

    Args:
        directory: the store's directory (created if missing).
        namespace: a hex digest of DIGEST_SIZE bytes (namespace()).
        max_bytes: the most bytes the whole directory may hold (every namespace), or None: no bound.

    Example (a payload is any bytes; the engine's are a block's arena bytes)::

        >>> import tempfile
        >>> store = KVStore(tempfile.mkdtemp(), namespace("a model"), max_bytes=1 << 20)
        >>> key = block_digest(ROOT, [1, 2, 3, 4])
        >>> store.get(key) is None, store.put(key, b"keys and values"), store.get(key)
        (True, 79, bytearray(b'keys and values'))
        >>> other = KVStore(store.root, namespace("another model"))
        >>> other.get(key) is None                       # another model's namespace never matches
        True
    """

    def __init__(self, directory: str | os.PathLike, namespace: str, *, max_bytes: int | None = None) -> None:
        if not isinstance(namespace, str) or not _HEX.fullmatch(namespace):
            raise ValueError(f"namespace must be {2 * DIGEST_SIZE} lowercase hex digits, got {namespace!r}")
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
            raise ValueError(f"max_bytes must be an int >= 1 or None, got {max_bytes!r}")
        self.root = os.path.abspath(os.fspath(directory))
        self.namespace, self.max_bytes = namespace, max_bytes
        self._ns = bytes.fromhex(namespace)
        self.dir = os.path.join(self.root, namespace)
        os.makedirs(self.dir, exist_ok=True)

    def path(self, key: bytes) -> str:
        """The file of block `key` (its hex digest: no path can come from a key)."""
        if not isinstance(key, bytes) or len(key) != DIGEST_SIZE:
            raise ValueError(f"key must be {DIGEST_SIZE} bytes, got {key!r}")
        return os.path.join(self.dir, key.hex() + SUFFIX)

    def __contains__(self, key: bytes) -> bool:
        return os.path.exists(self.path(key))

    def put(self, key: bytes, payload) -> int:
        """Write block `key` (atomically: a temporary file, then a rename). Returns the bytes
        written: 0 when the block is there already or alone exceeds max_bytes."""
        path = self.path(key)
        payload = memoryview(payload).cast("B")
        size = HEADER.size + payload.nbytes
        if os.path.exists(path):
            return 0
        if self.max_bytes is not None and size > self.max_bytes:
            logger.warning("KV store: a block of %d bytes exceeds --kv-store-bytes %d; not stored", size, self.max_bytes)
            return 0
        checksum = hashlib.blake2b(payload, digest_size=DIGEST_SIZE).digest()
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(HEADER.pack(MAGIC, self._ns, key, payload.nbytes, checksum))
                f.write(payload)
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise
        return size

    def get(self, key: bytes) -> bytearray | None:
        """The payload of block `key`, or None when it is absent or fails its checks (then it is
        logged as a warning and removed). A block read is marked used now (its mtime), for LRU."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                data = data[: f.readinto(data)]
        except FileNotFoundError:
            return None
        problem = self._check(data, key)
        if problem is not None:
            logger.warning("KV store: skipping %s: %s", path, problem)
            _unlink(path)
            return None
        try:
            os.utime(path)
        except OSError:  # evicted by another process meanwhile: the bytes read are whole and checked
            pass
        del data[: HEADER.size]
        return data

    def _check(self, data: bytearray, key: bytes) -> str | None:
        if len(data) < HEADER.size:
            return f"truncated ({len(data)} bytes, shorter than the header)"
        magic, ns, stored_key, length, checksum = HEADER.unpack_from(data)
        if magic != MAGIC:
            return "not a KV block file (bad magic)"
        if ns != self._ns or stored_key != key:
            return "its header names another namespace or block"
        if len(data) - HEADER.size != length:
            return f"truncated or overlong (payload {len(data) - HEADER.size} bytes, header says {length})"
        if hashlib.blake2b(memoryview(data)[HEADER.size :], digest_size=DIGEST_SIZE).digest() != checksum:
            return "checksum mismatch"
        return None

    def evict(self) -> int:
        """Under the directory's lock, delete least recently used blocks (every namespace) until the
        directory holds at most max_bytes, and stale temporary files. Returns the bytes it holds."""
        with open(os.path.join(self.root, ".lock"), "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                files, total = self._scan()
                files.sort()
                for _, size, path in files:
                    if self.max_bytes is None or total <= self.max_bytes:
                        break
                    _unlink(path)
                    total -= size
                return total
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _scan(self) -> tuple[list[tuple[float, int, str]], int]:
        """(mtime, size, path) of every block file under the root, and their total size; stale
        temporary files are removed on the way."""
        files, total, now = [], 0, time.time()
        for sub in os.scandir(self.root):
            if not (sub.is_dir(follow_symlinks=False) and _HEX.fullmatch(sub.name)):
                continue
            for entry in os.scandir(sub.path):
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if entry.name.startswith(".tmp-"):
                    if now - st.st_mtime > STALE_TMP_S:
                        _unlink(entry.path)
                    continue
                if entry.name.endswith(SUFFIX):
                    files.append((st.st_mtime, st.st_size, entry.path))
                    total += st.st_size
        return files, total

    def total_bytes(self) -> int:
        """Bytes of every block file in the directory (all namespaces)."""
        return self._scan()[1]

    def __repr__(self) -> str:
        return f"KVStore({self.dir!r}, max_bytes={self.max_bytes})"


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
