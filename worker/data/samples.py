"""Decoded samples: a unit's columns checked and turned into a task's inputs, concatenated,
permuted and cut into batches.

`decode` checks what the schema cannot: labels are 0 or 1, dense values finite, ids inside
their table (--id-overflow refuse: a DataError naming file, row group and column; hash: an
outside id is mapped to splitmix64(id) mod rows, the ids inside stay as they are); a
dynamic table's ids are raw and taken as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from worker.data.errors import DataError, where
from worker.data.features import FeatureSpec
from worker.data.formats import Column, Ragged
from worker.tasks.base import Batch
from worker.tasks.ctr.batch import splitmix64

__all__ = ["Samples", "decode"]


@dataclass
class Samples:
    """n samples: label [n] float32, dense [n, F] float32, ids per table (int64)."""

    label: np.ndarray
    dense: np.ndarray
    ids: dict[str, Column] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.label)

    def take(self, index: np.ndarray) -> Samples:
        return Samples(self.label[index], self.dense[index],
                       {k: _take(v, index) for k, v in self.ids.items()})

    def to_batch(self) -> Batch:
        ids: dict[str, torch.Tensor] = {}
        bags: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, col in self.ids.items():
            if isinstance(col, Ragged):
                bags[name] = (torch.from_numpy(col.values), torch.from_numpy(col.offsets[:-1]))
            else:
                ids[name] = torch.from_numpy(col)
        return Batch(len(self), ids=ids, bags=bags,
                     values={"dense": torch.from_numpy(self.dense),
                             "label": torch.from_numpy(self.label)})


def _take(col: Column, index: np.ndarray) -> Column:
    if not isinstance(col, Ragged):
        return np.ascontiguousarray(col[index])
    lo, hi = col.offsets[index], col.offsets[index + 1]
    lens = hi - lo
    offsets = np.zeros(len(index) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    # each kept sample's ids: positions lo[i] .. hi[i] - 1, laid end to end
    pos = np.repeat(lo - offsets[:-1], lens) + np.arange(offsets[-1], dtype=np.int64)
    return Ragged(col.values[pos], offsets)


def concat(parts: Sequence[Samples]) -> Samples:
    if len(parts) == 1:
        return parts[0]
    ids: dict[str, Column] = {}
    for name, first in parts[0].ids.items():
        cols = [p.ids[name] for p in parts]
        if isinstance(first, Ragged):
            rag = [c for c in cols if isinstance(c, Ragged)]
            shift = np.cumsum([0] + [len(c.values) for c in rag[:-1]])
            ids[name] = Ragged(np.concatenate([c.values for c in rag]),
                               np.concatenate([[0]] + [c.offsets[1:] + s
                                                       for c, s in zip(rag, shift, strict=True)]
                                              ).astype(np.int64))
        else:
            ids[name] = np.concatenate([c for c in cols if not isinstance(c, Ragged)])
    return Samples(np.concatenate([p.label for p in parts]),
                   np.concatenate([p.dense for p in parts]), ids)


def _ids(values: np.ndarray, rows: int, overflow: str, path: Path, unit: int, column: str,
         table: str, dynamic: bool) -> np.ndarray:
    ids = values.astype(np.int64, copy=False)
    if dynamic:  # raw ids: the table pages them in (any int64)
        return ids
    bad = (ids < 0) | (ids >= rows)
    if not bad.any():
        return ids
    if overflow == "refuse":
        first = int(np.flatnonzero(bad)[0])
        raise DataError(f"{where(path, unit, column)}: id {int(ids[first])} is outside table "
                        f"{table}'s {rows} rows ({int(bad.sum())} such ids in this row group; "
                        "--id-overflow hash maps them into the rows)")
    ids = ids.copy()
    ids[bad] = (splitmix64(ids[bad].view(np.uint64)) % np.uint64(rows)).astype(np.int64)
    return ids


def decode(raw: dict[str, Column], spec: FeatureSpec, path: Path, unit: int) -> Samples:
    """One unit's raw columns as Samples (module doc: the checks)."""
    label_raw = raw[spec.label]
    if isinstance(label_raw, Ragged):
        raise DataError(f"{where(path, unit, spec.label)}: a list column, expected 0/1 labels")
    label = label_raw.astype(np.float32)
    bad = np.flatnonzero((label != 0) & (label != 1))
    if bad.size:
        raise DataError(f"{where(path, unit, spec.label)}: label {label_raw[bad[0]].item()!r} (row "
                        f"{int(bad[0])} of the row group) is not 0 or 1")
    n = len(label)
    dense = np.empty((n, len(spec.dense)), dtype=np.float32)
    for j, name in enumerate(spec.dense):
        col = raw[name]
        if isinstance(col, Ragged):
            raise DataError(f"{where(path, unit, name)}: a list column, expected a number")
        dense[:, j] = col
        if not np.isfinite(dense[:, j]).all():
            row = int(np.flatnonzero(~np.isfinite(dense[:, j]))[0])
            raise DataError(f"{where(path, unit, name)}: value {dense[row, j]} (row {row} of "
                            "the row group) is not finite")
    ids: dict[str, Column] = {}
    for t in spec.tables:
        col = raw[t.column]
        if isinstance(col, Ragged):
            ids[t.name] = Ragged(_ids(col.values, t.rows, spec.id_overflow, path, unit,
                                      t.column, t.name, t.dynamic is not None), col.offsets)
        else:
            if col.dtype.kind not in "iu":
                raise DataError(f"{where(path, unit, t.column)}: type {col.dtype}, expected "
                                "int64 ids")
            ids[t.name] = _ids(col, t.rows, spec.id_overflow, path, unit, t.column, t.name,
                               t.dynamic is not None)
    return Samples(label, dense, ids)
