"""Processes seen from /proc (Linux): children of a process, whether one is alive, waiting for rank processes.

    ranks = wait_for_ranks(parent, 2)       # the parent's rank processes (its children, or its fork server's), once they run
    their function
    assert wait_gone(ranks, 30) == []
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

SRC = os.environ.get("TREEATTN_FAULTS_SRC", str(Path(__file__).resolve().parents[2] / "src"))  # tests/helpers/ -> the repository


def default_signals() -> None:
    """preexec_fn for a child whose test sends it SIGINT or SIGHUP: those back to the default. A suite
    started in the background (`cmd &` ignores SIGINT, nohup SIGHUP) would hand the ignored signal
    down, and an ignored signal stays ignored across exec; a terminal's processes do not ignore them."""
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


def children(pid: int) -> list[int]:
    """Direct children of `pid` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return found


def descendants(pid: int) -> list[int]:
    """Children of `pid`, their children, and so on (Linux /proc)."""
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


def is_rank(pid: int) -> bool:
    """Whether `pid` is a rank of ta.spawn (its process name, set by the rank: treeattn-rankN)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().startswith("treeattn-rank")
    except OSError:
        return False


def alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie (an orphan's zombie may wait for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def has_socket(pid: int) -> bool:
    """A rank opens its store connection first thing in its main function: once it has a socket it
    is past its start-up and runs fn (or is about to). A forked rank holds its parent's sockets from
    the start, milliseconds before that."""
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:") for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


def wait_for_ranks(parent: subprocess.Popen, n: int, limit_s: float = 120.0) -> list[int]:
    """The pids of the parent's `n` rank processes (started by it or by its fork server), once all of
    them run their rank function."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        assert parent.poll() is None, parent.communicate()
        ranks = [pid for pid in descendants(parent.pid) if is_rank(pid) and has_socket(pid)]
        if len(ranks) >= n:
            return ranks
        time.sleep(0.2)
    raise AssertionError(f"the ranks did not start within {limit_s} s")


def wait_gone(pids: list[int], limit_s: float) -> list[int]:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]
