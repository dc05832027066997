"""Tiny data sets for the --task files tests: Parquet files whose dense_0 is each row's
global sample number (exact in float32), so a test can tell which rows a reader gave."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np


def write_parquet_set(folder: Path, groups: Sequence[Sequence[int]], *, rows: int = 50,
                      multi_hot: bool = True, seed: int = 0, prefix: str = "part") -> list[Path]:
    """One file per entry of `groups` (its row groups' sizes). Columns: label (int8),
    dense_0 (the sample number), dense_1, cat_0 (int64 < rows), cat_1 (list<int64>, 0..3
    ids < rows; int64 when not multi_hot). The label follows cat_0 % 2 (learnable)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths, base = [], 0
    for i, sizes in enumerate(groups):
        path = folder / f"{prefix}-{i:03d}.parquet"
        writer = None
        for n in sizes:
            cat0 = rng.integers(0, rows, n)
            table = {
                "label": ((cat0 % 2 == 1) ^ (rng.random(n) < 0.1)).astype(np.int8),
                "dense_0": np.arange(base, base + n, dtype=np.float32),
                "dense_1": rng.standard_normal(n).astype(np.float32),
                "cat_0": cat0.astype(np.int64),
            }
            if multi_hot:
                lens = rng.integers(0, 4, n)
                table["cat_1"] = pa.array(
                    [rng.integers(0, rows, k).tolist() for k in lens], pa.list_(pa.int64()))
            else:
                table["cat_1"] = rng.integers(0, rows, n).astype(np.int64)
            t = pa.table(table)
            if writer is None:
                writer = pq.ParquetWriter(path, t.schema)
            writer.write_table(t, row_group_size=max(n, 1))
            base += n
        assert writer is not None
        writer.close()
        paths.append(path)
    return paths
