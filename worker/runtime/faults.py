"""Fault injection: make a chosen rank crash or stall at a chosen step (tests, campaigns).

The training loop and the checkpointer announce named points with
`reached(point, rank, step)`; a fault given in the environment fires at its point:

    HYBRIDPS_FAULT_KILL=RANK:STEP
        point "pushed" (right after the push of STEP): SIGKILL, in the first incarnation
        only (TORCHELASTIC_RESTART_COUNT 0 or unset), so `torchrun --max-restarts` brings
        the rank back and it passes the step again alive.
    HYBRIDPS_FAULT_CHECKPOINT=[RANK:]STEP:PHASE[:sleep=SEC]
        point "checkpoint.PHASE" of the checkpoint of STEP (PHASE one of
        CHECKPOINT_PHASES; RANK omitted: every rank): os._exit(FAULT_EXIT_CODE), or sleep
        SEC seconds.
    HYBRIDPS_FAULT_CUT=EVERY[:RANK]
        point "pushed" of every EVERY-th step (step % EVERY == EVERY - 1; RANK omitted:
        every rank), in every incarnation: break the rank's Sync connection (cancel its
        gRPC Sync stream), so that the client re-registers, reconnects and re-sends what
        was unanswered (soaks: campaigns/soak.py).

To add a kind of fault: announce a new point where it belongs (`reached("my.point", rank,
step)`), and add an entry to PARSERS: the environment variable and a function turning its
text into Faults (ValueError naming the text when it is not one). `Fault` already knows
exit, SIGKILL, sleep and cut (the Sync connection: what `on_cut` registered), per rank
or every rank, at one step or every EVERY-th, optionally only in the first
incarnation. The variables are read at every point (a test may change them between
calls); `check_environment()` parses them once at start, so a typo fails the run early.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger("worker.faults")

KILL_ENV = "HYBRIDPS_FAULT_KILL"
FAULT_ENV = "HYBRIDPS_FAULT_CHECKPOINT"
CUT_ENV = "HYBRIDPS_FAULT_CUT"
FAULT_EXIT_CODE = 43
CHECKPOINT_PHASES = ("start", "rows", "optim", "dense", "manifest", "after")
PUSHED = "pushed"

Action = Literal["exit", "kill", "sleep", "cut"]

# What a "cut" breaks: the update source registers how to break its Sync connection.
_cutters: list[Callable[[], None]] = []


def on_cut(cut: Callable[[], None]) -> Callable[[], None]:
    """Register `cut` (break this process's Sync connection); returns the unregister."""
    _cutters.append(cut)

    def unregister() -> None:
        if cut in _cutters:
            _cutters.remove(cut)

    return unregister


@dataclass(frozen=True)
class Fault:
    """Do `action` when rank `rank` (None: any rank) reaches `point` of step `step` (with
    `every` > 0: of every step s with s % every == step)."""

    point: str
    step: int
    rank: int | None
    action: Action
    seconds: float = 0.0
    first_incarnation_only: bool = False
    source: str = ""  # the variable it came from, for the log line
    every: int = 0

    def matches(self, point: str, rank: int, step: int,
                environ: Mapping[str, str]) -> bool:
        at = step % self.every if self.every > 0 else step
        if (point, at) != (self.point, self.step) or self.rank not in (None, rank):
            return False
        return not (self.first_incarnation_only
                    and environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0")

    def fire(self, rank: int, step: int) -> None:
        if self.action == "sleep":
            time.sleep(self.seconds)
            return
        if self.action == "cut":
            log.info("rank %d: %s: cutting the Sync connection at step %d", rank,
                     self.source, step)
            for cut in list(_cutters):
                cut()
            return
        log.warning("rank %d: %s: %s at step %d (%s)", rank, self.source,
                    "SIGKILL" if self.action == "kill" else "exiting", step, self.point)
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(FAULT_EXIT_CODE)


def parse_kill(spec: str) -> list[Fault]:
    """HYBRIDPS_FAULT_KILL=RANK:STEP."""
    want_rank, _, want_step = spec.partition(":")
    if not (want_rank.isdigit() and want_step.isdigit()):
        raise ValueError(f"{KILL_ENV}={spec!r} is not RANK:STEP (two integers)")
    return [Fault(PUSHED, int(want_step), int(want_rank), "kill",
                  first_incarnation_only=True, source=KILL_ENV)]


def parse_checkpoint(spec: str) -> list[Fault]:
    """HYBRIDPS_FAULT_CHECKPOINT=[RANK:]STEP:PHASE[:sleep=SEC]."""
    parts = spec.split(":")
    seconds = None
    if parts[-1].startswith("sleep="):
        seconds = parts.pop().split("=", 1)[1]
    if len(parts) == 2:
        parts.insert(0, "")
    if len(parts) != 3:
        raise ValueError(f"{FAULT_ENV}={spec!r} is not [RANK:]STEP:PHASE[:sleep=SEC]")
    want_rank, want_step, phase = parts
    if phase not in CHECKPOINT_PHASES:
        raise ValueError(f"{FAULT_ENV}={spec!r}: phase {phase!r} not in {CHECKPOINT_PHASES}")
    try:
        rank = int(want_rank) if want_rank else None
        step = int(want_step)
        sleep_s = float(seconds) if seconds is not None else 0.0
    except ValueError:
        raise ValueError(f"{FAULT_ENV}={spec!r} is not [RANK:]STEP:PHASE[:sleep=SEC] "
                         "(RANK, STEP integers, SEC a number)") from None
    return [Fault(f"checkpoint.{phase}", step, rank, "sleep" if seconds is not None else "exit",
                  sleep_s, source=FAULT_ENV)]


def parse_cut(spec: str) -> list[Fault]:
    """HYBRIDPS_FAULT_CUT=EVERY[:RANK]."""
    every, _, want_rank = spec.partition(":")
    if not (every.isdigit() and int(every) > 0 and (want_rank == "" or want_rank.isdigit())):
        raise ValueError(f"{CUT_ENV}={spec!r} is not EVERY[:RANK] (EVERY an integer > 0, "
                         "RANK an integer)")
    return [Fault(PUSHED, int(every) - 1, int(want_rank) if want_rank else None, "cut",
                  source=CUT_ENV, every=int(every))]


# environment variable -> its parser: one entry per kind of fault
PARSERS: dict[str, Callable[[str], list[Fault]]] = {
    KILL_ENV: parse_kill,
    FAULT_ENV: parse_checkpoint,
    CUT_ENV: parse_cut,
}


def faults_from(environ: Mapping[str, str] | None = None) -> list[Fault]:
    """Every fault the environment asks for (ValueError naming a malformed one)."""
    environ = os.environ if environ is None else environ
    out: list[Fault] = []
    for name, parse in PARSERS.items():
        if environ.get(name):
            out += parse(environ[name])
    return out


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Parse the fault variables now (at start), so a malformed one fails the run early."""
    faults_from(environ)


def reached(point: str, rank: int, step: int, environ: Mapping[str, str] | None = None
            ) -> None:
    """Rank `rank` is at `point` of step `step`: fire the faults set for it."""
    environ = os.environ if environ is None else environ
    if not any(environ.get(name) for name in PARSERS):
        return
    for fault in faults_from(environ):
        if fault.matches(point, rank, step, environ):
            fault.fire(rank, step)


def kill_point(rank: int, step: int) -> None:
    """The training loop's point right after pushing `step` (HYBRIDPS_FAULT_KILL, _CUT)."""
    reached(PUSHED, rank, step)


def fault_point(rank: int, step: int, phase: str) -> None:
    """A phase of the checkpoint of `step` (HYBRIDPS_FAULT_CHECKPOINT)."""
    reached(f"checkpoint.{phase}", rank, step)
