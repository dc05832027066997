"""Whether a process can write the file or directory a flag names: one line naming the
flag, the path and what to do, or None. The worker's output paths
(worker/config/output_paths.py) and the server's --port-file ask the same questions.
The kernel's word on writing is os.access: as root it passes where only a read-only file
system would refuse. No torch import.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["directory_problem", "file_problem"]


def _nearest_existing(path: Path) -> Path:
    for parent in path.absolute().parents:
        if os.path.lexists(parent):
            return parent
    return Path(path.absolute().anchor)


def _named(flag: str, path: str, what: str) -> str:
    return f"{flag} {path!r}" + (f" ({what})" if what else "")


def _creatable(named: str, path: str) -> str | None:
    """None when `path`, missing, can be created (with its missing parents)."""
    above = _nearest_existing(Path(path))
    if not above.is_dir():
        return (f"{named} cannot be created: {str(above)!r} is not a directory; give a "
                "path in a directory")
    if not os.access(above, os.W_OK | os.X_OK):
        return (f"{named} cannot be created: directory {str(above)!r} is not writable by "
                "this user; give a path in a writable directory")
    return None


def file_problem(flag: str, path: str, what: str = "", example: str = "run.json"
                 ) -> str | None:
    """A file written at `path` (replacing one that is there); `what`: what the file is
    when it is not `path` itself but a file next to it; `example`: a file name to suggest
    inside a directory given instead."""
    named = _named(flag, path, what)
    if os.path.isdir(path):
        hint = (f"give a file path (e.g. {str(Path(path) / example)!r})" if not what
                else f"move it away or give {flag} another name")
        return f"{named} is a directory, where a file is written: {hint}"
    if os.path.lexists(path):
        if os.path.exists(path) and not os.access(path, os.W_OK):
            return f"{named} is not writable by this user: fix its mode or give another path"
        return None
    return _creatable(named, path)


def directory_problem(flag: str, path: str, what: str = "") -> str | None:
    """A directory the run creates (with its parents) at `path` and writes files into."""
    named = _named(flag, path, what)
    if os.path.lexists(path) and not os.path.isdir(path):
        return (f"{named} is a file, not a directory: give a directory (or move the file "
                "away)")
    if os.path.isdir(path):
        if not os.access(path, os.W_OK | os.X_OK):
            return (f"{named} is a directory not writable by this user: fix its mode or "
                    "give another directory")
        return None
    return _creatable(named, path)
