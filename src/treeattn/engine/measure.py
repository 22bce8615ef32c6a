"""What each rank of the engine measures about itself: bytes communicated and resident memory.

    measurements = engine.rank_measurements(reset=True)   # one RankMeasurements per rank
    ... run requests ...
    measurements = engine.rank_measurements()             # what they did since the reset

Every rank keeps a RankMeter. Each step adds what the rank communicated (treeattn.parallel.comm's
accounting) to the "prefill" bucket (a step with at least one prompt chunk) or the "decode" bucket
(a step of decoding sequences only), and counts the step. Resident memory is read from /proc on
Linux: the current resident set and its high-water mark since the last reset (writing 5 to
/proc/self/clear_refs resets it); elsewhere the process's peak and 0.

The collectives that carry the plans and this measurement itself are not counted: they are the
engine's control traffic, not the attention's.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass, field

from treeattn.parallel.comm import CommStats

STEP_KINDS = ("prefill", "decode")


@dataclass
class RankMeasurements:
    """One rank's counters since the last reset (picklable; plain values).

    Attributes:
        rank: the rank in the engine's group.
        steps: step kind ("prefill", "decode") -> steps run.
        comm: step kind -> CommStats.as_dict() of what this rank sent and received in those steps.
        kv_bytes: bytes of this rank's KV cache arena (the model's, and the draft model's if any).
        start_rss_bytes: resident bytes at the reset.
        rss_bytes: resident bytes now.
        peak_rss_bytes: the resident high-water mark since the reset (Linux; elsewhere the
            process's peak).
    """

    rank: int
    steps: dict[str, int] = field(default_factory=dict)
    comm: dict[str, dict] = field(default_factory=dict)
    kv_bytes: int = 0
    start_rss_bytes: int = 0
    rss_bytes: int = 0
    peak_rss_bytes: int = 0

    def bytes_sent(self, kind: str) -> float:
        """Bytes this rank sent in the steps of `kind` ("prefill" or "decode")."""
        return self.comm[kind]["bytes_sent"]


class RankMeter:
    """A rank's running counters (see the module docstring)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.reset()

    def reset(self) -> None:
        self.steps = dict.fromkeys(STEP_KINDS, 0)
        self.comm = {kind: CommStats() for kind in STEP_KINDS}
        self.start_rss = current_rss()
        reset_peak_rss()

    def add_step(self, kind: str, comm: CommStats) -> None:
        self.steps[kind] += 1
        self.comm[kind].add(comm)

    def read(self, kv_bytes: int) -> RankMeasurements:
        return RankMeasurements(rank=self.rank, steps=dict(self.steps),
                                comm={kind: stats.as_dict() for kind, stats in self.comm.items()},
                                kv_bytes=kv_bytes, start_rss_bytes=self.start_rss, rss_bytes=current_rss(),
                                peak_rss_bytes=peak_rss())


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
