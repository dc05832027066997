"""Graceful stop of a worker rank: SIGTERM/SIGINT -> finish the step, flush, Finish, exit.

torchrun forwards SIGTERM to every rank (and SIGKILLs them ~30 s later). A rank
cannot just leave: the others would block in the next collective. So the
signal only sets a flag, and every `every` steps (--log-every, the steps where
the loss is all-reduced anyway) the ranks all-reduce their flags: when any
rank was signalled, all stop after that same step, drain and Flush their
updates (so the server holds every push up to it), send Finish(aborted) and
exit with STOPPED_EXIT_CODE; with --checkpoint-dir (and --checkpoint-on-stop) every rank
first checkpoints that step (worker/checkpoint/checkpointer.py `save_on_stop`). A second
signal exits at once (default action).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING, NoReturn

from hybridps.logs import kv

if TYPE_CHECKING:
    from worker.runtime.dist import DistContext

log = logging.getLogger("worker.lifecycle")

STOPPED_EXIT_CODE = 143  # 128 + SIGTERM: stopped early, but cleanly (flushed, Finish sent)


class StopFlag:
    """Set by a signal handler; read by the training loop."""

    def __init__(self) -> None:
        self.reason = ""
        self._event = threading.Event()

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def request(self, reason: str) -> None:
        if not self._event.is_set():
            self.reason = reason
            self._event.set()

    def clear(self) -> None:
        self.reason = ""
        self._event.clear()


STOP = StopFlag()


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    STOP.request(name)
    signal.signal(signum, signal.SIG_DFL)  # a second one: exit now
    log.warning(kv("signal", signal=name, action="finish the step, flush, exit"))


def install_signal_handlers() -> None:
    """SIGTERM/SIGINT request a graceful stop (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_signal)


def stop_agreed(step: int, every: int, ctx: DistContext, requested: bool | None = None
                ) -> bool:
    """Collective, at steps where (step + 1) % every == 0: True when any rank must stop.

    `requested`: this rank's flag as the loop read it earlier in the step (default: now);
    a signal after that read stops at the next agreement step."""
    if (step + 1) % max(every, 1):
        return False
    import torch
    import torch.distributed as dist

    from worker.runtime.device_copy import sync_point

    with sync_point("stop_flag"):
        mine = STOP.requested if requested is None else requested
        flag = torch.tensor([1.0 if mine else 0.0], device=ctx.device)
        if ctx.world_size > 1:
            dist.all_reduce(flag)
        stop = bool(flag.item() > 0)
    if stop:
        STOP.request("peer rank stopping")
        log.warning(kv("stopping", step=step, reason=STOP.reason))
    return stop


def exit_process(code: int) -> NoReturn:
    """Leave the process with `code` once everything is closed, without the interpreter's
    teardown of torch's C++ state.

    Why: after a clean finish (process groups destroyed, server told, results written), a
    rank can die in that teardown with SIGABRT ("terminate called without an active
    exception"; rare, docs/performance-log.md), and torchrun then reports a finished job
    as failed. The worker's threads (sync, input pipeline) are closed before this and
    writes are synchronous; the logs and standard streams are flushed here, so nothing an
    ordinary exit would have written is lost.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
