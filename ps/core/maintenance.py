"""What a long-lived shard server does besides answering calls (transport-free, no grpc).

- Free finished runs: a run that has been over (finished, aborted past its grace,
  abandoned: ps/core/lifecycle.py) for --finished-run-retention-s loses its partitions and
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
  link) owned by this server's user; it is older than MIN_ARENA_AGE_S; this server has
  not mapped it (`keep`: the arenas of registered ranks); and no process uses it.
  "Uses" is asked of the kernel, not of pids: a rank maps its arena from creation
  until it exits, so while the creator lives the file is open or mapped, and a write
  lease on it (F_SETLEASE, granted only when no other process has the file open or
  mapped) is refused. That holds across PID namespaces: docker-compose.yml keeps the
  worker out of the server's (the server's exit would kill it), and the pid in the name
  then means nothing here. On top, the creator pid must not exist in this namespace
  (os.kill(pid, 0) -> ESRCH): a file kept before is kept still. Where the kernel cannot
  tell (leases disabled: /proc/sys/fs/leases-enable) only that pid rule and the age
  apply, as before. The lease is held only while the file is unlinked, with no owner
  for its break signal (F_SETOWN 0: an open racing the sweep waits, nothing is
  signalled).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Collection

from hybridps.arena_layout import SHM_DIR
from hybridps.logs import kv
from ps.core.lifecycle import RunTracker
from ps.core.store import Store

log = logging.getLogger("ps.maintenance")

try:  # Linux: leases (F_SETLEASE); elsewhere only the pid and age rules
    import fcntl

    F_SETLEASE: int | None = getattr(fcntl, "F_SETLEASE", None)
except ImportError:  # pragma: no cover - not a POSIX system
    F_SETLEASE = None

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


def in_use(path: str) -> bool | None:
    """Whether any process, in any PID namespace, has `path` open or mapped (None: this
    kernel cannot tell). Unlinks nothing."""
    return _lease_and(path, None)


def _lease_and(path: str, then: Callable[[], None] | None) -> bool | None:
    """Take a write lease on `path` (refused while another process has it open or
    mapped: True), run `then` while holding it, release it. None: no leases here."""
    if F_SETLEASE is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # EWOULDBLOCK: another holds a lease on it; gone or unreadable: keep
        return True
    try:
        try:
            fcntl.fcntl(fd, F_SETLEASE, fcntl.F_WRLCK)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EBUSY):
                return True
            return None  # EINVAL/ENOSYS: leases off, or not a filesystem that has them
        try:
            fcntl.fcntl(fd, fcntl.F_SETOWN, 0)  # a lease break signals no one
            if then is not None:
                then()
        finally:
            fcntl.fcntl(fd, F_SETLEASE, fcntl.F_UNLCK)
        return False
    finally:
        os.close(fd)


def sweep_dead_arenas(directory: str = SHM_DIR, *, uid: int | None = None,
                      min_age_s: float = MIN_ARENA_AGE_S,
                      alive: Callable[[int], bool] = pid_exists,
                      keep: Collection[str] = (),
                      now: float | None = None) -> list[str]:
    """Remove leaked arenas of dead creators (module doc); returns the paths removed.
    `keep`: paths this server maps (ArenaRegistry.paths)."""
    uid = os.getuid() if uid is None else uid
    now = time.time() if now is None else now
    kept = {os.path.realpath(p) for p in keep}
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
                or os.path.realpath(entry.path) in kept
                or alive(int(match.group(1)))):
            continue
        unlinked: list[bool] = []

        def unlink(path: str = entry.path, unlinked: list[bool] = unlinked) -> None:
            with contextlib.suppress(OSError):
                os.unlink(path)
                unlinked.append(True)

        used = _lease_and(entry.path, unlink)
        if used is None:  # the kernel cannot tell: the pid and age rules alone decide
            unlink()
        if not unlinked:
            continue
        removed.append(entry.path)
        log.info(kv("arena_swept", path=entry.path, creator_pid=match.group(1),
                    bytes=st.st_size, in_use_known=used is not None))
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
                   sweep_interval_s: float = SWEEP_INTERVAL_S,
                   mapped: Callable[[], Collection[str]] = tuple) -> None:
    """The server's background task: reaper ticks, and (sweep_directory) arena sweeps at
    start and every sweep_interval_s, never of the paths `mapped()` names (the arenas this
    server maps). Runs until cancelled."""
    last_sweep = -float("inf")
    while True:
        try:
            reaper.tick()
            if sweep_directory is not None and time.monotonic() - last_sweep >= sweep_interval_s:
                last_sweep = time.monotonic()
                await asyncio.get_running_loop().run_in_executor(
                    None, functools.partial(sweep_dead_arenas, sweep_directory, keep=mapped()))
        except Exception as exc:  # never let housekeeping take the server down
            log.error(kv("maintenance_error", error=f"{type(exc).__name__}: {exc}"),
                      exc_info=exc)
        await asyncio.sleep(interval_s)
