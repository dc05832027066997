"""Record formats behind one interface: a file is a list of units (Parquet's row groups, or
fixed-size row chunks of the formats that have none), each read on its own.

    fmt = format_for(path)              # the registered format whose `matches` takes it
    fmt.units(path)                     # [rows of unit 0, rows of unit 1, ...]
    fmt.schema(path)                    # {column: kind}, kind one of KINDS or 'other (T)'
    fmt.read(path, unit, ["label", "cat_0"])   # {column: 1-D numpy array | Ragged}

Formats (registered once, at import, in FORMATS; `register` adds another):
    parquet     `*.parquet`, `*.parq`: pyarrow, one row group at a time (a file is never read
                whole); an int / float / bool column, or list<int> for a multi-hot one.
    criteo_npy  TorchRec's preprocessed Criteo layout, `day_N_dense.npy` [N, 13],
                `day_N_sparse.npy` [N, 26], `day_N_labels.npy` [N] or [N, 1] (any of the
                three names stands for the day), memory-mapped; units of NPY_UNIT_ROWS
                rows. Columns label, dense_0.., cat_0..; integer dense values (raw counts)
                become log(1 + max(x, 0)) as the TSV reader does, float ones are taken as
                stored (already transformed).
    criteo_tsv  Criteo TSV (`*.tsv`, `*.txt`, Criteo's `day_N`, `*.gz` of those) through
                worker/tasks/ctr/criteo.py's parser; units of TSV_UNIT_LINES lines, found by
                one scan of the file. Columns label, dense_0..12, cat_0..25; a categorical
                token's id is its 64-bit hash in [1, 2^62] (0: missing), so its table needs
                --id-overflow hash (or `convert --table-rows`).
"""

from __future__ import annotations

import functools
import glob
import gzip
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import numpy as np

from worker.data.errors import DataError, one_line, where

__all__ = ["FORMATS", "KINDS", "Column", "Ragged", "RecordFormat", "format_for",
           "list_files", "register"]

KINDS = ("int", "float", "bool", "list<int>")
NPY_UNIT_ROWS = 65536
TSV_UNIT_LINES = 65536
TSV_ID_SPACE = (1 << 62) + 1  # criteo.hash_rows' table size: ids 1..2^62, 0 = missing


@dataclass(frozen=True)
class Ragged:
    """A multi-hot column: sample i's ids are values[offsets[i]:offsets[i + 1]]."""

    values: np.ndarray  # [N] int64
    offsets: np.ndarray  # [n + 1] int64, offsets[0] == 0

    def __len__(self) -> int:
        return len(self.offsets) - 1


Column = np.ndarray | Ragged


class RecordFormat(ABC):
    """One file format (module doc). A format object holds only caches of open files."""

    name = "format"

    @abstractmethod
    def matches(self, path: Path) -> bool:
        """Is `path` a file of this format (by its name)?"""

    def dataset_key(self, path: Path) -> Path:
        """The path that stands for the data `path` belongs to (the .npy triple: one)."""
        return path

    @abstractmethod
    def units(self, path: Path) -> list[int]:
        """The rows of each unit, in order (DataError when the file cannot be read)."""

    @abstractmethod
    def schema(self, path: Path) -> dict[str, str]:
        """column -> kind (KINDS, or 'other (TYPE)' for a type the data path cannot use)."""

    @abstractmethod
    def read(self, path: Path, unit: int, columns: Sequence[str]) -> dict[str, Column]:
        """The columns of one unit (DataError naming file, unit and column when bad)."""


FORMATS: dict[str, RecordFormat] = {}


def register(fmt: RecordFormat) -> RecordFormat:
    if fmt.name in FORMATS:
        raise ValueError(f"record format {fmt.name!r} is registered already")
    FORMATS[fmt.name] = fmt
    return fmt


def format_for(path: str | Path) -> RecordFormat:
    p = Path(path)
    for fmt in FORMATS.values():
        if fmt.matches(p):
            return fmt
    raise DataError(f"{p}: no record format reads this file name (formats: "
                    f"{', '.join(FORMATS)}: docs/data.md)")


def list_files(patterns: str, flag: str = "--train-files") -> list[Path]:
    """The files of comma-separated globs, in name order, one path per dataset (a .npy
    day once); DataError when a glob matches nothing."""
    out: dict[Path, None] = {}
    for pattern in (p.strip() for p in patterns.split(",")):
        if not pattern:
            continue
        found = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern)))
        found = [p for p in found if p.is_file()]
        if not found:
            raise DataError(f"{flag} {pattern!r}: no file matches")
        for p in found:
            out[format_for(p).dataset_key(p)] = None
    if not out:
        raise DataError(f"{flag} {patterns!r}: no file matches")
    return sorted(out)


