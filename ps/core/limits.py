"""What a shard server will do for a request, whoever sends it (transport-free, no grpc).

- `StateBudget`: the host bytes all partitions may hold (--max-state-bytes), and those
  of one run (--max-run-state-bytes). A Register reserves its bytes before allocating
  anything; one that would exceed either is ResourceExhausted naming the sizes, with
  nothing allocated.
- Shares for paged rows (`paged_share`): a partition with dynamic tables reserves, at its
  Register, its whole share: the run's share (--max-run-state-bytes, else the server's
  limit / --run-shares) divided by the run's world size. What its fixed state leaves of
  that share is the quota of its paged-out rows, split over its dynamic tables in
  proportion to their fixed state. Every drop a table's Page call makes is decided
  against that table's own quota and bytes, so it depends only on the table's own
  history: never on how other ranks' or runs' calls interleave (two runs of a job under a
  budget are bitwise equal). A run on several nodes gets run share / world size per rank
  on each server (its ranks on other servers do not count here).
- Checkpoint directories: ps/core/checkpoint_dirs.py.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from hybridps.errors import ResourceExhausted

# Default --max-state-bytes: this share of the host's memory (or of the cgroup's limit,
# when lower). The rest is for the answer caches, messages in flight and, on a CPU
# node, the workers themselves.
DEFAULT_STATE_MEMORY_FRACTION = 0.75
# Default --run-shares: the runs with dynamic tables the budget holds side by side when
# --max-run-state-bytes is 0 (each reserves its share at Register).
DEFAULT_RUN_SHARES = 4
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
    """Thread-safe bytes reservation against a limit for all runs and one for each run
    (0: unlimited)."""

    def __init__(self, limit_bytes: int = 0, run_limit_bytes: int = 0,
                 run_shares: int = DEFAULT_RUN_SHARES) -> None:
        if limit_bytes < 0:
            raise ValueError(f"max_state_bytes={limit_bytes} must be >= 0 (0: no limit)")
        if run_limit_bytes < 0:
            raise ValueError(f"max_run_state_bytes={run_limit_bytes} must be >= 0 (0: no "
                             "limit of its own)")
        if run_shares < 1:
            raise ValueError(f"run_shares={run_shares} must be >= 1")
        self.limit_bytes = limit_bytes
        self.run_limit_bytes = run_limit_bytes
        self.run_shares = run_shares
        self._lock = threading.Lock()
        self._reserved = 0
        self._reserved_by_run: dict[str, int] = {}

    def reserve(self, nbytes: int, in_use: int, what: str, freed: int = 0, *,
                run_id: str = "", run_in_use: int = 0) -> None:
        """Reserve `nbytes` on top of `in_use` (held by partitions now; `run_in_use` of
        them by run `run_id`), of which `freed` (all of `run_id`) will be released by this
        same request; ResourceExhausted when over a limit."""
        with self._lock:
            used = in_use + self._reserved - freed
            if self.limit_bytes and used + nbytes > self.limit_bytes:
                raise ResourceExhausted(
                    f"{what}: needs {gib(nbytes)} of optimizer state; {gib(max(used, 0))} "
                    f"are in use of the server's limit of {gib(self.limit_bytes)} "
                    "(--max-state-bytes); nothing was allocated")
            run_used = run_in_use + self._reserved_by_run.get(run_id, 0) - freed
            if self.run_limit_bytes and run_used + nbytes > self.run_limit_bytes:
                raise ResourceExhausted(
                    f"{what}: needs {gib(nbytes)} of optimizer state; run {run_id!r} holds "
                    f"{gib(max(run_used, 0))} of its limit of {gib(self.run_limit_bytes)} "
                    "(--max-run-state-bytes); nothing was allocated")
            self._reserved += nbytes
            self._reserved_by_run[run_id] = self._reserved_by_run.get(run_id, 0) + nbytes

    @property
    def run_share(self) -> int:
        """The bytes one run may hold (0: no limit): --max-run-state-bytes, else the
        server's limit / --run-shares."""
        if self.run_limit_bytes:
            return min(self.run_limit_bytes, self.limit_bytes or self.run_limit_bytes)
        return self.limit_bytes // self.run_shares if self.limit_bytes else 0

    def paged_share(self, fixed_bytes: int, dynamic_fixed: list[int], world_size: int,
                    what: str) -> tuple[int, list[int]]:
        """(bytes a partition reserves, the paged-row quota of each of its dynamic
        tables) for a partition whose fixed state is `fixed_bytes`, `dynamic_fixed` of it
        by its dynamic tables (module doc; quotas 0: no limit). ResourceExhausted naming
        the sizes when its fixed state leaves nothing of its share."""
        share = self.run_share // max(world_size, 1)
        if not dynamic_fixed or not self.run_share:
            return fixed_bytes, [0] * len(dynamic_fixed)
        left = share - fixed_bytes
        if left <= 0:
            source = ("--max-run-state-bytes" if self.run_limit_bytes else
                      f"--max-state-bytes / --run-shares {self.run_shares}")
            raise ResourceExhausted(
                f"{what}: its share of the budget is {gib(share)} (the run's "
                f"{gib(self.run_share)}, {source}, over world size {world_size}) and its "
                f"fixed optimizer state needs {gib(fixed_bytes)}: nothing is left for paged "
                "rows; nothing was allocated")
        total = sum(dynamic_fixed) or len(dynamic_fixed)
        weights = dynamic_fixed if sum(dynamic_fixed) else [1] * len(dynamic_fixed)
        quotas = [max(1, left * w // total) for w in weights]
        return share, quotas

    def excess(self, in_use: int, run_in_use: int) -> int:
        """Bytes held beyond the server's limit or the run's, whichever is further over
        (<= 0: within both): what a dynamic table's paging must drop (ps/core/paging.py)."""
        server = in_use - self.limit_bytes if self.limit_bytes else 0
        run = run_in_use - self.run_limit_bytes if self.run_limit_bytes else 0
        return max(server, run)

    def release(self, nbytes: int, run_id: str = "") -> None:
        with self._lock:
            self._reserved -= nbytes
            left = self._reserved_by_run.get(run_id, 0) - nbytes
            if left > 0:
                self._reserved_by_run[run_id] = left
            else:
                self._reserved_by_run.pop(run_id, None)
