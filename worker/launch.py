"""`python -m worker.launch ARGS`: torchrun ARGS, ending with one clear line.

torchrun turns a SIGTERM/SIGINT it receives into a SignalException: it forwards the
signal to the ranks (which finish their step, flush, tell the server and exit 143:
worker/lifecycle.py), waits for them, and then dies of the exception with a traceback
and exit code 1. For a stop the user asked for (`docker compose stop`, Ctrl-C) this
launcher ends with 128 + the signal number (143 for SIGTERM) and one log line instead.

A rank that fails with a known error (server unreachable or refusing, a bad run id, no
checkpoint to resume: worker/main.py) prints one line and records it in its torchelastic
error file (`report_error`); torchrun then ends with its ChildFailedError traceback,
which this launcher replaces by that line, printed last (exit code 1, as torchrun's).
A failure without such a record (a crash) keeps torchrun's full report. Everything
else, exit codes included, is torchrun's own.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # torchrun sets it for each rank
MARK = "hybridps_error"  # in the record's extraInfo: a line of ours, not a traceback


def report_error(line: str) -> None:
    """Print a rank's one error line, and record it in the rank's torchelastic error file
    (in torchelastic's format: bare torchrun shows it in its failure report too)."""
    print(line, file=sys.stderr, flush=True)
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    record = {"message": {"message": line,
                          "extraInfo": {"timestamp": str(int(time.time())), MARK: True}}}
    with contextlib.suppress(OSError):
        Path(path).write_text(json.dumps(record))


def recorded_line(failures: dict[int, Any]) -> str | None:
    """The earliest line a failed rank recorded (`report_error`), or None."""
    ours = [f for f in failures.values()
            if isinstance(f.message, dict) and f.message.get("extraInfo", {}).get(MARK)]
    if not ours:
        return None
    return str(min(ours, key=lambda f: f.timestamp).message["message"])


def main(argv: Sequence[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    with tempfile.TemporaryDirectory(prefix="hybridps-launch-") as scratch:
        if not os.environ.get(ERROR_FILE_ENV):
            # torchrun copies the failed rank's record into its own error file, and logs an
            # error when it has none; the ranks get files of their own from torchrun.
            os.environ[ERROR_FILE_ENV] = os.path.join(scratch, "error.json")
        try:
            torchrun_main(list(sys.argv[1:] if argv is None else argv))
        except SignalException as exc:
            print(f"hybridps launch: stopped by {exc.sigval.name}: the ranks finished their "
                  "step and flushed", file=sys.stderr, flush=True)
            return 128 + int(exc.sigval)
        except ChildFailedError as exc:
            line = recorded_line(exc.failures)
            if line is None:
                raise
            print(line, file=sys.stderr, flush=True)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
