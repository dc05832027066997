"""Structured logs: one line per event, `key=value` pairs, the same on server and worker.

    2026-01-01 12:00:00,123 INFO ps.server server=host-12-ab12cd event=serving address=...
    2026-01-01 12:00:01,456 INFO worker rank=1 event=stopping step=41 reason=SIGTERM

`setup_logging(level, rank=1)` installs the format on the root logger; the
static fields (`rank=` on a worker, `server=` on a shard server, settable later
with `set_log_fields`) come first on every line, then the message, which code
builds with `kv(event, **fields)`. No torch, no grpc import.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
FORMAT = "%(asctime)s %(levelname)s %(name)s %(hybridps_fields)s%(message)s"


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


def level_number(name: str) -> int:
    """'info' -> logging.INFO; ValueError naming the value otherwise."""
    if name.upper() not in LOG_LEVELS:
        raise ValueError(f"log_level={name!r} is not one of {', '.join(LOG_LEVELS)}")
    return int(getattr(logging, name.upper()))


def setup_logging(level: str | int = "INFO", stream: TextIO | None = None,
                  **fields: Any) -> None:
    """Root logger -> `stream` (stderr) in the one-line format, with static `fields`."""
    number = level if isinstance(level, int) else level_number(level)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(_FIELDS)
    handler.setFormatter(logging.Formatter(FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(number)
    _FIELDS.set(**fields)


def set_log_fields(**fields: Any) -> None:
    """Add/replace static fields (e.g. server=ID once the server id is known)."""
    _FIELDS.set(**fields)
