"""`hybridps-run ARGS` (= `python -m worker.launch ARGS`): torchrun ARGS, whose last line is
ours.

The flags are torchrun's (`--standalone --nproc_per_node 2 worker/main.py --ps ...`).
What it adds:

- **Checks before any rank starts** when the script is worker/main.py: the worker's flags
  (a misspelled flag: exit 2 with argparse's line), then its data directory and its shard
  server (worker/config/preflight.py): one line naming the value and what to do, exit 2 (data) or
  1 (server), in a second or two instead of after the ranks' imports and rendezvous.
- **A known error of a rank ends on its one line.** A rank that fails with a known error
  (server unreachable or refusing, a bad run id, no checkpoint to resume: worker/main.py)
  records its line in its torchelastic error file (`report_error`); the launcher prints the
  earliest such line last, and exits with that rank's exit code, without torchrun's
  ChildFailedError traceback, `Failures:` block or log lines. A rank that crashed gets one
  line naming it and its exit code or signal (its traceback is above, from the rank).
- **A stop the user asked for exits 0.** torchrun forwards SIGTERM/SIGINT (Ctrl-C) to the
  ranks, which finish their step, flush, tell the server and exit (worker/runtime/lifecycle.py);
  each writes a note to the launcher (`note_stop`). When every rank of this node noted a
  clean stop, the launcher prints the step and exits 0; when one did not (it was killed,
  or the stop came before training started) it exits 128 + the signal (130 for SIGINT,
  143 for SIGTERM). A scheduler that must tell a run stopped early from a finished one
  sets HYBRIDPS_STOP_EXIT_CODE=signal: a clean stop then exits 128 + the signal too.
- **A second stop signal (a double Ctrl-C) stops at once**: the launcher kills the ranks
  that have not noted their stop yet (each noted its pid at start: `note_start`), and its
  last line says which ranks flushed and which were cut short (exit 128 + the first
  signal). Once torchrun returned, further signals are ignored: the exit code is the one
  the last line tells.
- **Ranks end when the launcher dies** (`kill -9`): see worker/runtime/launcher_watch.py; the
  launcher gives them its pid (HYBRIDPS_LAUNCHER_PID).
- torchrun's own log lines about the ranks' processes (its OMP_NUM_THREADS banner: the
  launcher sets OMP_NUM_THREADS=1 itself when unset and more than one rank runs, as
  torchrun would; closing signals; exit codes) are left out, unless LOGLEVEL is set
  (torchrun's variable: LOGLEVEL=INFO shows them all).

Under a bare torchrun the worker still checks everything before its rendezvous, and
only rank 0 prints a known error (once); the other ranks record it and exit with the same
code. torchrun then adds its ChildFailedError report, and ends a signalled stop with a
SignalException traceback and exit code 1.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from worker.runtime.launcher_watch import LAUNCHER_PID_ENV

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # torchrun sets it for each rank
MARK = "hybridps_error"  # in the record's extraInfo: a line of ours, not a traceback
LAUNCHER_DIR_ENV = "HYBRIDPS_LAUNCHER_DIR"  # set by the launcher: ranks leave notes there
STOP_EXIT_ENV = "HYBRIDPS_STOP_EXIT_CODE"  # "signal": a clean stop exits 128 + the signal
PROG = "hybridps-run"
WORKER_MAIN = Path(__file__).resolve().with_name("main.py")
# torchrun's loggers whose lines the launcher's last line replaces (the rendezvous's stay)
QUIET_LOGGERS = ("torch.distributed.run", "torch.distributed.elastic.multiprocessing",
                 "torch.distributed.elastic.agent")


def _rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)


PEER_GRACE_S = 5.0  # report_error: the longest rank != 0 waits for rank 0's line


def _wait_for_rank0_record(own_error_file: str, grace_s: float) -> None:
    """Until rank 0's error file exists (rank 0 prints its line, then writes the file) or
    `grace_s` passed. torchrun gives each local rank <attempt dir>/<local rank>/error.json:
    on rank 0's node the file sits beside ours; elsewhere the full grace is waited."""
    if int(os.environ.get("GROUP_RANK", "0") or 0) != 0:  # not rank 0's node
        time.sleep(grace_s)
        return
    own = Path(own_error_file)
    rank0 = own.parent.parent / "0" / own.name
    deadline = time.monotonic() + grace_s
    while not rank0.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


