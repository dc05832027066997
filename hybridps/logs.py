"""Structured logs: one line per event, `key=value` pairs, the same on server and worker.

    2026-01-01 12:00:00,123 INFO ps.server server=host-12-ab12cd event=serving address=...
    2026-01-01 12:00:01,456 INFO worker rank=1 event=stopping step=41 reason=SIGTERM

`setup_logging(level, rank=1)` installs the format on the root logger; the
static fields (`rank=` on a worker, `server=` on a shard server, settable later
with `set_log_fields`) come first on every line, then the message, which code
builds with `kv(event, **fields)`. No torch, no grpc import.

Level `auto` (the worker's default): on a terminal, rank 0 logs INFO except the
per-connection detail of AUTO_QUIET_LOGGERS (which every rank repeats at each start)
and the other ranks log WARNING: one line per phase, warnings, rank 0's progress bar
and summary. Anywhere else (a file, a pipe, a container's log) every rank logs INFO,
the complete record. The formatter fills in the static fields itself, so a handler
that copies it (tqdm's logging_redirect_tqdm, around the progress bar) keeps them.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
AUTO = "AUTO"
FORMAT = "%(asctime)s %(levelname)s %(name)s %(hybridps_fields)s%(message)s"
# Quieted on rank 0 by `auto` on a terminal: the shard client's connection detail (its
# transports: the shm arena, the gRPC channel and stream; Finish) and the
# process-group generation line. Their warnings still show.
AUTO_QUIET_LOGGERS = ("worker.sync", "worker.arena", "worker.grpc", "worker.rendezvous")


def kv(event: str, **fields: Any) -> str:
    """One structured log line: `event=NAME key=value ...` (values with spaces quoted)."""
    parts = [f"event={event}"]
    parts.extend(f"{key}={_value(value)}" for key, value in fields.items())
    return " ".join(parts)


def _value(value: Any) -> str:
    text = str(value)
    if not text or any(c in text for c in ' ="\n'):
        text = '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ") + '"'
    return text


class _Fields(logging.Filter):
    """Puts the static fields (rank=, server=) on every record, as `hybridps_fields`."""

    def __init__(self) -> None:
        super().__init__()
        self.fields: dict[str, Any] = {}
        self.prefix = ""

    def set(self, **fields: Any) -> None:
        self.fields.update(fields)
        self.prefix = "".join(f"{k}={_value(v)} " for k, v in self.fields.items())

    def filter(self, record: logging.LogRecord) -> bool:
        record.hybridps_fields = self.prefix
        return True


_FIELDS = _Fields()


class _Formatter(logging.Formatter):
    """FORMAT, with the static fields taken from _FIELDS when no filter set them."""

    def format(self, record: logging.LogRecord) -> str:
        if not hasattr(record, "hybridps_fields"):
            record.hybridps_fields = _FIELDS.prefix
        return super().format(record)


def level_number(name: str) -> int:
    """'info' -> logging.INFO; ValueError naming the value otherwise."""
    if name.upper() not in LOG_LEVELS:
        raise ValueError(f"log_level={name!r} is not one of {', '.join(LOG_LEVELS)}")
    return int(getattr(logging, name.upper()))


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def setup_logging(level: str | int = "INFO", stream: TextIO | None = None,
                  **fields: Any) -> None:
    """Root logger -> `stream` (stderr) in the one-line format, with static `fields`.

    `level` "auto": see the module doc (the `rank` field says which rank this is)."""
    stream = stream or sys.stderr
    quiet: tuple[str, ...] = ()
    if isinstance(level, str) and level.upper() == AUTO:
        number = logging.INFO
        if _is_terminal(stream):
            if int(fields.get("rank", 0) or 0) == 0:
                quiet = AUTO_QUIET_LOGGERS
            else:
                number = logging.WARNING
    else:
        number = level if isinstance(level, int) else level_number(level)
    handler = logging.StreamHandler(stream)
    handler.addFilter(_FIELDS)
    handler.setFormatter(_Formatter(FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(number)
    for name in AUTO_QUIET_LOGGERS:  # NOTSET: follow the root again, unless quieted
        logging.getLogger(name).setLevel(logging.WARNING if name in quiet else logging.NOTSET)
    _FIELDS.set(**fields)


def set_log_fields(**fields: Any) -> None:
    """Add/replace static fields (e.g. server=ID once the server id is known)."""
    _FIELDS.set(**fields)