def arrow_kind(t: Any) -> str:
    import pyarrow as pa

    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t):
        return "float"
    if (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type):
        return "list<int>"
    return f"other ({t})"


def numpy_kind(dtype: np.dtype[Any]) -> str:
    if dtype.kind == "b":
        return "bool"
    if dtype.kind in "iu":
        return "int"
    if dtype.kind == "f":
        return "float"
    return f"other ({dtype})"


# --------------------------------------------------------------------------- Parquet


class ParquetFormat(RecordFormat):
    name = "parquet"
    OPEN_FILES = 16  # ParquetFile objects kept open (footers parsed once)

    def __init__(self) -> None:
        self._cached = functools.lru_cache(maxsize=self.OPEN_FILES)(self._open_file)

    def _open(self, path: Path) -> Any:
        """The file's ParquetFile, opened again when the file changed on disk."""
        st = path.stat()
        return self._cached(path, st.st_mtime_ns, st.st_size)

    def matches(self, path: Path) -> bool:
        return path.suffix in (".parquet", ".parq")

    @staticmethod
    def _open_file(path: Path, mtime_ns: int, size: int) -> Any:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as exc:
            what = ("an empty file" if size == 0
                    else f"not a readable Parquet file ({one_line(exc)})")
            raise DataError(f"{where(path)}: {what}") from None

    def units(self, path: Path) -> list[int]:
        md = self._open(path).metadata
        return [md.row_group(i).num_rows for i in range(md.num_row_groups)]

    def schema(self, path: Path) -> dict[str, str]:
        return {f.name: arrow_kind(f.type) for f in self._open(path).schema_arrow}

    def read(self, path: Path, unit: int, columns: Sequence[str]) -> dict[str, Column]:
        import pyarrow as pa

        pf = self._open(path)
        try:
            table = pf.read_row_group(unit, columns=list(columns))
        except (pa.ArrowException, OSError) as exc:
            bad, why = None, one_line(exc)
            for name in columns:  # which column: each read alone
                try:
                    pf.read_row_group(unit, columns=[name])
                except (pa.ArrowException, OSError) as one:
                    bad, why = name, one_line(one)
                    break
            raise DataError(f"{where(path, unit, bad)}: cannot decode ({why})") from None
        out: dict[str, Column] = {}
        for name in columns:
            arr = table.column(name).combine_chunks()
            if arr.null_count:
                raise DataError(f"{where(path, unit, name)}: {arr.null_count} null values")
            if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
                flat = arr.flatten()
                if flat.null_count:
                    raise DataError(f"{where(path, unit, name)}: null ids in a list")
                offsets = np.asarray(arr.offsets, dtype=np.int64)
                out[name] = Ragged(np.asarray(flat, dtype=np.int64), offsets - offsets[0])
            else:
                out[name] = arr.to_numpy(zero_copy_only=False)
        return out


# --------------------------------------------------------------------------- TorchRec .npy

NPY_PARTS = ("dense", "sparse", "labels")


