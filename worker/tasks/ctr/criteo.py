"""A streaming Criteo TSV reader: files -> ``CTRBatch``es (worker/tasks/ctr/batch.py).

Criteo display-advertising TSV
    One sample per line, 40 tab-separated fields: label (0/1), 13 integer features, 26
    categorical features (8-hex-digit tokens in the public data). Any feature may be empty
    (missing); the label may not. Lines end in ``\\n`` (``\\r\\n`` accepted).

    dense   ``log(1 + max(x, 0))`` as float32; missing -> 0.
    sparse  row 0 of every table is reserved for "missing" (empty field). A present value is
            hashed as its raw bytes (not parsed as hex, so any token works):
                h   = FNV-1a 64-bit of the bytes (offset 0xcbf29ce484222325, prime 0x100000001b3)
                row = 1 + splitmix64(h XOR splitmix64(j + 1)) mod (n_j - 1)
            for column j (0-based among the 26) with table size ``n_j >= 2``. splitmix64 is the
            standard finaliser (Steele et al.) with the golden-gamma increment; the per-column
            salt makes equal tokens in different columns independent. ``criteo_row`` is the
            scalar reference implementation.

    A path is a file, a directory (all its regular files not starting with "." in name order,
    concatenated into one stream), or a list of those. ``.gz`` files are decompressed on the
    fly. Nothing is loaded whole: lines are read in batch-sized slices.

    Malformed input raises ``CriteoFormatError`` (a ValueError) naming file and 1-based line:
    wrong field count, a label that is not 0/1, a non-integer in an integer column.

    Splitting across ``world_size`` ranks (``split=``):
    "interleave" (default): the global stream is cut into batches of ``batch_size`` lines and
        rank r takes global batches r, r + W, r + 2W, ... Every rank reads (but only parses its
        own 1/W of) the stream; works for .gz. Ranks' batch counts differ by at most one.
    "bytes": the concatenated *uncompressed* bytes are cut into W contiguous ranges and a line
        belongs to the range holding its first byte; each rank reads only its ~1/W of the bytes.
        Ranks get different numbers of samples (and so of batches): the training loop must
        agree on a step count (e.g. all-reduce min) or handle uneven ends. ``.gz`` raises.
    Either way the union over ranks is every line exactly once.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import IO, cast

import numpy as np

from worker.tasks.ctr.batch import (
    FNV_OFFSET,
    FNV_PRIME,
    GOLDEN,
    M64,
    NUM_DENSE,
    NUM_FIELDS,
    CTRBatch,
    TableSizes,
    check_table_sizes,
    fnv1a_bytes_matrix,
    splitmix64,
)

__all__ = [
    "CriteoFormatError",
    "criteo_row",
    "hash_rows",
    "iter_criteo_batches",
    "list_criteo_files",
]

StrPath = str | os.PathLike[str]


class CriteoFormatError(ValueError):
    """A malformed line; the message starts with ``<file>:<line>:``."""


def _splitmix64_int(x: int) -> int:
    z = (x + GOLDEN) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def hash_rows(values: np.ndarray, table_sizes: TableSizes) -> np.ndarray:
    """Row ids [B, T] int64 for a bytes array ``values`` [B, T] (dtype ``S``); b"" -> row 0."""
    v = np.ascontiguousarray(values)
    if v.dtype.kind != "S":
        raise TypeError("values must be a numpy bytes array (dtype 'S')")
    b, t = v.shape
    ts = check_table_sizes(table_sizes, t)
    u8 = v.view(np.uint8).reshape(b, t, v.dtype.itemsize)
    h = fnv1a_bytes_matrix(u8)
    salts = splitmix64(np.arange(1, t + 1, dtype=np.uint64))
    mixed = splitmix64(h ^ salts)
    rows = (mixed % (ts - 1).astype(np.uint64)).astype(np.int64) + 1
    return np.where(v == b"", 0, rows)


def criteo_row(value: bytes | str, column: int, table_size: int) -> int:
    """Scalar reference of the categorical hash (see module docstring)."""
    data = value.encode() if isinstance(value, str) else value
    if not data:
        return 0
    h = FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * FNV_PRIME) & M64
    mixed = _splitmix64_int(h ^ _splitmix64_int(column + 1))
    return 1 + mixed % (table_size - 1)


# --------------------------------------------------------------------------- files


def list_criteo_files(path: StrPath | Sequence[StrPath]) -> list[Path]:
    """Expand a file, a directory (non-hidden regular files, name order) or a list of those."""
    items = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    out: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            out.extend(sorted(c for c in p.iterdir() if c.is_file() and not c.name.startswith(".")))
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"{p}: no such file or directory")
    if not out:
        raise FileNotFoundError(f"no data files in {path}")
    return out


def _open(path: Path) -> IO[bytes]:
    if path.suffix == ".gz":
        return cast(IO[bytes], gzip.open(path, "rb"))
    return open(path, "rb", buffering=1 << 20)


@dataclass(frozen=True)
class _Segment:
    """Lines [first_index, ...) of a batch come from ``path`` starting at a known place."""

    path: Path
    first_index: int
    lineno: int | None  # 1-based line number of the first line, if counted
    byte_offset: int | None  # else: byte offset of the first line (line number found lazily)

    def line_number(self, index_in_batch: int) -> int:
        if self.lineno is not None:
            return self.lineno + index_in_batch - self.first_index
        assert self.byte_offset is not None
        newlines = 0
        with open(self.path, "rb") as f:
            remaining = self.byte_offset
            while remaining > 0:
                buf = f.read(min(remaining, 1 << 24))
                if not buf:
                    break
                newlines += buf.count(b"\n")
                remaining -= len(buf)
        return newlines + 1 + index_in_batch - self.first_index


def _where(segs: list[_Segment], i: int) -> str:
    seg = max((s for s in segs if s.first_index <= i), key=lambda s: s.first_index)
    return f"{seg.path}:{seg.line_number(i)}"


# --------------------------------------------------------------------------- parsing


def _parse(lines: list[bytes], segs: list[_Segment], table_sizes: np.ndarray) -> CTRBatch:
    rows = [ln.rstrip(b"\r\n").split(b"\t") for ln in lines]
    n = len(rows)
    lens = np.fromiter(map(len, rows), dtype=np.int64, count=n)
    bad = np.flatnonzero(lens != NUM_FIELDS)
    if bad.size:
        i = int(bad[0])
        raise CriteoFormatError(
            f"{_where(segs, i)}: expected {NUM_FIELDS} tab-separated fields, got {lens[i]}: "
            f"{lines[i][:200]!r}"
        )
    arr = np.array(rows, dtype=np.bytes_)
    lab = arr[:, 0]
    is_one = lab == b"1"
    bad = np.flatnonzero(~(is_one | (lab == b"0")))
    if bad.size:
        i = int(bad[0])
        raise CriteoFormatError(f"{_where(segs, i)}: label must be 0 or 1, got {lab[i]!r}")

    dense_raw = arr[:, 1 : 1 + NUM_DENSE]
    missing = dense_raw == b""
    try:
        ints = np.where(missing, b"0", dense_raw).astype(np.int64)
    except (ValueError, OverflowError):
        # numpy refused something: convert one by one (as Python int does) to locate it
        ints = np.zeros(dense_raw.shape, dtype=np.int64)
        for i in range(n):
            for j in range(NUM_DENSE):
                tok = dense_raw[i, j]
                if tok == b"":
                    continue
                try:
                    v = int(tok)
                    if not -(2**63) <= v < 2**63:
                        raise OverflowError
                except (ValueError, OverflowError):
                    raise CriteoFormatError(
                        f"{_where(segs, i)}: integer column I{j + 1} (field {j + 2}) has "
                        f"non-integer value {tok!r}"
                    ) from None
                ints[i, j] = v
    dense = np.log1p(np.maximum(ints, 0).astype(np.float64)).astype(np.float32)
    sparse = hash_rows(arr[:, 1 + NUM_DENSE :], table_sizes)
    return CTRBatch(is_one.astype(np.float32), dense, sparse)


def _parse_fast(lines: list[bytes], table_sizes: np.ndarray) -> CTRBatch | None:
    """Vectorized parse of a batch of lines on the raw bytes (no per-line Python work).

    Returns None when anything is unusual (wrong field count, bad label, an integer that is not
    ``[+-]?digits`` with at most 18 digits, ...): the caller then runs the exact line-by-line
    ``_parse``, which either accepts it (as Python ``int`` would) or raises a located error.
    Results are identical to ``_parse`` (tested).
    """
    n = len(lines)
    blob = b"".join(lines)
    u8 = np.frombuffer(blob, dtype=np.uint8)
    nl = np.flatnonzero(u8 == 10)
    if len(nl) != n or (n and nl[-1] != len(u8) - 1):
        # a file's last line without a newline: terminate each line explicitly
        fixed = [ln if ln.endswith(b"\n") else ln + b"\n" for ln in lines]
        u8 = np.frombuffer(b"".join(fixed), dtype=np.uint8)
        nl = np.flatnonzero(u8 == 10)
        if len(nl) != n:
            return None
    tabs = np.flatnonzero(u8 == 9)
    per_line = np.diff(np.searchsorted(tabs, nl), prepend=0)
    if (per_line != NUM_FIELDS - 1).any():
        return None
    line_start = np.empty(n, dtype=np.int64)
    line_start[0:1] = 0
    line_start[1:] = nl[:-1] + 1
    line_end = nl - (u8[np.maximum(nl - 1, 0)] == 13)  # drop a \r before \n
    tabs2 = tabs.reshape(n, NUM_FIELDS - 1)
    starts = np.concatenate([line_start[:, None], tabs2 + 1], axis=1)
    ends = np.concatenate([tabs2, line_end[:, None]], axis=1)
    lens = ends - starts
    if (lens < 0).any():
        return None
    last = len(u8) - 1

    lab_ok = lens[:, 0] == 1
    lab_byte = u8[np.minimum(starts[:, 0], last)]
    if not (lab_ok & ((lab_byte == 48) | (lab_byte == 49))).all():
        return None
    labels = (lab_byte == 49).astype(np.float32)

    ds, dl = starts[:, 1 : 1 + NUM_DENSE], lens[:, 1 : 1 + NUM_DENSE]
    first = u8[np.minimum(ds, last)]
    signed = (dl > 0) & ((first == 45) | (first == 43))  # '-' or '+'
    neg = signed & (first == 45)
    dstart = ds + signed
    ndig = dl - signed
    if ((signed & (ndig == 0)) | (ndig > 18)).any():
        return None
    value = np.zeros(ds.shape, dtype=np.int64)
    for k in range(int(ndig.max(initial=0))):
        active = k < ndig
        digit = u8[np.minimum(dstart + k, last)].astype(np.int64) - 48
        if (active & ((digit < 0) | (digit > 9))).any():
            return None
        value = np.where(active, value * 10 + digit, value)
    value = np.where(neg, -value, value)
    dense = np.log1p(np.maximum(value, 0).astype(np.float64)).astype(np.float32)

    cs, cl = starts[:, 1 + NUM_DENSE :], lens[:, 1 + NUM_DENSE :]
    h = np.full(cs.shape, FNV_OFFSET, dtype=np.uint64)
    prime = np.uint64(FNV_PRIME)
    for k in range(int(cl.max(initial=0))):
        b = u8[np.minimum(cs + k, last)].astype(np.uint64)
        h = np.where((k < cl) & (b != 0), (h ^ b) * prime, h)
    ts = table_sizes
    salts = splitmix64(np.arange(1, len(ts) + 1, dtype=np.uint64))
    rows = (splitmix64(h ^ salts) % (ts - 1).astype(np.uint64)).astype(np.int64) + 1
    sparse = np.where(cl == 0, 0, rows)
    return CTRBatch(labels, dense, sparse)


def _parse_batch(lines: list[bytes], segs: list[_Segment], table_sizes: np.ndarray) -> CTRBatch:
    fast = _parse_fast(lines, table_sizes)
    return fast if fast is not None else _parse(lines, segs, table_sizes)


# --------------------------------------------------------------------------- streams


def _stream_batches(
    files: list[Path], batch_size: int
) -> Iterator[tuple[list[bytes], list[_Segment]]]:
    """Global batches of raw lines over the concatenation of ``files``."""
    lines: list[bytes] = []
    segs: list[_Segment] = []
    for path in files:
        with _open(path) as f:
            lineno = 1
            while True:
                need = batch_size - len(lines)
                chunk = list(islice(f, need))
                if chunk:
                    segs.append(_Segment(path, len(lines), lineno, None))
                    lines.extend(chunk)
                    lineno += len(chunk)
                if len(lines) == batch_size:
                    yield lines, segs
                    lines, segs = [], []
                if len(chunk) < need:
                    break
    if lines:
        yield lines, segs


def _byte_range_lines(
    files: list[Path], rank: int, world_size: int
) -> Iterator[tuple[Path, int, list[bytes]]]:
    """(path, byte offset of first line, lines) runs of this rank's byte range."""
    sizes = [p.stat().st_size for p in files]
    total = sum(sizes)
    start, end = total * rank // world_size, total * (rank + 1) // world_size
    base = 0
    for path, size in zip(files, sizes, strict=True):
        lo, hi = max(start - base, 0), min(end - base, size)
        base += size
        if lo >= hi:
            continue
        with open(path, "rb", buffering=1 << 20) as f:
            if lo > 0:
                f.seek(lo - 1)
                if f.read(1) != b"\n":
                    f.readline()  # the line holding `lo` started in the previous range
            pos = f.tell()
            run_start = pos
            run: list[bytes] = []
            while pos < hi:
                line = f.readline()
                if not line:
                    break
                run.append(line)
                pos += len(line)
                if len(run) >= 4096:
                    yield path, run_start, run
                    run, run_start = [], pos
            if run:
                yield path, run_start, run


