"""Collectives through shared memory, for the ranks of a group that all run on one host.

A decode step combines a few kilobytes per layer across the ranks, one layer after the other, so
each combine costs the latency of one collective, not its bytes. Between processes on one host,
gloo pays that latency in sockets, a helper thread and wake-ups: on this repository's 2-core VM a
SmolLM2 layer's combine takes 3.5-4.5 ms through gloo and 0.9 ms here, most of it the ranks' skew
(docs/benchmarks.md, "The shared-memory transport"). Here every rank writes its tensor into its
own slot of one shared mapping, raises its sequence number, and waits (spinning, then yielding)
until every rank's number has caught up; then each rank reads all p slots and reduces them itself,
in rank order, so every rank computes the same bytes. One round, no kernel call on the fast path;
vLLM's CPU back end has a shared-memory allreduce for the same reason.

    shm = SharedMemoryGroup.create(group)      # collective; None when the ranks span hosts
    group = shm or group                       # pass it wherever treeattn takes a group

treeattn.parallel.comm routes allreduce (sum, max), all-gather and broadcast of CPU tensors up to
`capacity_bytes` through it; everything else (point-to-point, CUDA tensors, larger tensors,
other reductions) goes to the wrapped process group, `shm.process_group`.

Memory order: a rank writes its data, then its sequence number; a reader sees the number, then
reads the data. x86-64 keeps stores in order and loads in order (TSO), so that is enough there;
create() returns None on other architectures rather than add fences from Python.

Two buffers (by the parity of the sequence number) make reuse safe: a rank can start collective
s + 1 only after every rank has published s, hence finished reading s - 1, whose buffer s + 1
overwrites. A rank that does not arrive within `timeout_s` makes the waiting ranks raise
TimeoutError naming it (ta.spawn also tears the group down when a rank dies).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import socket
import time
import uuid
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

DEFAULT_CAPACITY_BYTES = 1 << 18
"""The largest tensor a collective carries through shared memory unless the group is made with another:
a decode step's combine of a few kilobytes per layer fits many times over."""
SEGMENT_DIR = "/dev/shm"  # where create() makes a group's segment (a tmpfs on Linux)