@contextlib.contextmanager
def flag_errors(rank: int) -> Iterator[None]:
    """Around the parse of the worker's flags: argparse's lines (usage, the bad value) come
    from rank 0 only, and a bad flag is recorded like any known error, so that under a bare
    torchrun the other ranks, which meet the same bad flag, wait for rank 0's line before
    they exit (torchrun stops every rank when the first one exits)."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured), \
                contextlib.redirect_stdout(io.StringIO()) if rank != 0 else \
                contextlib.nullcontext():
            yield
    except SystemExit as failed:
        text = captured.getvalue()
        if rank == 0:
            sys.stderr.write(text)
            sys.stderr.flush()
        lines = text.strip().splitlines()
        if failed.code not in (0, None) and lines:
            _record_error(lines[-1])
        raise
    if rank == 0:
        sys.stderr.write(captured.getvalue())


def report_error(line: str) -> None:
    """A rank's one error line: recorded in the rank's torchelastic error file (in
    torchelastic's format: a bare torchrun's failure report shows it too) and printed by
    rank 0 only; under the launcher, which prints it last, only when torchrun may restart
    the ranks (--max-restarts: each failure is then worth a line as it happens)."""
    restarts = (os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or "0") != "0"
    if _rank() == 0 and (restarts or not os.environ.get(LAUNCHER_DIR_ENV)):
        print(line, file=sys.stderr, flush=True)
    if os.environ.get(ERROR_FILE_ENV):
        _record_error(line)
    elif _rank() != 0 and not os.environ.get(LAUNCHER_DIR_ENV):
        print(line, file=sys.stderr, flush=True)  # no torchrun to report it


def _record_error(line: str) -> None:
    """`line` in this rank's torchelastic error file; a rank != 0 under a bare torchrun then
    waits for rank 0's record."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    record = {"message": {"message": line,
                          "extraInfo": {"timestamp": str(int(time.time())), MARK: True}}}
    with contextlib.suppress(OSError):
        write_whole(Path(path), json.dumps(record))
    if _rank() != 0 and not os.environ.get(LAUNCHER_DIR_ENV):
        # Bare torchrun stops every rank when the first one exits: give rank 0, which meets
        # the same error (the same flags and data), time to print it before we do.
        _wait_for_rank0_record(path, PEER_GRACE_S)


def write_whole(path: Path, text: str) -> None:
    """`text` as the file `path`, written under a temporary name in the same directory and
    renamed into place: a reader (a rank waiting for rank 0's record, torchrun reading a
    failed rank's, the launcher reading the notes) finds no file or the whole one, never
    an empty or half-written one, even when the writer is killed mid-write."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def note_start() -> None:
    """A rank tells the launcher its pid, so that a second stop signal can end it at once
    (no-op without a launcher)."""
    folder = os.environ.get(LAUNCHER_DIR_ENV)
    if folder:
        with contextlib.suppress(OSError):
            write_whole(Path(folder, f"started-{_rank()}.json"),
                        json.dumps({"rank": _rank(), "pid": os.getpid()}))


def note_stop(step: int, steps: int, flushed: bool, reason: str) -> None:
    """A rank stopped by a signal tells the launcher how it ended (no-op without one)."""
    folder = os.environ.get(LAUNCHER_DIR_ENV)
    if not folder:
        return
    note = {"rank": _rank(), "step": step, "steps": steps, "flushed": flushed,
            "reason": reason}
    with contextlib.suppress(OSError):
        write_whole(Path(folder, f"stopped-{_rank()}.json"), json.dumps(note))


def _recorded(failures: dict[int, Any]) -> Any | None:
    """The earliest failure whose rank recorded a line of ours (`report_error`), or None."""
    ours = [f for f in failures.values()
            if isinstance(f.message, dict) and f.message.get("extraInfo", {}).get(MARK)]
    return min(ours, key=lambda f: f.timestamp) if ours else None


def split_worker_args(argv: Sequence[str]) -> list[str] | None:
    """The worker's flags when the training script is worker/main.py (as a path, or
    `-m worker.main`), else None."""
    for i, token in enumerate(argv):
        if token == "worker.main" and i > 0 and argv[i - 1] in ("-m", "--module"):
            return list(argv[i + 1:])
        if token.endswith("main.py") and not token.startswith("-"):
            with contextlib.suppress(OSError):
                if Path(token).resolve() == WORKER_MAIN:
                    return list(argv[i + 1:])
    return None


def preflight(worker_argv: list[str]) -> tuple[str, int] | None:
    """The worker's flags, data and server checked here, before any rank starts: (the
    line, the exit code) of the first problem. Bad flags exit in argparse (2)."""
    from hybridps.cli import parse_config
    from hybridps.security import SecurityError
    from worker.config.nodes import split_ps
    from worker.config.preflight import data_problem, problem
    from worker.config.task_defaults import task_defaults
    from worker.config.train_config import TrainConfig

    cfg = parse_config(TrainConfig, worker_argv, prog="worker/main.py",
                       defaults=task_defaults)
    found = data_problem(cfg)
    if found is not None:
        return f"{PROG}: error: {found}", 2
    # one --ps entry: every rank of this node uses it; one per node: the rank's node is
    # known only after the rendezvous, so each rank checks its own
    ps = split_ps(cfg.sync.ps) if cfg.sync.update_kind.needs_server else []
    try:
        found = problem(cfg, ps[0] if len(ps) == 1 else None)
    except (ValueError, SecurityError) as exc:
        return f"{PROG}: error: {exc}", 2
    if found is not None:
        return f"{PROG}: error: {found}", 1
    return None


class _Quiet(logging.Filter):
    """Drops torchrun's lines about the ranks' processes (what our last line replaces)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.CRITICAL or not record.name.startswith(QUIET_LOGGERS)


