"""`python -m ps`: run one hybridps shard server.

    python -m ps --host 127.0.0.1 --port 0 --port-file /tmp/ps.port

Every flag can also come from the environment as HYBRIDPS_<FLAG> (e.g.
HYBRIDPS_MAX_MESSAGE_BYTES); see `python -m ps --help`. Once serving, prints
exactly one line `hybridps-ps listening on HOST:PORT` to stdout. Logs go to
stderr, one `server=ID event=... key=value` line per event (--log-level).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from hybridps.cli import parse_config
from hybridps.logs import setup_logging


def main(argv: Sequence[str] | None = None) -> int:
    from ps.config import ServerConfig

    config = parse_config(ServerConfig, argv, prog="python -m ps",
                          description="hybridps shard server: sparse optimizer state on CPU")
    setup_logging(config.log_level_number, sys.stderr)
    from ps.server import serve  # imports torch and grpc: after argument parsing

    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        return asyncio.run(serve(config))
    return uvloop.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
