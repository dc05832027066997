"""A process's own directory under a shared root, held by an `flock` on its lock file, and
the removal of those whose lock no live process holds (left by a process killed with
kill -9). The disk tiers' spill files live in one (ps/core/spill.py, the server's;
worker/updates/local_spill.py, a rank's): a cache of that process, never shared."""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

LOCK_NAME = "lock"


class LockedDir:
    """`root`/`prefix`PID-RANDOM, created mode 0700 and locked until `close`, which removes
    it with everything in it."""

    def __init__(self, root: Path, prefix: str) -> None:
        own = root / f"{prefix}{os.getpid()}-{os.urandom(4).hex()}"
        own.mkdir(mode=0o700)
        fd = os.open(own / LOCK_NAME, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0),
                     0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.path: Path | None = own
        self._lock_fd = fd

    def close(self) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            os.close(self._lock_fd)
            self.path, self._lock_fd = None, -1


def remove_stale(root: Path, prefix: str) -> int:
    """Remove the directories under `root` named `prefix`... whose lock no process holds;
    how many."""
    removed = 0
    for entry in sorted(root.iterdir()):
        if not entry.name.startswith(prefix) or entry.is_symlink() or not entry.is_dir():
            continue
        try:
            fd = os.open(entry / LOCK_NAME, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            fd = -1
        try:
            if fd >= 0:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # a live process's
                    continue
            shutil.rmtree(entry, ignore_errors=True)
            removed += 1
        finally:
            if fd >= 0:
                os.close(fd)
    return removed
