"""The CTR batch both data sources produce and the 64-bit hashes both use.

Sources: worker/tasks/ctr/criteo.py (the Criteo TSV reader) and worker/tasks/ctr/synthetic.py
(the synthetic generator with a planted model). A ``CTRBatch`` holds ``labels [B]
float32`` (0/1), ``dense [B, 13] float32`` and ``sparse [B, 26] int64`` (row ids, one
embedding table per categorical column; row 0 of every table is reserved for "missing").
splitmix64 is the standard finaliser (Steele et al.) with the golden-gamma increment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE

M64 = (1 << 64) - 1
FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
GOLDEN = 0x9E3779B97F4A7C15


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


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser of (x + golden gamma), elementwise on uint64 (wrapping)."""
    z = x.astype(np.uint64) + np.uint64(GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))



def fnv1a_bytes_matrix(u8: np.ndarray) -> np.ndarray:
    """FNV-1a 64 over the last axis of a uint8 array, ignoring zero (padding) bytes."""
    h = np.full(u8.shape[:-1], FNV_OFFSET, dtype=np.uint64)
    prime = np.uint64(FNV_PRIME)
    for k in range(u8.shape[-1]):
        b = u8[..., k].astype(np.uint64)
        h = np.where(b != 0, (h ^ b) * prime, h)
    return h


TableSizes = Sequence[int] | np.ndarray | int


def check_table_sizes(table_sizes: TableSizes, n: int = NUM_SPARSE) -> np.ndarray:
    if np.ndim(table_sizes) == 0:
        ts = np.full(n, int(table_sizes), dtype=np.int64)  # type: ignore[arg-type]
    else:
        ts = np.asarray(table_sizes, dtype=np.int64)
        if ts.shape != (n,):
            raise ValueError(f"need {n} table sizes, got shape {ts.shape}")
    if (ts < 2).any():
        raise ValueError("every table needs >= 2 rows (row 0 is reserved for missing)")
    return ts

