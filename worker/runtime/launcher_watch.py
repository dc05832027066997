"""A rank ends within seconds of its launcher's death.

torchrun's agent is every local rank's parent (`hybridps-run` runs it in its own process).
Killed with SIGKILL it cannot stop them: they trained on for minutes, each holding its Sync
stream, and the server refused a `--resume` of the run ("1 Sync connection(s) use it")
until the user found and killed them. So a rank started by a launcher:

- asks Linux to send it SIGTERM when its parent dies (prctl PR_SET_PDEATHSIG): the graceful
  stop of worker/runtime/lifecycle.py (finish the step, flush, tell the server, exit);
- watches its parent from a thread (every platform; also a death before the prctl): when
  its parent changed, or the launcher's pid (HYBRIDPS_LAUNCHER_PID) is gone, it asks for the
  same stop;
- and exits at once when that stop did not end the process within `GONE_GRACE_S` (a rank
  blocked in a collective, or in the rendezvous whose store the agent held): the kernel
  closes its connections, and the server frees its stream.

A rank started without a launcher (`python -m worker.main`) is not watched: its parent is
a shell, which may well end first (nohup).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

from hybridps.logs import kv

log = logging.getLogger("worker.launcher_watch")

LAUNCHER_PID_ENV = "HYBRIDPS_LAUNCHER_PID"  # set by the launcher: the ranks' parent
GONE_GRACE_S = 10.0  # the graceful stop's time before the rank exits at once
POLL_S = 0.5
GONE_EXIT_CODE = 1
PR_SET_PDEATHSIG = 1  # linux/prctl.h
AGENT_ENV = "TORCHELASTIC_RESTART_COUNT"  # torchrun's agent sets it for every rank it starts


def launcher_pid() -> int | None:
    """The launcher's pid when a launcher started this rank (hybridps-run's, or torchrun's
    agent's: the parent), else None."""
    given = os.environ.get(LAUNCHER_PID_ENV, "")
    if given.isdigit():
        return int(given)
    if os.environ.get(AGENT_ENV) is not None:
        return os.getppid()
    return None


def set_parent_death_signal(sig: signal.Signals = signal.SIGTERM) -> bool:
    """Linux sends `sig` to this process when its parent dies; False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _exists(pid: int) -> bool:
    """The process is there and not a zombie (a killed launcher whose parent has not
    reaped it yet: kill(pid, 0) still finds it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's: it exists
        pass
    with contextlib.suppress(OSError, IndexError), open(f"/proc/{pid}/stat") as stat:
        # Linux: "pid (name) STATE ..."
        return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    return True


def _request_stop() -> None:
    from worker.runtime.lifecycle import STOP

    STOP.request("launcher gone")


class LauncherWatch(threading.Thread):
    """Polls for the launcher's death; then asks for the graceful stop and, after
    `grace_s`, ends the process (`exit_now`)."""

    def __init__(self, parent: int, launcher: int | None, grace_s: float = GONE_GRACE_S,
                 poll_s: float = POLL_S, on_gone: Callable[[], None] = _request_stop,
                 exit_now: Callable[[int], object] = os._exit) -> None:
        super().__init__(name="launcher-watch", daemon=True)
        self.parent = parent
        self.launcher = launcher
        self.grace_s = grace_s
        self.poll_s = poll_s
        self.on_gone = on_gone
        self.exit_now = exit_now
        self.stopped = threading.Event()  # to end the watch (tests)

    def gone(self) -> bool:
        """The parent this rank started under died (it was re-parented), or the launcher's
        pid no longer exists."""
        if os.getppid() != self.parent:
            return True
        return self.launcher is not None and not _exists(self.launcher)

    def run(self) -> None:
        while not self.gone():
            if self.stopped.wait(self.poll_s):
                return
        with contextlib.suppress(Exception):  # its stderr may have gone with the launcher
            log.warning(kv("launcher_gone", launcher=self.launcher or self.parent,
                           action="finish the step, flush, exit",
                           exit_after_s=self.grace_s))
        self.on_gone()
        if self.stopped.wait(self.grace_s):
            return
        with contextlib.suppress(Exception):
            log.warning(kv("launcher_gone", action="exit now"))
            logging.shutdown()
        self.exit_now(GONE_EXIT_CODE)


def watch_launcher() -> LauncherWatch | None:
    """At a rank's start: end with the launcher (see the module's docstring); None when no
    launcher started this rank."""
    launcher = launcher_pid()
    if launcher is None:
        return None
    set_parent_death_signal(signal.SIGTERM)
    watch = LauncherWatch(os.getppid(), launcher)
    watch.start()
    return watch
