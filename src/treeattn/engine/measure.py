"""What each rank of the engine measures about itself: bytes communicated and resident memory.

    measurements = engine.rank_measurements(reset=True)   # one RankMeasurements per rank
    ... run requests ...
    measurements = engine.rank_measurements()             # what they did since the reset

Every rank keeps a RankMeter. Each step adds its wall time and what the rank communicated
(treeattn.parallel.comm's accounting) to the "prefill" bucket (a step with at least one prompt
chunk) or the "decode" bucket (a step of decoding sequences only). Resident memory is read from
/proc on Linux: the resident set when a kind's first step began, and the high-water mark over the
steps of each kind (writing 5 to /proc/self/clear_refs resets the kernel's mark whenever the step
kind changes); elsewhere the process's peak and 0.

The collectives that carry the plans and this measurement itself are not counted: they are the
engine's control traffic, not the attention's.

Processes whose resident memory is measured (the demos', the evaluations', the benchmarks' ranks)
are spawned (ta.spawn(method="spawn")) inside `with malloc_env():` so that glibc returns large blocks
to the system when they are freed and the peaks follow the live tensors. A forked rank (ta.spawn's
default for CPU ranks of one thread) would start with the resident pages it shares with its parent,
and glibc reads MALLOC_ENV only when a process starts.
"""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Iterator
from dataclasses import dataclass, field

from treeattn.parallel.comm import CommStats

STEP_KINDS = ("prefill", "decode")

# Allocations above this size are mmap-ed and returned to the system when freed (glibc malloc), so
# resident memory follows live tensors and a measured peak means something.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


@contextlib.contextmanager
def malloc_env() -> Iterator[None]:
    """MALLOC_ENV in os.environ for the processes started inside (glibc reads it when a process
    starts); the environment as it was afterwards."""
    saved = {k: os.environ.get(k) for k in MALLOC_ENV}
    os.environ.update(MALLOC_ENV)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class RankMeasurements:
    """One rank's counters since the last reset (picklable; plain values). Per step kind
    ("prefill": a step with a prompt chunk; "decode": decoding sequences only):

    Attributes:
        rank: the rank in the engine's group.
        steps: kind -> steps run.
        step_s: kind -> wall seconds of each step on this rank (rank 0's include sampling).
        step_phases: kind -> per step, seconds of its parts: "attention" (local attention, all
            layers), "combine" (the cross-rank combine of run-by-run reads), "sampling" (rank 0:
            logits and sampling); a part a step did not run is absent (the rest of the step is
            the model's other work and the step's bookkeeping).
        comm: kind -> CommStats.as_dict() of what this rank sent and received in those steps.
        start_rss_bytes: kind -> resident bytes when the first step of that kind began.
        peak_rss_bytes: kind -> the resident high-water mark over the steps of that kind (Linux:
            the kernel's mark is reset whenever the step kind changes; elsewhere the process's
            peak). So "decode" is what decoding needs beside what the prefill left, the paper's
            memory figure, even when a long prefill peaked higher.
        kv_bytes: bytes of this rank's KV cache arena (the model's, and the draft model's if any).
        weight_bytes: bytes of the weights this rank holds (treeattn.models.packed.weight_bytes: the whole
            model, or with tensor parallelism its share).
        rss_bytes: resident bytes now.
    """

    rank: int
    steps: dict[str, int] = field(default_factory=dict)
    step_s: dict[str, list[float]] = field(default_factory=dict)
    step_phases: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    comm: dict[str, dict] = field(default_factory=dict)
    start_rss_bytes: dict[str, int] = field(default_factory=dict)
    peak_rss_bytes: dict[str, int] = field(default_factory=dict)
    kv_bytes: int = 0
    weight_bytes: int = 0
    rss_bytes: int = 0

    def bytes_sent(self, kind: str) -> float:
        """Bytes this rank sent in the steps of `kind` ("prefill" or "decode")."""
        return self.comm[kind]["bytes_sent"]


class RankMeter:
    """A rank's running counters (see the module docstring): call begin(kind) before a step and
    end(kind, comm, seconds, phases) after it."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.reset()

    def reset(self) -> None:
        self.steps = dict.fromkeys(STEP_KINDS, 0)
        self.step_s: dict[str, list[float]] = {kind: [] for kind in STEP_KINDS}
        self.step_phases: dict[str, list[dict[str, float]]] = {kind: [] for kind in STEP_KINDS}
        self.comm = {kind: CommStats() for kind in STEP_KINDS}
        self.start_rss: dict[str, int] = {}
        self.peak_rss: dict[str, int] = {}
        self._kind: str | None = None  # the kind of the last step, whose peak the kernel's mark holds

    def begin(self, kind: str) -> None:
        if kind == self._kind:
            return
        self._fold()
        reset_peak_rss()
        self._kind = kind
        self.start_rss.setdefault(kind, current_rss())

    def end(self, kind: str, comm: CommStats, seconds: float, phases: dict[str, float] | None = None) -> None:
        self.steps[kind] += 1
        self.step_s[kind].append(seconds)
        self.step_phases[kind].append(dict(phases or {}))
        self.comm[kind].add(comm)

    def _fold(self) -> None:
        if self._kind is not None:
            self.peak_rss[self._kind] = max(self.peak_rss.get(self._kind, 0), peak_rss())

    def read(self, kv_bytes: int, weight_bytes: int = 0) -> RankMeasurements:
        self._fold()
        return RankMeasurements(rank=self.rank, steps=dict(self.steps), step_s={k: list(v) for k, v in self.step_s.items()},
                                step_phases={k: list(v) for k, v in self.step_phases.items()},
                                comm={kind: stats.as_dict() for kind, stats in self.comm.items()},
                                start_rss_bytes=dict(self.start_rss), peak_rss_bytes=dict(self.peak_rss),
                                kv_bytes=kv_bytes, weight_bytes=weight_bytes, rss_bytes=current_rss())


def reset_peak_rss() -> None:
    """Reset this process's peak-RSS mark (Linux: write 5 to /proc/self/clear_refs); else nothing."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def current_rss() -> int:
    """Resident bytes of this process now (Linux /proc/self/statm), 0 where unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def peak_rss() -> int:
    """Peak resident bytes since the last reset_peak_rss (Linux VmHWM), else the process peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
