"""CTR data: a streaming Criteo TSV reader and a synthetic generator with a planted model.

Both produce ``CTRBatch``: ``labels [B] float32`` (0/1), ``dense [B, 13] float32``,
``sparse [B, 26] int64`` (row ids, one embedding table per categorical column).

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

Synthetic generator (``SyntheticCTR``)
    Same batch shape, generated from a counter-based hash RNG: every value of sample i of global
    batch ``step`` of split s is a pure function of (seed, s, step, i), so a rank can generate
    exactly its slice of a global batch (``rank=``/``world_size=``) and slices concatenate to the
    global batch. Categorical ids are Zipf-like per table (rank k with P ~ k^-a, then an affine
    bijection spreads the hot ranks over the whole row range so row-wise shards share the hot
    rows), with a small missing rate mapped to row 0. Labels are Bernoulli(sigmoid(logit)) of a
    planted model: per-row weights (hash-derived Gaussian, no per-row storage, so tables of any
    size), a dense linear term and FM-style pairwise interactions between chosen tables.
    ``planted_logits(batch)`` recomputes that logit from the features, so the planted model's
    own AUC on held-out data is the achievable ceiling.
"""

from __future__ import annotations

import gzip
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import IO, cast

import numpy as np
import torch

__all__ = [
    "NUM_DENSE",
    "NUM_FIELDS",
    "NUM_SPARSE",
    "CTRBatch",
    "CriteoFormatError",
    "SyntheticCTR",
    "criteo_row",
    "hash_rows",
    "iter_criteo_batches",
    "list_criteo_files",
]

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE

StrPath = str | os.PathLike[str]

_M64 = (1 << 64) - 1
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_GOLDEN = 0x9E3779B97F4A7C15


# --------------------------------------------------------------------------- batch


@dataclass(frozen=True)
class CTRBatch:
    labels: np.ndarray  # [B] float32
    dense: np.ndarray  # [B, num_dense] float32
    sparse: np.ndarray  # [B, num_tables] int64

    def __len__(self) -> int:
        return len(self.labels)

    def to_torch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (
            torch.from_numpy(self.labels),
            torch.from_numpy(self.dense),
            torch.from_numpy(self.sparse),
        )


class CriteoFormatError(ValueError):
    """A malformed line; the message starts with ``<file>:<line>:``."""