class CriteoNpyFormat(RecordFormat):
    name = "criteo_npy"
    unit_rows = NPY_UNIT_ROWS

    def matches(self, path: Path) -> bool:
        return path.suffix == ".npy" and any(path.stem.endswith(f"_{p}") for p in NPY_PARTS)

    def dataset_key(self, path: Path) -> Path:
        return self._part(path, "labels")

    @staticmethod
    def _part(path: Path, part: str) -> Path:
        stem = path.stem.rpartition("_")[0]
        return path.with_name(f"{stem}_{part}.npy")

    def _arrays(self, path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        arrays = []
        for part in NPY_PARTS:
            p = self._part(path, part)
            try:
                arrays.append(np.load(p, mmap_mode="r"))
            except (OSError, ValueError) as exc:
                what = "an empty file" if p.exists() and p.stat().st_size == 0 else (
                    f"not a readable .npy file ({one_line(exc)})")
                raise DataError(f"{where(p)}: {what}") from None
        dense, sparse, labels = arrays
        n = len(labels)
        if labels.ndim == 2 and labels.shape[1] == 1:
            labels = labels.reshape(n)
        for part, arr, ndim in (("dense", dense, 2), ("sparse", sparse, 2),
                                ("labels", labels, 1)):
            if arr.ndim != ndim or len(arr) != n:
                raise DataError(f"{where(self._part(path, part))}: shape {arr.shape}, expected "
                                f"{n} rows ({'[N, F]' if ndim == 2 else '[N] or [N, 1]'}) "
                                "as the day's labels")
        return dense, sparse, labels

    def units(self, path: Path) -> list[int]:
        n = len(self._arrays(path)[2])
        return [min(self.unit_rows, n - lo) for lo in range(0, n, self.unit_rows)]

    def schema(self, path: Path) -> dict[str, str]:
        dense, sparse, labels = self._arrays(path)
        out = {"label": numpy_kind(labels.dtype)}
        dense_kind = "float" if numpy_kind(dense.dtype) in ("int", "float") else numpy_kind(
            dense.dtype)
        out.update({f"dense_{j}": dense_kind for j in range(dense.shape[1])})
        out.update({f"cat_{j}": numpy_kind(sparse.dtype) for j in range(sparse.shape[1])})
        return out

    def read(self, path: Path, unit: int, columns: Sequence[str]) -> dict[str, Column]:
        dense, sparse, labels = self._arrays(path)
        lo, hi = unit * self.unit_rows, min((unit + 1) * self.unit_rows, len(labels))
        out: dict[str, Column] = {}
        for name in columns:
            kind, _, index = name.rpartition("_")
            if name == "label":
                out[name] = np.array(labels[lo:hi])
            elif kind == "dense":
                col = np.array(dense[lo:hi, int(index)])
                out[name] = (col.astype(np.float32) if col.dtype.kind == "f" else
                             np.log1p(np.maximum(col, 0).astype(np.float64)).astype(np.float32))
            else:
                out[name] = np.array(sparse[lo:hi, int(index)])
        return out


# --------------------------------------------------------------------------- Criteo TSV


def _open_tsv(path: Path) -> IO[bytes]:
    if path.suffix == ".gz":
        return cast(IO[bytes], gzip.open(path, "rb"))
    return open(path, "rb", buffering=1 << 20)


class CriteoTsvFormat(RecordFormat):
    name = "criteo_tsv"
    unit_lines = TSV_UNIT_LINES

    def __init__(self) -> None:
        self._cached = functools.lru_cache(maxsize=256)(self._scan)

    def _index(self, path: Path, unit_lines: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        st = path.stat()
        return self._cached(path, unit_lines, st.st_mtime_ns, st.st_size)

    def matches(self, path: Path) -> bool:
        name = path.name[:-3] if path.name.endswith(".gz") else path.name
        # Criteo's own files are day_0 .. day_23 (and .gz of those): no suffix
        return Path(name).suffix in (".tsv", ".txt") or re.fullmatch(r"day_\d+", name) is not None

    def _scan(self, path: Path, unit_lines: int, mtime_ns: int,
              size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(byte offset of each unit's first line, lines of each unit): one pass."""
        if size == 0:
            raise DataError(f"{where(path)}: an empty file")
        starts, counts = [0], [0]
        pos = 0
        with _open_tsv(path) as f:
            for line in f:
                if counts[-1] == unit_lines:
                    starts.append(pos)
                    counts.append(0)
                counts[-1] += 1
                pos += len(line)
        if counts == [0]:
            raise DataError(f"{where(path)}: no lines")
        return tuple(starts), tuple(counts)

    def units(self, path: Path) -> list[int]:
        return list(self._index(path, self.unit_lines)[1])

    def schema(self, path: Path) -> dict[str, str]:
        from worker.tasks.ctr.batch import NUM_DENSE, NUM_SPARSE

        return {"label": "float", **{f"dense_{j}": "float" for j in range(NUM_DENSE)},
                **{f"cat_{j}": "int" for j in range(NUM_SPARSE)}}

    def read(self, path: Path, unit: int, columns: Sequence[str]) -> dict[str, Column]:
        from worker.tasks.ctr.batch import NUM_SPARSE, check_table_sizes
        from worker.tasks.ctr.criteo import CriteoFormatError, _parse_batch, _Segment

        starts, counts = self._index(path, self.unit_lines)
        with _open_tsv(path) as f:
            f.seek(starts[unit])
            lines = [f.readline() for _ in range(counts[unit])]
        seg = _Segment(path, 0, unit * self.unit_lines + 1, None)
        try:
            b = _parse_batch(lines, [seg], check_table_sizes(TSV_ID_SPACE, NUM_SPARSE))
        except CriteoFormatError as exc:
            raise DataError(f"{where(path, unit)}: {one_line(exc)}") from None
        out: dict[str, Column] = {}
        for name in columns:
            kind, _, index = name.rpartition("_")
            out[name] = (b.labels if name == "label" else b.dense[:, int(index)].copy()
                         if kind == "dense" else b.sparse[:, int(index)].copy())
        return out


register(ParquetFormat())
register(CriteoNpyFormat())
register(CriteoTsvFormat())
