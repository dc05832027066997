"""A two-tower click model trained from Parquet files (docs/custom_model.md#training-from-files).

    python -m examples.two_tower --output runs/towers     # train-000..003, valid-000.parquet
    python worker/main.py --local-optimizer --task examples.two_tower:FileTowers \\
        --train-files 'runs/towers/train-*.parquet' --steps 30 ...

The task declares its columns (`features`, a --features document): label, user_id (table
user), item_id (table item) and tags (a list<int64>, table tag, mean-pooled); the batches,
their order, --epochs, the checkpointed reading position and the evaluation on
--valid-files are FilesTask's (worker/data/). The click is Bernoulli(sigmoid(the dot of a
planted user and item vector + a planted value per tag)): a model can learn it.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from worker.data.task import FilesTask
from worker.tasks.base import Batch, HybridModel

__all__ = ["FileTowers", "Towers", "write_data"]

USERS, ITEMS, TAGS = 1000, 500, 50


class Towers(nn.Module):
    """The dense part (FSDP2, torch Adam at --dense-lr): a user and an item tower."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.user = nn.Sequential(nn.Linear(dim, 32), nn.ReLU(), nn.Linear(32, 16))
        self.item = nn.Sequential(nn.Linear(2 * dim, 32), nn.ReLU(), nn.Linear(32, 16))

    def forward(self, user: torch.Tensor, item: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        return (self.user(user) * self.item(torch.cat([item, tags], dim=1))).sum(dim=1)


class FileTowers(FilesTask):
    name = "file_towers"

    def features(self) -> Mapping[str, Any]:
        # the columns and their tables, as a --features file would name them
        return {"label": "label",
                "tables": [{"column": "user_id", "name": "user", "rows": USERS},
                           {"column": "item_id", "name": "item", "rows": ITEMS},
                           {"column": "tags", "name": "tag", "rows": TAGS,
                            "pooling": "mean"}]}

    def build_dense(self) -> nn.Module:
        return Towers(self.cfg.run.dim)

    def forward(self, model: HybridModel, batch: Batch) -> torch.Tensor:
        # one fused lookup of the three tables (a collective: the same on every rank)
        tag_ids, tag_offsets = batch.bags["tag"]
        user, item, tags = model.lookups.lookup_many(
            ["user", "item", "tag"], [batch.ids["user"], batch.ids["item"], tag_ids],
            bags=[None, None, (tag_offsets, "mean")])
        logit: torch.Tensor = model.dense(user, item, tags)
        return logit


def write_data(output: str | Path, *, train_files: int = 4, rows_per_file: int = 2048,
               rows_per_group: int = 512, valid_rows: int = 2048, seed: int = 0) -> list[Path]:
    """The Parquet files of the module doc; the paths written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    user_vec, item_vec = rng.standard_normal((USERS, 4)), rng.standard_normal((ITEMS, 4))
    tag_value = rng.standard_normal(TAGS)
    paths = []
    plan = [(f"train-{i:03d}", rows_per_file) for i in range(train_files)]
    for name, n in [*plan, ("valid-000", valid_rows)]:
        user, item = rng.integers(0, USERS, n), rng.integers(0, ITEMS, n)
        lens = rng.integers(1, 4, n)
        tags = rng.integers(0, TAGS, int(lens.sum()))
        sample = np.repeat(np.arange(n), lens)
        tag_mean = np.bincount(sample, weights=tag_value[tags], minlength=n) / lens
        logit = (user_vec[user] * item_vec[item]).sum(axis=1) + tag_mean
        label = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int8)
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        table = pa.table({"label": label, "user_id": user.astype(np.int64),
                          "item_id": item.astype(np.int64),
                          "tags": pa.ListArray.from_arrays(pa.array(offsets),
                                                           pa.array(tags.astype(np.int64)))})
        path = out / f"{name}.parquet"
        pq.write_table(table, path, row_group_size=rows_per_group)
        paths.append(path)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.two_tower",
                                     description="Write the two-tower model's Parquet files.")
    parser.add_argument("--output", required=True, help="directory for the files")
    args = parser.parse_args(argv)
    paths = write_data(args.output)
    print(f"wrote {len(paths)} files to {args.output}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
