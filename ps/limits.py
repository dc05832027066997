"""What a shard server will do for a request, whoever sends it (transport-free, no grpc).

- `CheckpointRoot`: the one directory tree the server writes checkpoints into and
  restores them from (--checkpoint-root). A request names a directory inside it
  (relative to it, or absolute); one that resolves outside it, through `..` or a
  symbolic link, is PermissionDenied. The check resolves the path when the request
  arrives: a process that can create symbolic links inside the root can still redirect
  a later write, so the root must be writable only by the server's user and the
  workers it serves.
- `StateBudget`: the host bytes all partitions may hold (--max-state-bytes). A Register
  reserves its bytes before allocating anything; one that would exceed the budget is
  ResourceExhausted naming the sizes, with nothing allocated.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from hybridps.errors import InvalidArgument, PermissionDenied, ResourceExhausted

# Default --max-state-bytes: this share of the host's memory (or of the cgroup's limit,
# when lower). The rest is for the answer caches, messages in flight and, on a CPU
# node, the workers themselves.
DEFAULT_STATE_MEMORY_FRACTION = 0.75
CGROUP_MEMORY_MAX = ("/sys/fs/cgroup/memory.max",  # cgroup v2
                     "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # v1


def host_memory_bytes() -> int:
    """Physical memory, or the cgroup memory limit of this process when lower (0: unknown)."""
    total = 0
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 0
    for path in CGROUP_MEMORY_MAX:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < (total or 2**62):
            total = int(text)
    return total


def default_max_state_bytes() -> int:
    return int(host_memory_bytes() * DEFAULT_STATE_MEMORY_FRACTION)


def gib(n: int) -> str:
    return f"{n} bytes ({n / 2**30:.3f} GiB)"


class StateBudget:
    """Thread-safe bytes reservation against a limit (0: unlimited)."""

    def __init__(self, limit_bytes: int = 0) -> None:
        if limit_bytes < 0:
            raise ValueError(f"max_state_bytes={limit_bytes} must be >= 0 (0: no limit)")
        self.limit_bytes = limit_bytes
        self._lock = threading.Lock()
        self._reserved = 0

    def reserve(self, nbytes: int, in_use: int, what: str, freed: int = 0) -> None:
        """Reserve `nbytes` on top of `in_use` (held by partitions now), of which `freed`
        will be released by this same request; ResourceExhausted when over the limit."""
        with self._lock:
            used = in_use + self._reserved - freed
            if self.limit_bytes and used + nbytes > self.limit_bytes:
                raise ResourceExhausted(
                    f"{what}: needs {gib(nbytes)} of optimizer state; {gib(max(used, 0))} "
                    f"are in use of the server's limit of {gib(self.limit_bytes)} "
                    "(--max-state-bytes); nothing was allocated")
            self._reserved += nbytes

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._reserved -= nbytes


class CheckpointRoot:
    """Resolves requested checkpoint directories inside one root (None: anywhere, for
    in-process use; the server always has a root)."""

    def __init__(self, root: str | Path | None) -> None:
        self.root = None if root is None else Path(os.path.realpath(root))

    def resolve(self, directory: str, what: str) -> Path:
        if not directory:
            raise InvalidArgument(f"{what}: the checkpoint directory must not be empty")
        if "\x00" in directory:
            raise InvalidArgument(f"{what}: checkpoint directory {directory!r} contains NUL")
        if self.root is None:
            return Path(directory)
        asked = Path(directory)
        resolved = Path(os.path.realpath(self.root / asked))  # absolute `asked` wins
        if resolved != self.root and self.root not in resolved.parents:
            raise PermissionDenied(
                f"{what}: checkpoint directory {directory!r} resolves to {str(resolved)!r}, "
                f"outside this server's --checkpoint-root {str(self.root)!r}; checkpoints "
                "are written and read only inside it")
        return resolved
