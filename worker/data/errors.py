"""The one error of bad input files: a line naming the file, row group and column."""

from __future__ import annotations

from pathlib import Path

from hybridps.cli import ConfigError


class DataError(ConfigError):
    """A file the data path cannot use; the worker reports it as one line (exit code 2)."""


def one_line(exc: BaseException) -> str:
    """A library's message on one line (the error path shows one line)."""
    return " ".join(str(exc).split())


def where(path: str | Path, unit: int | None = None, column: str | None = None) -> str:
    """'FILE', 'FILE: row group U' or 'FILE: row group U: column C'."""
    out = str(path)
    if unit is not None:
        out += f": row group {unit}"
    if column is not None:
        out += f": column {column}"
    return out
