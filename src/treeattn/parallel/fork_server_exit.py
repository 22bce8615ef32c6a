"""Imported by ta.spawn's fork server only (spawn.FORKSERVER_PRELOAD), never by anything else: when the
server exits, it removes its own listening socket file and the temporary directory that holds it.

multiprocessing's fork server listens on a Unix socket in a `pymp-*` directory under TMPDIR, which
the parent process removes at a normal exit. A parent killed by a signal never does; its fork server
outlives it by a moment (it exits once the parent's end of its pipe closes), and this module's atexit
hook runs then. The server's forks (the ranks) never run it: they end with os._exit, and the hook
checks the pid anyway.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import stat


def _unix_socket_paths() -> list[str]:
    """File paths of the Unix sockets this process has open (the fork server has exactly one)."""
    paths = []
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
        fd = int(name)
        with contextlib.suppress(OSError):
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            with socket.socket(fileno=os.dup(fd)) as sock:
                if sock.family == socket.AF_UNIX and isinstance(sock.getsockname(), str) and sock.getsockname():
                    paths.append(sock.getsockname())
    return paths


def _remove(pid: int, paths: list[str]) -> None:
    if os.getpid() != pid:
        return
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)
        directory = os.path.dirname(path)
        if os.path.basename(directory).startswith("pymp-"):
            with contextlib.suppress(OSError):
                os.rmdir(directory)  # only if empty: anything else in it is not ours


atexit.register(_remove, os.getpid(), _unix_socket_paths())
