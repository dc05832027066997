"""`python -m ps`: run one hybridps shard server.

    python -m ps --host 127.0.0.1 --port 0 --port-file /tmp/ps.port

Every flag can also come from the environment as HYBRIDPS_<FLAG> (e.g.
HYBRIDPS_MAX_MESSAGE_BYTES); see `python -m ps --help` and docs/flags.md. The flags are
checked before torch and grpc are imported, so a bad one fails at once (one line, exit 2),
and so does a --checkpoint-root that is not a directory or a --port-file that cannot be
written (ps/config.py ensure_checkpoint_root, port_file_problem).
Once serving, prints exactly one line `hybridps-ps listening on HOST:PORT` to stdout.
Logs go to stderr, one `server=ID event=... key=value` line per event (--log-level).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Sequence

from hybridps.cli import parse_config
from hybridps.logs import kv, setup_logging
from ps.config import (  # torch-free: the flags are checked before heavy imports
    ServerConfig,
    ensure_checkpoint_root,
    port_file_problem,
    spill_dir_problem,
)

log = logging.getLogger("ps")


def use_batch_scheduling() -> bool:
    """SCHED_BATCH for this process's threads and every thread they start later.

    Why: ranks and their node's server share cores. Under the default policy a push
    wakes the server, which then usually preempts the rank that sent it, so the
    rank's step waits for the server's work. SCHED_BATCH keeps the server's share of
    the CPU but gives up that wake-up preemption. Lowering the policy needs no
    privilege; where it does not exist (not Linux) this is a no-op."""
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None:
        return False
    try:
        # Libraries imported so far may have started threads already (a BLAS pool).
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                os.sched_setscheduler(int(tid), policy, os.sched_param(0))
    except OSError as exc:
        log.warning(kv("sched_batch_failed", error=exc.strerror))
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(ServerConfig, argv, prog="python -m ps",
                          description="hybridps shard server: sparse optimizer state on CPU")
    problem = (ensure_checkpoint_root(config.checkpoint_root)
               or port_file_problem(config.port_file) or spill_dir_problem(config.spill_dir))
    if problem is not None:
        print(f"python -m ps: error: {problem}", file=sys.stderr, flush=True)
        return 2
    setup_logging(config.log_level_number, sys.stderr)
    if config.sched_batch and use_batch_scheduling():
        log.info(kv("sched", policy="batch"))
    from ps.edge.server import serve  # imports torch and grpc: after argument parsing

    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        return asyncio.run(serve(config))
    return uvloop.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