def _quiet_torchrun() -> None:
    if os.environ.get("LOGLEVEL"):
        return
    for name in ("torch", "torch.distributed", ""):
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(_Quiet())


def _local_world_size(torchrun_argv: Sequence[str]) -> int:
    from torch.distributed.run import determine_local_world_size, parse_args

    with contextlib.suppress(Exception, SystemExit):
        return int(determine_local_world_size(parse_args(list(torchrun_argv)).nproc_per_node))
    return 1


def stop_line(sig: signal.Signals, notes: list[dict[str, Any]], expected: int,
              second: signal.Signals | None = None, started: Sequence[int] = ()
              ) -> tuple[str, int]:
    """The last line and the exit code after a stop signal, from the ranks' notes.

    `second`: a second stop signal came (the launcher then killed the ranks of `started`,
    those that noted a start, that had not noted their stop): the line says which ranks
    flushed and which were cut short."""
    code = 128 + int(sig)
    clean = len(notes) >= expected and all(n.get("flushed") for n in notes)
    if clean:  # every rank flushed before any second signal could cut it short
        step = max(int(n["step"]) for n in notes)
        steps = max(int(n.get("steps", 0)) for n in notes)
        line = (f"{PROG}: stopped by {sig.name} after step {step} of {steps}: every rank "
                "finished the step, flushed its updates and told the server")
        return line, code if os.environ.get(STOP_EXIT_ENV) == "signal" else 0
    if second is not None:
        return _cut_short_line(sig, second, notes, expected, started), code
    missing = expected - len(notes)
    why = (f"{missing} of {expected} ranks did not report a clean stop (stopped before "
           "training started, or killed)" if missing > 0 else
           "a rank could not flush its updates (see its line above)")
    return f"{PROG}: stopped by {sig.name}: {why}", code


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _cut_short_line(sig: signal.Signals, second: signal.Signals,
                    notes: list[dict[str, Any]], expected: int, started: Sequence[int]) -> str:
    flushed = [n for n in notes if n.get("flushed")]
    failed = sorted(int(n["rank"]) for n in notes if not n.get("flushed"))
    noted = {int(n["rank"]) for n in notes}
    cut = sorted(set(started) - noted)
    unknown = expected - len(noted | set(started))
    parts = []
    if flushed:
        step = max(int(n["step"]) for n in flushed)
        parts.append(f"{_ranks(sorted(int(n['rank']) for n in flushed))} finished step "
                     f"{step} and flushed")
    if failed:
        parts.append(f"{_ranks(failed)} could not flush (see its line above)")
    if cut:
        parts.append(f"{_ranks(cut)} stopped at once, without flushing")
    if unknown > 0:
        parts.append(f"{unknown} of {expected} ranks had not started training")
    return (f"{PROG}: stopped by {sig.name}, cut short by a second {second.name}: "
            + "; ".join(parts) + " (--resume goes on from the last checkpoint)")


def _read_json(folder: str, pattern: str) -> list[dict[str, Any]]:
    found = []
    for path in sorted(Path(folder).glob(pattern)):
        with contextlib.suppress(OSError, ValueError):
            found.append(json.loads(path.read_text()))
    return found


def _read_notes(folder: str) -> list[dict[str, Any]]:
    return _read_json(folder, "stopped-*.json")


