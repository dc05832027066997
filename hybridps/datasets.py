"""The small knowledge-graph sets shipped inside the package (hybridps/data/, see its README).

    shipped_dataset("umls")      # Path of the installed copy: train.txt, valid.txt, test.txt
    resolve_data_dir("umls")     # a --data-dir value: an existing directory, else a shipped name
    data_dir_problem("umsl")     # the one line a bad --data-dir gets (None when it is good)

They are package data (pyproject.toml [tool.setuptools.package-data]), so they are found
relative to this module in a checkout, an editable install and a wheel alike. Larger sets
(FB15k-237) are not shipped: docs/operations.md says where to get them. No torch, no grpc.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

DATA_ROOT = Path(__file__).resolve().parent / "data"
# name -> directory under DATA_ROOT; the spellings in use elsewhere (PyKEEN's "kinships",
# the shared folder's upper case) are accepted as aliases.
SHIPPED_DATASETS = {"umls": "umls", "kinship": "kinship"}
ALIASES = {"kinships": "kinship"}
SPLIT_FILES = ("train.txt", "valid.txt", "test.txt")


def shipped_names() -> list[str]:
    return sorted(SHIPPED_DATASETS)


def _canonical(name: str) -> str | None:
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    return key if key in SHIPPED_DATASETS else None


def is_shipped_name(name: str) -> bool:
    return _canonical(name) is not None


def shipped_dataset(name: str) -> Path:
    """The directory of a shipped set (case-insensitive name); ValueError naming the choices."""
    key = _canonical(name)
    if key is None:
        raise ValueError(f"dataset {name!r} is not shipped with hybridps (shipped: "
                         f"{', '.join(shipped_names())})")
    path = DATA_ROOT / SHIPPED_DATASETS[key]
    if not (path / "train.txt").is_file():
        raise FileNotFoundError(f"shipped dataset {key!r} is missing from {path}: the package "
                                "was installed without its data files (reinstall it)")
    return path


def resolve_data_dir(value: str | os.PathLike[str]) -> Path:
    """A --data-dir value as a directory: an existing directory wins; otherwise a bare name
    of a shipped set (umls, kinship) is its installed copy; anything else is returned as
    given (the loader then names the missing file)."""
    path = Path(value)
    if path.is_dir():
        return path
    text = os.fspath(value)
    if os.sep not in text and "/" not in text and is_shipped_name(text):
        return shipped_dataset(text)
    return path


def data_dir_problem(value: str) -> str | None:
    """What is wrong with a --data-dir value, as one line naming it and what to give instead;
    None when it is a directory with train.txt or the name of a shipped set."""
    text = os.fspath(value)
    path = Path(text)
    names = ", ".join(shipped_names())
    if path.is_dir():
        if (path / "train.txt").is_file():
            return None
        return (f"--data-dir {text!r} has no train.txt: give a directory with train.txt, "
                "valid.txt and test.txt (one 'head<TAB>relation<TAB>tail' a line), or a "
                f"shipped set: {names}")
    if os.sep not in text and "/" not in text and is_shipped_name(text):
        return None
    close = difflib.get_close_matches(text.strip().lower(), [*SHIPPED_DATASETS, *ALIASES],
                                      n=1, cutoff=0.6)
    hint = f"did you mean --data-dir {ALIASES.get(close[0], close[0])}? Else " if close else ""
    what = "a file, not a directory" if path.exists() else "no such directory"
    return (f"--data-dir {text!r}: {what}, and not a set shipped with hybridps: "
            f"{hint}give a directory with train.txt, valid.txt and test.txt, or one of the "
            f"shipped sets: {names}")
