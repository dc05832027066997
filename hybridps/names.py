"""Which run ids and table names a server accepts (no torch, no grpc: the worker checks
its config with the same rule before anything starts).

Both end up in log lines, metrics labels and (table names) checkpoint file names
(`optim/<table>.r<rank>.pt`), so they are restricted to a charset that is safe in all
three: ASCII letters, digits, `_`, `.` and `-`; no path separator, no leading dot (no
`.`/`..`, no hidden files), at most MAX_NAME_CHARS characters (a file name
`<table>.r00000.pt.tmp-<pid>` stays far below the 255-byte limit of file systems).
"""

from __future__ import annotations

import re

MAX_NAME_CHARS = 128
SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
SAFE_CHARSET = "letters, digits, '_', '.', '-'; not starting with '.' or '-'"


def name_problem(value: str) -> str | None:
    """Why `value` is not a safe run id / table name (None: it is)."""
    if not value:
        return "must not be empty"
    if len(value) > MAX_NAME_CHARS:
        return f"has {len(value)} characters, more than {MAX_NAME_CHARS}"
    if SAFE_NAME.fullmatch(value) is None:
        return f"must use only {SAFE_CHARSET}"
    return None


def describe_problem(kind: str, value: str) -> str | None:
    """`kind value: problem` ready for an error message, or None when `value` is fine."""
    problem = name_problem(value)
    if problem is None:
        return None
    shown = value if len(value) <= 2 * MAX_NAME_CHARS else value[:2 * MAX_NAME_CHARS] + "..."
    return f"{kind} {shown!r} {problem}"