# --------------------------------------------------------------------------- hashing


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser of (x + golden gamma), elementwise on uint64 (wrapping)."""
    z = x.astype(np.uint64) + np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _splitmix64_int(x: int) -> int:
    z = (x + _GOLDEN) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _fnv1a_bytes_matrix(u8: np.ndarray) -> np.ndarray:
    """FNV-1a 64 over the last axis of a uint8 array, ignoring zero (padding) bytes."""
    h = np.full(u8.shape[:-1], _FNV_OFFSET, dtype=np.uint64)
    prime = np.uint64(_FNV_PRIME)
    for k in range(u8.shape[-1]):
        b = u8[..., k].astype(np.uint64)
        h = np.where(b != 0, (h ^ b) * prime, h)
    return h


TableSizes = Sequence[int] | np.ndarray | int


def _table_sizes(table_sizes: TableSizes, n: int = NUM_SPARSE) -> np.ndarray:
    if np.ndim(table_sizes) == 0:
        ts = np.full(n, int(table_sizes), dtype=np.int64)  # type: ignore[arg-type]
    else:
        ts = np.asarray(table_sizes, dtype=np.int64)
        if ts.shape != (n,):
            raise ValueError(f"need {n} table sizes, got shape {ts.shape}")
    if (ts < 2).any():
        raise ValueError("every table needs >= 2 rows (row 0 is reserved for missing)")
    return ts


def hash_rows(values: np.ndarray, table_sizes: TableSizes) -> np.ndarray:
    """Row ids [B, T] int64 for a bytes array ``values`` [B, T] (dtype ``S``); b"" -> row 0."""
    v = np.ascontiguousarray(values)
    if v.dtype.kind != "S":
        raise TypeError("values must be a numpy bytes array (dtype 'S')")
    b, t = v.shape
    ts = _table_sizes(table_sizes, t)
    u8 = v.view(np.uint8).reshape(b, t, v.dtype.itemsize)
    h = _fnv1a_bytes_matrix(u8)
    salts = _splitmix64(np.arange(1, t + 1, dtype=np.uint64))
    mixed = _splitmix64(h ^ salts)
    rows = (mixed % (ts - 1).astype(np.uint64)).astype(np.int64) + 1
    return np.where(v == b"", 0, rows)


def criteo_row(value: bytes | str, column: int, table_size: int) -> int:
    """Scalar reference of the categorical hash (see module docstring)."""
    data = value.encode() if isinstance(value, str) else value
    if not data:
        return 0
    h = _FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * _FNV_PRIME) & _M64
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
    h = np.full(cs.shape, _FNV_OFFSET, dtype=np.uint64)
    prime = np.uint64(_FNV_PRIME)
    for k in range(int(cl.max(initial=0))):
        b = u8[np.minimum(cs + k, last)].astype(np.uint64)
        h = np.where((k < cl) & (b != 0), (h ^ b) * prime, h)
    ts = table_sizes
    salts = _splitmix64(np.arange(1, len(ts) + 1, dtype=np.uint64))
    rows = (_splitmix64(h ^ salts) % (ts - 1).astype(np.uint64)).astype(np.int64) + 1
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
    ts = _table_sizes(table_sizes)
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


# --------------------------------------------------------------------------- synthetic

_SPLIT_IDS = {"train": 0, "valid": 1, "test": 2}


def _uniform(bits: np.ndarray) -> np.ndarray:
    """uint64 -> float64 uniform in (0, 1)."""
    return ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))


def _gauss(key: np.ndarray) -> np.ndarray:
    """Standard normal from a uint64 key (Box-Muller on two hashed uniforms)."""
    u1 = _uniform(_splitmix64(key ^ np.uint64(0x5851F42D4C957F2D)))
    u2 = _uniform(_splitmix64(key ^ np.uint64(0x14057B7EF767814F)))
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2)


class SyntheticCTR:
    """Deterministic synthetic CTR data with a planted logistic model (see module docstring).

    table_sizes:        rows per categorical table (row 0 = missing), any size >= 2.
    zipf_exponent:      P(popularity rank k) ~ k^-a within each table.
    missing_rate:       probability that a categorical (or dense) value is missing.
    sparse_scale:       std of the planted per-row weights.
    dense_scale:        std of the planted dense weights.
    interactions:       table pairs (a, b) with a planted FM term <v_a[row_a], v_b[row_b]>.
    interaction_dim, interaction_scale: size and std of the FM factor vectors' dot product.
    bias:               planted intercept (defaults: 25-30% positives, planted AUC ~0.83).
    """

    def __init__(
        self,
        table_sizes: Sequence[int],
        *,
        seed: int = 0,
        num_dense: int = NUM_DENSE,
        zipf_exponent: float = 1.1,
        missing_rate: float = 0.02,
        sparse_scale: float = 0.25,
        dense_scale: float = 0.2,
        interactions: Sequence[tuple[int, int]] = ((0, 1), (2, 3)),
        interaction_dim: int = 4,
        interaction_scale: float = 0.5,
        bias: float = -1.4,
    ):
        self.table_sizes = _table_sizes(list(table_sizes), len(table_sizes))
        self.num_tables = len(self.table_sizes)
        self.num_dense = num_dense
        self.seed = int(seed)
        self.zipf_exponent = float(zipf_exponent)
        self.missing_rate = float(missing_rate)
        self.sparse_scale = float(sparse_scale)
        self.interactions = [(int(a), int(b)) for a, b in interactions]
        for a, b in self.interactions:
            if not (0 <= a < self.num_tables and 0 <= b < self.num_tables):
                raise ValueError(f"interaction tables {(a, b)} out of range")
        self.interaction_dim = int(interaction_dim)
        self.interaction_scale = float(interaction_scale)
        self.bias = float(bias)
        rng = np.random.default_rng([self.seed, 0xC7])
        self.dense_weights = rng.normal(0.0, dense_scale, size=num_dense)
        self.dense_mu = rng.normal(1.5, 0.5, size=num_dense)
        self.dense_center = np.log1p(np.exp(self.dense_mu))  # rough mean of the feature
        # affine bijection k -> (mult * k + shift) mod m on the m = n - 1 non-missing rows
        self._mult = np.empty(self.num_tables, dtype=np.uint64)
        self._shift = np.empty(self.num_tables, dtype=np.uint64)
        for j, n in enumerate(self.table_sizes):
            m = int(n) - 1
            a = int(rng.integers(1 << 19, 1 << 20)) % m or 1
            while math.gcd(a, m) != 1:
                a = a % m + 1
            self._mult[j] = a
            self._shift[j] = int(rng.integers(0, m))
        self._key = _splitmix64(np.array([self.seed], dtype=np.uint64))[0]

    # -- keys
    def _sample_keys(self, split: str, step: int, gidx: np.ndarray) -> np.ndarray:
        sid = _SPLIT_IDS.get(split)
        if sid is None:
            sid = 3 + int(_fnv1a_bytes_matrix(np.frombuffer(split.encode(), np.uint8)))
        k = _splitmix64(np.array([self._key ^ np.uint64(sid)], dtype=np.uint64))
        k = _splitmix64(k ^ np.uint64(step))
        return _splitmix64(k ^ gidx.astype(np.uint64))

    @staticmethod
    def _field(keys: np.ndarray, field: int) -> np.ndarray:
        return _splitmix64(keys ^ np.uint64((field + 1) * 0x2545F4914F6CDD1D % (1 << 64)))

    def _row_key(self, table: int, rows: np.ndarray, salt: int) -> np.ndarray:
        k = self._key ^ np.uint64((table + 1) * 0x9E3779B1 + salt * 0x85EBCA77)
        return _splitmix64(_splitmix64(np.array([k], np.uint64)) ^ rows.astype(np.uint64))

    # -- generation
    def batch(
        self, step: int, batch_size: int, split: str = "train", rank: int = 0, world_size: int = 1
    ) -> CTRBatch:
        """This rank's contiguous slice of global batch ``step`` (``np.array_split`` sizes)."""
        if not 0 <= rank < world_size:
            raise ValueError("need 0 <= rank < world_size")
        q, r = divmod(batch_size, world_size)
        lo = rank * q + min(rank, r)
        hi = lo + q + (1 if rank < r else 0)
        keys = self._sample_keys(split, step, np.arange(lo, hi, dtype=np.uint64))
        b = hi - lo

        sparse = np.empty((b, self.num_tables), dtype=np.int64)
        a = self.zipf_exponent
        for j in range(self.num_tables):
            m = int(self.table_sizes[j]) - 1
            u = _uniform(self._field(keys, j))
            if abs(a - 1.0) < 1e-9:
                k = np.floor(np.exp(u * math.log(m + 1.0)))
            else:
                top = (m + 1.0) ** (1.0 - a)
                k = np.floor((1.0 + u * (top - 1.0)) ** (1.0 / (1.0 - a)))
            k0 = np.clip(k, 1, m).astype(np.uint64) - np.uint64(1)
            rows = (k0 * self._mult[j] + self._shift[j]) % np.uint64(m)
            miss = _uniform(self._field(keys, 100 + j)) < self.missing_rate
            sparse[:, j] = np.where(miss, 0, rows.astype(np.int64) + 1)

        dense = np.empty((b, self.num_dense), dtype=np.float32)
        for i in range(self.num_dense):
            z = _gauss(self._field(keys, 200 + i))
            raw = np.floor(np.exp(self.dense_mu[i] + 1.2 * z))
            miss = _uniform(self._field(keys, 300 + i)) < self.missing_rate
            dense[:, i] = np.where(miss, 0.0, np.log1p(raw))

        batch = CTRBatch(np.zeros(b, np.float32), dense, sparse)
        p = 1.0 / (1.0 + np.exp(-self.planted_logits(batch)))
        labels = (_uniform(self._field(keys, 999)) < p).astype(np.float32)
        return CTRBatch(labels, dense, sparse)

    def batches(
        self,
        num_steps: int,
        batch_size: int,
        split: str = "train",
        rank: int = 0,
        world_size: int = 1,
        start_step: int = 0,
    ) -> Iterator[CTRBatch]:
        for step in range(start_step, start_step + num_steps):
            yield self.batch(step, batch_size, split, rank, world_size)

    # -- planted model
    def row_weights(self, table: int, rows: np.ndarray) -> np.ndarray:
        """Planted weight of each row of a table (0 for the missing row)."""
        w = self.sparse_scale * _gauss(self._row_key(table, rows, 1))
        return np.where(np.asarray(rows) == 0, 0.0, w)

    def row_factors(self, table: int, rows: np.ndarray) -> np.ndarray:
        """Planted FM factor vectors [len(rows), interaction_dim] (zero for the missing row)."""
        rows = np.asarray(rows)
        scale = math.sqrt(self.interaction_scale / math.sqrt(self.interaction_dim))
        out = np.stack(
            [_gauss(self._row_key(table, rows, 10 + d)) for d in range(self.interaction_dim)],
            axis=1,
        )
        return np.where((rows == 0)[:, None], 0.0, scale * out)

    def planted_logits(self, batch: CTRBatch) -> np.ndarray:
        """The planted model's logit for each sample of a batch, float64 [B]."""
        logit = np.full(len(batch), self.bias)
        logit += (batch.dense.astype(np.float64) - self.dense_center) @ self.dense_weights
        for j in range(self.num_tables):
            logit += self.row_weights(j, batch.sparse[:, j])
        for a, b in self.interactions:
            fa = self.row_factors(a, batch.sparse[:, a])
            fb = self.row_factors(b, batch.sparse[:, b])
            logit += (fa * fb).sum(axis=1)
        return logit