class StopSignals:
    """torchrun's handler of its stop signals (SIGTERM, SIGINT, SIGHUP, SIGQUIT), counting
    them. The first raises SignalException as torchrun's own does: its agent forwards the
    signal to the ranks, which stop cleanly, and waits for them. A second one kills the
    ranks that noted a start (`note_start`) and no stop yet: the user asked twice, and a
    rank stopping cleanly could take the agent's whole 30 s."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.first: signal.Signals | None = None
        self.second: signal.Signals | None = None
        self.started: list[int] = []  # the ranks that had noted a start at the second

    def __call__(self, signum: int, _frame: object) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        sig = signal.Signals(signum)
        if self.first is None:
            self.first = sig
            raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)
        if self.second is None:
            self.second = sig
        stopped = {int(n["rank"]) for n in _read_notes(self.folder)}
        for note in _read_json(self.folder, "started-*.json"):
            rank = int(note["rank"])
            if rank not in self.started:
                self.started.append(rank)
            if rank not in stopped:
                with contextlib.suppress(OSError):
                    os.kill(int(note["pid"]), signal.SIGKILL)

    def install(self) -> bool:
        """In place of torchrun's handler, which its process context installs when it
        starts the ranks; False when this torch names it otherwise (its own stays)."""
        from torch.distributed.elastic.multiprocessing import api

        if not callable(getattr(api, "_terminate_process_handler", None)):
            return False
        api._terminate_process_handler = self  # type: ignore[assignment]
        return True


def _ignore_stop_signals() -> None:
    """After torchrun returned: the last line is said, nothing may change the exit code
    (a Python handler would be reset to the default at the interpreter's exit, and a
    late Ctrl-C there killed the launcher with 130 after a line that said exit 0)."""
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"):
        with contextlib.suppress(AttributeError, ValueError, OSError):
            signal.signal(getattr(signal, name), signal.SIG_IGN)


def _stop_signal_behind(exc: BaseException) -> Any:
    """The stop signal `exc` is or hides, else None: torch's metrics wrapper reads
    its timer in a `finally`, so a signal taken before the timer was set surfaces as an
    UnboundLocalError whose context is the SignalException."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, SignalException):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def failure_line(failures: dict[int, Any]) -> tuple[str, int]:
    """The last line and the exit code after a rank failed: its recorded line and its exit
    code, else a line naming the first rank that failed and how."""
    ours = _recorded(failures)
    if ours is not None:
        return str(ours.message["message"]), max(int(ours.exitcode), 1)
    # torchrun SIGTERMs the other ranks once one failed, within the same second (the
    # timestamps' unit): at a tie, the rank it did not stop itself is the cause.
    rank, first = min(failures.items(), key=lambda item: (
        item[1].timestamp, int(item[1].exitcode) == -signal.SIGTERM, item[0]))
    exitcode = int(first.exitcode)
    if exitcode < 0:  # killed by a signal
        return (f"{PROG}: error: rank {rank} was killed by {first.signal_name()} (out of "
                "memory, or killed from outside?)", 128 - exitcode)
    return (f"{PROG}: error: rank {rank} exited with code {exitcode} (its output above "
            "says why)", max(exitcode, 1))


@contextlib.contextmanager
def _launcher_environment(scratch: str) -> Iterator[None]:
    """The variables the ranks inherit from the launcher, set for the run only: a caller
    that runs the launcher in its own process (a test, a notebook) must not hand the next
    process it starts an error file inside a scratch directory that is gone."""
    names = (LAUNCHER_DIR_ENV, LAUNCHER_PID_ENV, ERROR_FILE_ENV)
    before = {name: os.environ.get(name) for name in names}
    os.environ[LAUNCHER_DIR_ENV] = scratch
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    if not os.environ.get(ERROR_FILE_ENV):
        # torchrun copies the failed rank's record into its own error file, and logs an
        # error when it has none; the ranks get files of their own from torchrun.
        os.environ[ERROR_FILE_ENV] = os.path.join(scratch, "error.json")
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _launch(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:  # Ctrl-C before torchrun's handlers took the signal over
        print(f"{PROG}: interrupted before any rank started", file=sys.stderr, flush=True)
        return 130


def _launch(args: list[str]) -> int:
    worker_argv = split_worker_args(args)
    if worker_argv is not None:
        found = preflight(worker_argv)
        if found is not None:
            print(found[0], file=sys.stderr, flush=True)
            return found[1]

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    _quiet_torchrun()
    local_world = _local_world_size(args)
    if "OMP_NUM_THREADS" not in os.environ and local_world > 1:
        os.environ["OMP_NUM_THREADS"] = "1"  # torchrun's own default, without its banner
    with tempfile.TemporaryDirectory(prefix="hybridps-launch-") as scratch, \
            _launcher_environment(scratch):
        signals = StopSignals(scratch)
        signals.install()
        try:
            try:
                torchrun_main(args)
            finally:
                _ignore_stop_signals()
        except ChildFailedError as exc:
            line, code = failure_line(exc.failures)
            print(line, file=sys.stderr, flush=True)
            return code
        except Exception as exc:  # a stop signal, or torchrun's own (a rendezvous timeout)
            stop = _stop_signal_behind(exc)
            if stop is None:
                print(f"{PROG}: error: torchrun: {type(exc).__name__}: {exc}",
                      file=sys.stderr, flush=True)
                return 1
            line, code = stop_line(stop.sigval, _read_notes(scratch), local_world,
                                   signals.second, signals.started)
            print(line, file=sys.stderr, flush=True)
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
