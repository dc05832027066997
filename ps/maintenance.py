"""What a long-lived shard server does besides answering calls (transport-free, no grpc).

- Free finished runs: a run that has been over (finished, aborted past its grace,
  abandoned: ps/lifecycle.py) for --finished-run-retention-s loses its partitions and
  shared-memory arenas (`RunReaper`); `python -m ps.admin drop-run` does the same at
  once. Both are counted in GetShardStats (runs_freed, partitions_freed).
- Free unused registrations: a run that registered but never opened a Sync stream, with
  no Register, SeedRows, Flush or Checkpoint for --unused-registration-timeout-s, is
  freed the same way (logged `registration_expired`). It is not over: --exit-after-run
  does not stop for it, and a rank that comes later registers it again.
- Sweep leaked arenas: a rank whose Register failed (server down, refused) may leave its
  arena file `hybridps-<pid>-r<rank>-<random>.arena` in /dev/shm (an accepted arena's
  file is unlinked at once: the mapping lives on). `sweep_dead_arenas` removes such
  files when all of these hold: the name is an arena's; it is a regular file (not a
  link) owned by this server's user; its creator pid does not exist in this PID
  namespace (os.kill(pid, 0) -> ESRCH); it is older than MIN_ARENA_AGE_S. A pid that
  was reused by another process keeps its file (swept once that process is gone too):
  never a live process's arena. The pid test needs the server to see the workers'
  processes: the same PID namespace (docker-compose.yml: `pid: service:ps`); across
  namespaces the age rule alone guards an arena between its creation and its Register.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import stat
import time
from collections.abc import Callable

from hybridps.arena_layout import SHM_DIR
from hybridps.logs import kv
from ps.lifecycle import RunTracker
from ps.store import Store

log = logging.getLogger("ps.maintenance")

ARENA_NAME = re.compile(r"^hybridps-(\d+)-r(\d+)-[0-9a-f]+\.arena$")
MIN_ARENA_AGE_S = 60.0
MAINTENANCE_INTERVAL_S = 2.0
SWEEP_INTERVAL_S = 60.0


def pid_exists(pid: int) -> bool:
    if pid <= 0:
        return True  # not a process id we can judge: keep the file
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def sweep_dead_arenas(directory: str = SHM_DIR, *, uid: int | None = None,
                      min_age_s: float = MIN_ARENA_AGE_S,
                      alive: Callable[[int], bool] = pid_exists,
                      now: float | None = None) -> list[str]:
    """Remove leaked arenas of dead creators (module doc); returns the paths removed."""
    uid = os.getuid() if uid is None else uid
    now = time.time() if now is None else now
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        match = ARENA_NAME.match(entry.name)
        if match is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != uid
                or now - max(st.st_mtime, st.st_ctime) < min_age_s
                or alive(int(match.group(1)))):
            continue
        try:
            os.unlink(entry.path)
        except OSError:
            continue
        removed.append(entry.path)
        log.info(kv("arena_swept", path=entry.path, creator_pid=match.group(1),
                    bytes=st.st_size))
    return removed


class RunReaper:
    """Frees runs: on request (`drop`) or `retention_s` after they are over (`tick`)."""

    def __init__(self, store: Store, tracker: RunTracker, retention_s: float,
                 release_arena: Callable[[str, int, str], None] | None = None,
                 idle_timeout_s: float = 0.0, unused_timeout_s: float = 0.0) -> None:
        self.store = store
        self.tracker = tracker
        self.retention_s = retention_s
        self.release_arena = release_arena
        self.idle_timeout_s = idle_timeout_s
        self.unused_timeout_s = unused_timeout_s

    def drop(self, run_id: str, why: str) -> tuple[int, int]:
        """Free every partition (and arena) of `run_id`: (partitions, state bytes) freed."""
        ranks = [p.rank for p in self.store.partitions() if p.run_id == run_id]
        freed = self.store.drop_run(run_id, why)
        if self.release_arena is not None:
            for rank in ranks:
                self.release_arena(run_id, rank, why)
        self.tracker.forget(run_id)
        return freed

    def tick(self) -> None:
        """Re-apply the run rules, then free the runs over for longer than the retention
        and the unused registrations."""
        self.tracker.recheck_all()
        if self.idle_timeout_s > 0:
            self.tracker.check_idle(self.idle_timeout_s)
        if self.unused_timeout_s > 0:
            for run_id, idle in self.tracker.unused(self.unused_timeout_s):
                partitions, freed = self.drop(
                    run_id, f"registered without a Sync stream, unused for {idle:.0f}s "
                    f"(--unused-registration-timeout-s {self.unused_timeout_s:g})")
                log.info(kv("registration_expired", run=run_id, partitions=partitions,
                            state_bytes=freed, idle_s=f"{idle:.0f}"))
        for run_id in self.tracker.expired(self.retention_s):
            self.drop(run_id, f"over for {self.retention_s:g}s (--finished-run-retention-s)")


async def maintain(reaper: RunReaper, sweep_directory: str | None,
                   interval_s: float = MAINTENANCE_INTERVAL_S,
                   sweep_interval_s: float = SWEEP_INTERVAL_S) -> None:
    """The server's background task: reaper ticks, and (sweep_directory) arena sweeps at
    start and every sweep_interval_s. Runs until cancelled."""
    last_sweep = -float("inf")
    while True:
        try:
            reaper.tick()
            if sweep_directory is not None and time.monotonic() - last_sweep >= sweep_interval_s:
                last_sweep = time.monotonic()
                await asyncio.get_running_loop().run_in_executor(
                    None, sweep_dead_arenas, sweep_directory)
        except Exception as exc:  # never let housekeeping take the server down
            log.error(kv("maintenance_error", error=f"{type(exc).__name__}: {exc}"),
                      exc_info=exc)
        await asyncio.sleep(interval_s)
