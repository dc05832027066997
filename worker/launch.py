"""`python -m worker.launch ARGS`: torchrun ARGS, ending quietly when told to stop.

torchrun turns a SIGTERM/SIGINT it receives into a SignalException: it forwards the
signal to the ranks (which finish their step, flush, tell the server and exit 143:
worker/lifecycle.py), waits for them, and then dies of the exception with a traceback
and exit code 1. For a stop the user asked for (`docker compose stop`, Ctrl-C) this
launcher ends with 128 + the signal number (143 for SIGTERM) and one log line instead.
Everything else, exit codes included, is torchrun's own.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(list(sys.argv[1:] if argv is None else argv))
    except SignalException as exc:
        print(f"hybridps launch: stopped by {exc.sigval.name}: the ranks finished their step "
              "and flushed", file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
