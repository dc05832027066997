"""A small Parquet data set to try --task files on: `python -m worker.data example`.

    python -m worker.data example --output runs/files    # train-000..003, valid-000

Columns: label (int8), dense_0..3 (float32), cat_0..2 (int64 ids), cat_3 (list<int64>, 0
to 4 ids a sample). The label is Bernoulli(sigmoid(sum of a planted value per id (a bag's
mean) + a linear term of the dense values)): a model can learn it (AUC well above 0.5).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["write_example"]

NUM_DENSE, NUM_IDS = 4, 3


def _planted(ids: np.ndarray, salt: int) -> np.ndarray:
    """A fixed pseudo-random value per id, mean 0 (a hash, no table)."""
    from worker.tasks.ctr.batch import splitmix64

    z = splitmix64(ids.astype(np.uint64) * np.uint64(2 * salt + 1))
    return ((z >> np.uint64(11)).astype(np.float64) / 2**53 - 0.5) * 3.0


def write_example(output: str | Path, *, rows: int = 1000, train_files: int = 4,
                  rows_per_file: int = 4096, rows_per_group: int = 1024,
                  valid_rows: int = 4096, seed: int = 0) -> list[Path]:
    """The files written (module doc); ids below `rows`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(NUM_DENSE) * 0.5
    paths = []
    plan = [(f"train-{i:03d}", rows_per_file) for i in range(train_files)]
    plan.append(("valid-000", valid_rows))
    for name, n in plan:
        path = out / f"{name}.parquet"
        # Zipf-like ids: a few popular rows, a long tail (as in click logs)
        ids = np.minimum(rng.zipf(1.3, (n, NUM_IDS)) - 1, rows - 1)
        lens = rng.integers(0, 5, n)
        bag = np.minimum(rng.zipf(1.3, int(lens.sum())) - 1, rows - 1)
        starts = np.concatenate([[0], np.cumsum(lens)])
        dense = rng.standard_normal((n, NUM_DENSE)).astype(np.float32)
        logit = dense @ w + sum(_planted(ids[:, j], j) for j in range(NUM_IDS))
        bag_value = _planted(bag, NUM_IDS)
        sums = np.bincount(np.repeat(np.arange(n), lens), weights=bag_value, minlength=n)
        logit += np.where(lens > 0, sums / np.maximum(lens, 1), 0.0)
        label = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int8)
        table = pa.table({
            "label": label,
            **{f"dense_{j}": dense[:, j] for j in range(NUM_DENSE)},
            **{f"cat_{j}": ids[:, j].astype(np.int64) for j in range(NUM_IDS)},
            f"cat_{NUM_IDS}": pa.ListArray.from_arrays(pa.array(starts, pa.int32()),
                                                       pa.array(bag, pa.int64())),
        })
        pq.write_table(table, path, row_group_size=rows_per_group)
        paths.append(path)
    return paths
