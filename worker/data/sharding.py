"""Which rows each rank reads, in which order: a function of the files, --seed, the epoch
and the world size alone (no state but the step).

An epoch: the files in an order (shuffled per epoch by the seed when --shuffle-buffer > 0),
each file's units (row groups) in order, laid end to end: T rows. The line is cut into W
contiguous ranges of floor(T / W) rows, one per rank, so a rank reads only its own files
and row groups (the row groups on a range's border are read by both neighbours, each
keeping its part). A rank's range is cut into segments of consecutive units holding at
least --shuffle-buffer rows; a segment's rows are permuted by the seed, the epoch, the rank
and the segment's index (the shuffle buffer). Every rank then makes S = floor(floor(T / W)
/ B) batches of B rows in its order: all ranks agree on S, and the ragged tail (the last
floor(T / W) - S * B rows of each range and the T mod W rows past the last one) is not
trained on in that epoch (with shuffling, other rows fall in it next epoch).

A Segment is a list of row ranges of units, a permutation key (None: in order) and the
[start, stop) slice of the permuted rows it stands for: cutting segments at any row (`cut`)
gives the W ranges and, on resume at another world size, re-splits what the old ranks had
left of the epoch into equal shares of the new world (docs/data.md, "Resuming").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from worker.data.errors import DataError

__all__ = ["Catalog", "Segment", "cut", "epoch_streams", "permutation", "skip"]

FILE_ORDER_SALT = 0x46494C45  # "FILE": the epoch's file order
ROW_ORDER_SALT = 0x524F5753  # "ROWS": a segment's permutation

Piece = tuple[int, int, int, int]  # (file index, unit index, first row, end row) of a unit


@dataclass(frozen=True)
class Catalog:
    """The files and the rows of each of their units, as read from their metadata."""

    files: tuple[Path, ...]
    rows: tuple[tuple[int, ...], ...]

    @property
    def total(self) -> int:
        return sum(sum(r) for r in self.rows)

    def fingerprint(self) -> dict[str, Any]:
        """What a saved position is only valid for."""
        return {"files": [p.name for p in self.files], "rows": self.total}


@dataclass(frozen=True)
class Segment:
    """Rows [start, stop) of the concatenated pieces, permuted by `key` (None: in order)."""

    pieces: tuple[Piece, ...]
    key: tuple[int, ...] | None
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def rows(self) -> int:
        """Rows of all its pieces (what the permutation runs over)."""
        return sum(hi - lo for _, _, lo, hi in self.pieces)

    def to_json(self) -> dict[str, Any]:
        return {"pieces": [list(p) for p in self.pieces],
                "key": None if self.key is None else list(self.key),
                "start": self.start, "stop": self.stop}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Segment:
        key = doc["key"]
        return cls(tuple((int(f), int(u), int(lo), int(hi)) for f, u, lo, hi in doc["pieces"]),
                   None if key is None else tuple(int(k) for k in key), int(doc["start"]),
                   int(doc["stop"]))


def permutation(seed: int, key: tuple[int, ...], n: int) -> np.ndarray:
    return np.random.default_rng([seed, ROW_ORDER_SALT, *key]).permutation(n)


def _cut_pieces(pieces: Sequence[Piece], world_size: int) -> list[list[Piece]]:
    """W contiguous ranges of floor(rows / W) rows each (the rest dropped)."""
    share = sum(hi - lo for _, _, lo, hi in pieces) // world_size
    out: list[list[Piece]] = [[] for _ in range(world_size)]
    rank, room = 0, share
    for f, u, lo, hi in pieces:
        while lo < hi and rank < world_size:
            take = min(hi - lo, room)
            if take:
                out[rank].append((f, u, lo, lo + take))
            lo += take
            room -= take
            if room == 0:
                rank, room = rank + 1, share
    return out


def _group(pieces: Sequence[Piece], buffer: int, key: tuple[int, ...]) -> list[Segment]:
    """Consecutive pieces of at least `buffer` rows a segment (buffer 0: a piece each, in
    order); segment g permuted by key + (g,)."""
    out: list[Segment] = []
    group: list[Piece] = []
    rows = 0
    for piece in pieces:
        group.append(piece)
        rows += piece[3] - piece[2]
        if rows >= max(buffer, 1):
            out.append(Segment(tuple(group), (*key, len(out)) if buffer else None, 0, rows))
            group, rows = [], 0
    if group:
        out.append(Segment(tuple(group), (*key, len(out)) if buffer else None, 0, rows))
    return out


def epoch_streams(catalog: Catalog, seed: int, epoch: int, world_size: int,
                  buffer: int) -> list[list[Segment]]:
    """Each rank's segments of `epoch` (module doc)."""
    n = len(catalog.files)
    order = (np.random.default_rng([seed, FILE_ORDER_SALT, epoch]).permutation(n) if buffer
             else np.arange(n))
    pieces = [(int(f), u, 0, rows) for f in order
              for u, rows in enumerate(catalog.rows[int(f)]) if rows]
    return [_group(part, buffer, (epoch, rank))
            for rank, part in enumerate(_cut_pieces(pieces, world_size))]


def skip(stream: Sequence[Segment], rows: int) -> list[Segment]:
    """The stream past its first `rows` rows."""
    out: list[Segment] = []
    for seg in stream:
        if rows >= len(seg):
            rows -= len(seg)
            continue
        out.append(Segment(seg.pieces, seg.key, seg.start + rows, seg.stop))
        rows = 0
    return out


def cut(segments: Sequence[Segment], world_size: int) -> list[list[Segment]]:
    """The segments (in order) as W contiguous streams of floor(rows / W) rows each, cutting
    segments where needed (a cut segment keeps its permutation); the rest is dropped."""
    share = sum(len(s) for s in segments) // world_size
    out: list[list[Segment]] = [[] for _ in range(world_size)]
    rank, room = 0, share
    for seg in segments:
        start = seg.start
        while start < seg.stop and rank < world_size:
            take = min(seg.stop - start, room)
            if take:
                out[rank].append(Segment(seg.pieces, seg.key, start, start + take))
            start += take
            room -= take
            if room == 0:
                rank, room = rank + 1, share
    return out


def check_steps(streams: Sequence[Sequence[Segment]], batch_size: int, what: str) -> int:
    """S: full batches every rank has; DataError when there is none."""
    rows = min(sum(len(s) for s in stream) for stream in streams)
    steps = rows // batch_size
    if steps < 1:
        raise DataError(f"{what}: {rows} rows a rank make no full batch of --batch-size "
                        f"{batch_size} for each of {len(streams)} ranks")
    return steps