_LINE = 64  # bytes: one cache line per rank's sequence number, and the alignment of every slot
_SUPPORTED_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.MAX)
_SPIN_CHECKS = 64  # checks before the first sched_yield
_YIELD_S = 0.02  # then yield (the core stays awake: a halted vCPU wakes up in ~1 ms) for this long
_SLEEP_S = 50e-6  # then sleep this long between checks, not to burn a core on a long wait
# words 1, 2 of a rank's flag line (by the sequence's parity): when it arrived (perf_counter_ns), when waits are counted
_STAMP = 1
_NUMPY_DTYPES = (torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


@dataclass
class WaitStats:
    """What a rank's shared-memory collectives waited for, in nanoseconds (SharedMemoryGroup.count_waits).

    calls: collectives counted. late_ns: the time from this rank's arrival to the last rank's (waiting
    for a rank that had not arrived: the ranks' imbalance, or a peer descheduled). handoff_ns: the time
    from the last rank's arrival to this rank seeing it (the handshake's own latency: spinning, a yield
    or a sleep in progress). Arrival times are every rank's time.perf_counter_ns(), one clock on one
    host (CLOCK_MONOTONIC on Linux).

    >>> stats = WaitStats()
    >>> stats.add(arrived=100, last=350, seen=360); stats.add(arrived=500, last=500, seen=502)
    >>> stats
    WaitStats(calls=2, late_ns=250, handoff_ns=12)
    """

    calls: int = 0
    late_ns: int = 0
    handoff_ns: int = 0

    def add(self, arrived: int, last: int, seen: int) -> None:
        self.calls += 1
        self.late_ns += last - arrived
        self.handoff_ns += max(0, seen - last)


class SharedMemoryGroup:
    """A process group whose small CPU collectives go through one shared mapping (see the module).

    Build it with create() on every rank of `process_group`. Attributes: process_group (the
    wrapped group, None for the world), rank, size, capacity_bytes, timeout_s, waits (a WaitStats
    while the group counts its waits, else None).
    """

    spin_s = 0.0
    """Seconds a waiting rank checks the flags without yielding its core, after its first _SPIN_CHECKS checks
    (set on the class, in every rank's process, before the collectives): 0 yields at once (the default)."""

    count_waits = False
    """Set True (on the class, in every rank's process, before the groups are made) to give every group
    a WaitStats in .waits: what each collective waited for (a benchmark's view; ~1 us a collective)."""

    def __init__(self, process_group, mapping: mmap.mmap, *, rank: int, size: int, capacity_bytes: int, timeout_s: float) -> None:
        self.process_group = process_group
        self.rank, self.size = rank, size
        self.capacity_bytes, self.timeout_s = capacity_bytes, timeout_s
        self._mapping = mapping
        self._flags = memoryview(mapping).cast("q")  # rank r's sequence number at index r * _LINE // 8
        self._arena = torch.frombuffer(mapping, dtype=torch.uint8)
        self._bytes = np.frombuffer(mapping, dtype=np.uint8)
        self._sequence = 0
        self._flag_indices = [r * _LINE // 8 for r in range(size)]
        self._array_slots: dict = {}  # (buffer parity, nbytes, dtype) -> the p slots as numpy views
        self.waits = WaitStats() if self.count_waits else None

    @classmethod
    def create(cls, process_group=None, *, capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
               timeout_s: float = 120.0) -> "SharedMemoryGroup | None":
        """Collective over `process_group` (None: the world): a SharedMemoryGroup when every rank
        runs on this host (same hostname and boot id) on x86-64 with /dev/shm, else None on every
        rank. capacity_bytes: the largest tensor one collective carries through shared memory."""
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be an int >= 1, got {capacity_bytes!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        size, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        root = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        hosts = [None] * size
        dist.all_gather_object(hosts, _host_key(), group=process_group)
        capacity = -(-capacity_bytes // _LINE) * _LINE
        nbytes = size * _LINE + 2 * size * capacity
        mapping, path, error = None, [None], None
        if rank == 0 and len(set(hosts)) == 1 and _supported():
            try:  # created (zero-filled) by rank 0 before the others learn its name
                path = [f"{SEGMENT_DIR}/{_segment_prefix(os.getpid())}{uuid.uuid4().hex[:12]}"]
                mapping = _map(path[0], nbytes, create=True)
            except OSError:
                path = [None]
        dist.broadcast_object_list(path, src=root, group=process_group)
        if path[0] is None:
            return None
        try:
            if rank != 0:
                mapping = _map(path[0], nbytes, create=False)
        except OSError as exc:
            error = f"rank {rank}: {exc}"
        finally:
            dist.barrier(group=process_group)  # every rank has mapped it (or failed): the name can go
            if rank == 0:
                os.unlink(path[0])
        errors = [None] * size
        dist.all_gather_object(errors, error, group=process_group)
        if any(errors):
            return None
        return cls(process_group, mapping, rank=rank, size=size, capacity_bytes=capacity, timeout_s=float(timeout_s))

    def fits(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> bool:
        """Whether a collective of `tensor` (with reduction `op`) goes through shared memory."""
        return (tensor.device.type == "cpu" and tensor.is_contiguous() and op in _SUPPORTED_OPS
                and tensor.numel() * tensor.element_size() <= self.capacity_bytes)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In place: tensor = op over the ranks' tensors (SUM or MAX), reduced in rank order."""
        if tensor.dtype in _NUMPY_DTYPES and not tensor.requires_grad:
            # numpy's elementwise ops give the same bits as torch's at a fraction of their fixed cost
            # (a decode step makes a few small all-reduces per layer: the cost is this fixed part).
            array = tensor.numpy().reshape(-1)
            slots = self._publish_array(array)
            reduce = np.add if op == dist.ReduceOp.SUM else np.maximum
            if self.size > 1:  # in rank order, straight into the tensor (one rank: it is the sum already)
                reduce(slots[0], slots[1], out=array)
            for other in slots[2:]:
                reduce(array, other, out=array)
            return tensor
        slots = self._publish(tensor)
        acc = slots[0].clone()
        for other in slots[1:]:
            if op == dist.ReduceOp.SUM:
                acc.add_(other)
            else:
                torch.maximum(acc, other, out=acc)
        return tensor.copy_(acc)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's tensor (same shape and dtype on every rank), in rank order, as new tensors."""
        return [slot.clone() for slot in self._publish(tensor)]

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """In place: tensor = group rank src's tensor."""
        slots = self._publish(tensor, write=self.rank == src)
        if self.rank != src:
            tensor.copy_(slots[src])
        return tensor

    def _publish(self, tensor: torch.Tensor, write: bool = True) -> list[torch.Tensor]:
        """Write `tensor` into this rank's slot of the next buffer, raise this rank's sequence
        number, wait for every rank's; returns the p slots of that buffer viewed like `tensor`."""
        nbytes = tensor.numel() * tensor.element_size()
        slots = [self._arena[s].view(tensor.dtype).view(tensor.shape) for s in self._next_slots(nbytes)]
        if write:
            slots[self.rank].copy_(tensor)
        self._arrive()
        return slots

    def _publish_array(self, array: np.ndarray) -> list[np.ndarray]:
        """_publish for a 1-D numpy array: the p slots as 1-D arrays of its dtype (views made once
        per buffer, size and dtype: a decode step repeats the same few)."""
        self._sequence += 1
        key = (self._sequence % 2, array.nbytes, array.dtype)
        slots = self._array_slots.get(key)
        if slots is None:
            slots = self._array_slots[key] = [self._bytes[s].view(array.dtype) for s in self._slots(self._sequence, array.nbytes)]
        np.copyto(slots[self.rank], array)
        self._arrive()
        return slots

    def _next_slots(self, nbytes: int) -> list[slice]:
        """The next collective's sequence number; the byte ranges of its p slots of `nbytes`, in rank order."""
        self._sequence += 1
        return self._slots(self._sequence, nbytes)

    def _slots(self, sequence: int, nbytes: int) -> list[slice]:
        """The byte ranges of collective `sequence`'s p slots of `nbytes`, in rank order (its buffer: the parity)."""
        base = self.size * _LINE + (sequence % 2) * self.size * self.capacity_bytes
        return [slice(base + r * self.capacity_bytes, base + r * self.capacity_bytes + nbytes) for r in range(self.size)]

    def _arrive(self) -> None:
        """Publish this rank's sequence number (its slot is written) and wait for every rank's."""
        if self.waits is not None:
            return self._arrive_counted()
        self._flags[self.rank * _LINE // 8] = self._sequence
        self._wait(self._sequence)

    def _arrive_counted(self) -> None:
        """_arrive, with this rank's arrival time published before its number and the wait counted (self.waits)."""
        # by parity: a rank can publish s + 2's stamp only after every rank published s + 1, after reading s's
        arrived, stamp = time.perf_counter_ns(), _STAMP + self._sequence % 2
        self._flags[self.rank * _LINE // 8 + stamp] = arrived
        self._flags[self.rank * _LINE // 8] = self._sequence
        self._wait(self._sequence)
        seen = time.perf_counter_ns()
        self.waits.add(arrived, max(self._flags[i + stamp] for i in self._flag_indices), seen)

    def _wait(self, sequence: int) -> None:
        flags, indices = self._flags, self._flag_indices
        start, checks = None, 0
        while True:
            if all(flags[i] >= sequence for i in indices):
                return
            checks += 1
            if checks <= _SPIN_CHECKS:
                continue
            now = time.monotonic()
            start = start or now
            if now - start < self.spin_s:
                continue
            if now - start > self.timeout_s:
                behind = [r for r, i in enumerate(indices) if flags[i] < sequence]
                raise TimeoutError(f"shared-memory collective #{sequence}: rank(s) {behind} did not arrive within "
                                   f"{self.timeout_s:g} s (dead, or calling a different collective)")
            if now - start < _YIELD_S:
                os.sched_yield()
            else:
                time.sleep(_SLEEP_S)


def shared_memory_group(process_group=None, *, device: torch.device | str = "cpu", timeout_s: float | None = None,
                        capacity_bytes: int = DEFAULT_CAPACITY_BYTES):
    """Collective: SharedMemoryGroup.create(process_group, capacity_bytes=...) when it can be made,
    else process_group itself: what to pass as `group` wherever treeattn combines across the ranks.
    The group itself comes back, with no collective, for one rank (or no torch.distributed) and for
    tensors on a `device` other than the CPU. timeout_s: None takes the process group's own timeout
    (120 s where it cannot be read), so a missing rank fails the shared-memory collectives when it
    would have failed gloo's. capacity_bytes: the largest tensor a collective carries through shared
    memory (the mapping holds 2 * p slots of it)."""
    if not (dist.is_available() and dist.is_initialized()) or torch.device(device).type != "cpu":
        return process_group
    if dist.get_world_size(process_group) == 1:
        return process_group
    if timeout_s is None:
        timeout_s = group_timeout_s(process_group) or 120.0
    return SharedMemoryGroup.create(process_group, capacity_bytes=capacity_bytes, timeout_s=timeout_s) or process_group


def group_timeout_s(process_group=None) -> float | None:
    """The timeout the process group was created with, in seconds; None where torch does not say
    (it is read through a private attribute of the group's CPU back end)."""
    group = dist.group.WORLD if process_group is None else process_group
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError, TypeError):
        return None


def _supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(SEGMENT_DIR)


def _segment_prefix(pid: int) -> str:
    return f"treeattn-{pid}-"  # the maker's pid in the name: remove_segments_of finds a dead maker's segment


def remove_segments_of(pid: int) -> list[str]:
    """Unlink the shared-memory segments that process `pid` made and left in /dev/shm; returns their paths.

    create()'s first rank names the segment and unlinks it once every rank has mapped it, so a name lasts
    only during a group's start-up; a first rank killed inside that window (SIGKILL: no cleanup of its own)
    leaves its segment behind. Call it for a process that has exited (ta.spawn's supervisor does, for each
    rank it reaps): the mappings still open elsewhere stay valid, only the name goes.

        >>> import os, subprocess, sys
        >>> child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid()); "
        ...     "open(f'/dev/shm/treeattn-{os.getpid()}-doctest', 'w').close()"], capture_output=True, text=True)
        >>> pid = int(child.stdout)
        >>> [os.path.basename(path) for path in remove_segments_of(pid)] == [f"treeattn-{pid}-doctest"]
        True
        >>> remove_segments_of(pid)
        []
    """
    if isinstance(pid, bool) or not isinstance(pid, int) or pid < 1:
        raise ValueError(f"pid must be a process id (an int >= 1), got {pid!r}")
    try:
        names = [name for name in os.listdir(SEGMENT_DIR) if name.startswith(_segment_prefix(pid))]
    except OSError:  # no /dev/shm: no segment was made
        return []
    removed = []
    for name in names:
        with contextlib.suppress(FileNotFoundError):  # unlinked meanwhile
            os.unlink(f"{SEGMENT_DIR}/{name}")
            removed.append(f"{SEGMENT_DIR}/{name}")
    return removed


def _host_key() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _map(path: str, nbytes: int, *, create: bool) -> mmap.mmap:
    """Map the shared file at `path` (created, zero-filled, by the first rank)."""
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes)
    except OSError:
        if create:
            os.unlink(path)
        raise
    finally:
        os.close(fd)