def _bytes_batches(
    files: list[Path], batch_size: int, rank: int, world_size: int
) -> Iterator[tuple[list[bytes], list[_Segment]]]:
    lines: list[bytes] = []
    segs: list[_Segment] = []
    for path, offset, run in _byte_range_lines(files, rank, world_size):
        i = 0
        off = offset
        while i < len(run):
            take = run[i : i + batch_size - len(lines)]
            segs.append(_Segment(path, len(lines), None, off))
            lines.extend(take)
            i += len(take)
            off += sum(map(len, take))
            if len(lines) == batch_size:
                yield lines, segs
                lines, segs = [], []
    if lines:
        yield lines, segs


def iter_criteo_batches(
    path: StrPath | Sequence[StrPath],
    batch_size: int,
    table_sizes: TableSizes,
    *,
    rank: int = 0,
    world_size: int = 1,
    split: str = "interleave",
    drop_last: bool = False,
) -> Iterator[CTRBatch]:
    """Stream ``CTRBatch``es of this rank's share of Criteo TSV data (see module docstring)."""
    if batch_size <= 0 or world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError("need batch_size > 0 and 0 <= rank < world_size")
    ts = check_table_sizes(table_sizes)
    files = list_criteo_files(path)
    if split == "interleave":
        for k, (lines, segs) in enumerate(_stream_batches(files, batch_size)):
            if k % world_size != rank:
                continue
            if drop_last and len(lines) < batch_size:
                return
            yield _parse_batch(lines, segs, ts)
    elif split == "bytes":
        gz = [str(p) for p in files if p.suffix == ".gz"]
        if gz:
            raise ValueError(f"split='bytes' needs uncompressed files; got {gz[:3]}")
        for lines, segs in _bytes_batches(files, batch_size, rank, world_size):
            if drop_last and len(lines) < batch_size:
                return
            yield _parse_batch(lines, segs, ts)
    else:
        raise ValueError(f"split must be 'interleave' or 'bytes', got {split!r}")

