"""When is a run over on this server? (transport-free, no grpc, no torch)

`RunTracker` follows, per run, the ranks registered on this server, their
open Sync streams and their Finish calls. A run is over when
- every registered rank has sent Finish without aborting (the normal end: each
  rank's last Flush came first, so every acknowledged push is applied), or
- a rank finished with aborted=true (it stopped early: signal, error) and for
  `abort_grace_s` since then no rank of the run has had a Sync stream open and
  none has registered again. An aborted Finish does not end a run by itself:
  under `torchrun --max-restarts` the agent stops the other ranks (SIGTERM: they
  abort too) and starts the group again, and the new processes register (with
  the checkpoint to restore) within torchrun's restart time; the grace must be
  longer than that. Nothing tells the server whether a restart will come (a
  SIGTERM to one rank's process makes torchrun restart the group as well), so
  every abort waits the grace, or
- the run is abandoned: it had streams, none has been open for
  `idle_timeout_s`, and nobody finished (e.g. the worker was SIGKILLed).
A Register of a rank (a restarted process) makes its run live again: its
Finish is forgotten and the run is no longer over.
A run none of whose ranks ever opened a Sync stream is not over by any of these
rules: it is *unused* once it had no Register, SeedRows, Flush or Checkpoint for
--unused-registration-timeout-s (`unused`); the server then frees it (ps/core/maintenance.py)
without calling it over, so --exit-after-run does not stop for it.
The server uses this for --exit-after-run (it stops gracefully after the first
run that is over, which is how a `docker compose up` of one job ends) and to
free the partitions of runs that have been over for --finished-run-retention-s
(`expired`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hybridps.errors import Conflict, InvalidArgument, NotRegistered, StaleIncarnation
from hybridps.names import describe_problem

if TYPE_CHECKING:
    from ps.core.store import Store

# torchrun's restart: the agent notices the failure, SIGTERMs the other ranks (up to 30 s
# before SIGKILL), meets the rendezvous again and starts new processes, which import
# torch and build the model before they register: well under a minute on a loaded host.
DEFAULT_ABORT_GRACE_S = 60.0


@dataclass
class RankStatus:
    streams: int = 0
    finished: bool = False
    aborted: bool = False
    last_step: int = -1
    reason: str = ""


@dataclass
class RunStatus:
    ranks: dict[int, RankStatus] = field(default_factory=dict)
    ever_streamed: bool = False
    idle_since: float | None = None  # when the last open stream closed
    over: str = ""  # why the run is over ('' while it is not)
    over_at: float | None = None
    last_event: float = 0.0  # the newest Register or Finish of any rank
    # the newest Register, SeedRows, Flush or Checkpoint of any rank (the unused rule)
    last_activity: float = 0.0

    @property
    def state(self) -> str:
        """active | finished | aborted | abandoned (GetShardStats)."""
        if not self.over:
            return "active"
        if self.over.startswith("abandoned"):
            return "abandoned"
        return "aborted" if self.over.startswith("aborted") else "finished"

    @property
    def open_streams(self) -> int:
        return sum(r.streams for r in self.ranks.values())

    def summary(self) -> tuple[int, int]:
        """(ranks registered, ranks finished)."""
        return len(self.ranks), sum(r.finished for r in self.ranks.values())


class RunTracker:
    """Thread-safe; `on_over(run_id, why)` is called once per run, when it is over."""

    def __init__(self, on_over: Callable[[str, str], None] | None = None, *,
                 clock: Callable[[], float] = time.monotonic,
                 abort_grace_s: float = DEFAULT_ABORT_GRACE_S) -> None:
        self.on_over = on_over
        self.abort_grace_s = abort_grace_s
        self._clock = clock
        self._lock = threading.Lock()
        self._runs: dict[str, RunStatus] = {}

    def _rank(self, run_id: str, rank: int) -> tuple[RunStatus, RankStatus]:
        run = self._runs.setdefault(run_id, RunStatus())
        return run, run.ranks.setdefault(rank, RankStatus())

    def registered(self, run_id: str, rank: int) -> None:
        """A (re-)Register: the rank is live again, whatever it said before."""
        with self._lock:
            run, status = self._rank(run_id, rank)
            status.finished = status.aborted = False
            run.over, run.over_at = "", None
            run.last_event = run.last_activity = self._clock()

    def activity(self, run_id: str) -> None:
        """A SeedRows, Flush or Checkpoint of a registered run: it is being set up or used."""
        with self._lock:
            run = self._runs.get(run_id)
            if run is not None:
                run.last_activity = self._clock()

    def stream_opened(self, run_id: str, rank: int) -> None:
        with self._lock:
            run, status = self._rank(run_id, rank)
            status.streams += 1
            run.ever_streamed = True
            run.idle_since = None

    def stream_closed(self, run_id: str, rank: int) -> None:
        with self._lock:
            run, status = self._rank(run_id, rank)
            status.streams = max(0, status.streams - 1)
            if run.open_streams == 0:
                run.idle_since = self._clock()
            why = self._check(run)
        self._notify(run_id, why)

    def finish(self, run_id: str, rank: int, last_step: int, aborted: bool,
               reason: str) -> tuple[int, int, bool]:
        """Record a Finish; returns (ranks registered, ranks finished, run over now?)."""
        with self._lock:
            run, status = self._rank(run_id, rank)
            status.finished, status.aborted = True, aborted
            status.last_step, status.reason = last_step, reason
            run.last_event = self._clock()
            why = self._check(run)
            registered, finished = run.summary()
            over = bool(run.over)
        self._notify(run_id, why)
        return registered, finished, over

    def check_idle(self, idle_timeout_s: float) -> None:
        """Declare abandoned every run with no stream open for `idle_timeout_s`."""
        now = self._clock()
        over: list[tuple[str, str]] = []
        with self._lock:
            for run_id, run in self._runs.items():
                if (not run.over and run.ever_streamed and run.idle_since is not None
                        and now - run.idle_since >= idle_timeout_s):
                    run.over = (f"abandoned: no Sync stream open for {now - run.idle_since:.0f}s "
                                "and not every rank finished")
                    run.over_at = now
                    over.append((run_id, run.over))
        for run_id, why in over:
            self._notify(run_id, why)

    def unused(self, timeout_s: float) -> list[tuple[str, float]]:
        """(run id, seconds idle) of every run that is not over, never had a Sync stream,
        and had no activity for `timeout_s` (its registrations hold memory unused)."""
        now = self._clock()
        with self._lock:
            return [(rid, now - run.last_activity) for rid, run in self._runs.items()
                    if not run.over and not run.ever_streamed
                    and now - run.last_activity >= timeout_s]

    def recheck(self, run_id: str) -> None:
        """Re-apply the rules (the aborted rule waits `abort_grace_s`; call after it)."""
        with self._lock:
            run = self._runs.get(run_id)
            why = self._check(run) if run is not None else ""
        self._notify(run_id, why)

    def recheck_all(self) -> None:
        with self._lock:
            runs = list(self._runs)
        for run_id in runs:
            self.recheck(run_id)

    def status(self, run_id: str) -> RunStatus | None:
        with self._lock:
            return self._runs.get(run_id)

    def snapshot(self, run_id: str = "") -> list[tuple[str, RunStatus, float]]:
        """(run id, status, seconds since it is over (0: live)) of every run, or one."""
        now = self._clock()
        with self._lock:
            return [(rid, run, 0.0 if run.over_at is None else now - run.over_at)
                    for rid, run in sorted(self._runs.items()) if not run_id or rid == run_id]

    def expired(self, retention_s: float) -> list[str]:
        """The runs over for at least `retention_s` (their partitions may be freed)."""
        now = self._clock()
        with self._lock:
            return [rid for rid, run in self._runs.items()
                    if run.over_at is not None and now - run.over_at >= retention_s]

    def forget(self, run_id: str) -> None:
        with self._lock:
            self._runs.pop(run_id, None)

    def state(self, run_id: str, idle_timeout_s: float = 0.0) -> str:
        """What the stats call the run: finished | aborted | abandoned | active ('' unknown).

        aborted: a rank finished with aborted=true (the others stop with it); abandoned: no
        Sync stream open for `idle_timeout_s` (> 0) and not every rank finished, or the
        --exit-after-run rule already said so."""
        with self._lock:
            run = self._runs.get(run_id)
            if run is None:
                return ""
            ranks = list(run.ranks.values())
            if any(r.aborted for r in ranks):
                return "aborted"
            if ranks and all(r.finished for r in ranks):
                return "finished"
            if run.over.startswith("abandoned"):
                return "abandoned"
            idle = (run.ever_streamed and run.idle_since is not None and idle_timeout_s > 0
                    and self._clock() - run.idle_since >= idle_timeout_s)
            return "abandoned" if idle else "active"

    def _check(self, run: RunStatus) -> str:
        """Under the lock: mark the run over if it is; returns the reason when it just became so."""
        if run.over or not run.ranks:
            return ""
        ranks = run.ranks.values()
        aborted = sorted(k for k, r in run.ranks.items() if r.aborted)
        now = self._clock()
        quiet_since = max(run.last_event, run.idle_since or 0.0)
        if all(r.finished for r in ranks) and not aborted:
            run.over = "every rank finished"
        elif (aborted and all(r.streams == 0 for r in ranks)
              and now - quiet_since >= self.abort_grace_s):
            missing = sorted(k for k, r in run.ranks.items() if not r.finished)
            run.over = (f"aborted by ranks {aborted}; ranks {missing} have no stream open; no "
                        f"rank registered again within {self.abort_grace_s:g}s")
        else:
            return ""
        run.over_at = now
        return run.over

    def _notify(self, run_id: str, why: str) -> None:
        if why and self.on_over is not None:
            self.on_over(run_id, why)


def check_finish(store: Store, run_id: str, rank: int, incarnation: int, last_step: int,
                 aborted: bool) -> None:
    """Refuse a Finish that names no registered partition, an old process, or unapplied steps.

    A normal (not aborted) Finish must come after the rank's last Flush: every table
    of the partition has applied `last_step`.
    """
    what = f"finish run={run_id!r} rank={rank}"
    problem = describe_problem("run_id", run_id)
    if problem is not None:
        raise InvalidArgument(f"finish: {problem}")
    if last_step < -1:
        raise InvalidArgument(f"{what}: last_step={last_step} must be >= -1")
    part = store.partition(run_id, rank)
    if part is None:
        raise NotRegistered(f"{what}: not registered on this server (server {store.server_id})")
    if incarnation < part.incarnation:
        raise StaleIncarnation(f"{what}: incarnation {incarnation} is older than the registered "
                               f"incarnation {part.incarnation}")
    if aborted:
        return
    behind = sorted(f"{name}:{t.last_step}" for name, t in part.tables.items()
                    if t.last_step < last_step)
    if behind:
        raise Conflict(f"{what}: last_step {last_step} is not applied yet (tables {behind}); "
                       "Flush before Finish")
