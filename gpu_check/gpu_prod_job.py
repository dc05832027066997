"""The production-sized job of gpu_check/gpu_production.py: its shape, its task, and what
it asks of 8 GPUs on paper.

A DLRM-shaped click model: 26 tables (8 large, 8 medium, 10 small; rows in those
proportions, sized from a device's memory), three of the large ones multi-hot (bags of
20, 10 and 5 ids, mean-pooled), 23 single-hot: 58 ids a sample. `ProductionTask` is
`--task tables` (worker/tasks/tables.py: bounded-Zipf ids scattered over each table, a
planted label) with DLRM's top MLP (1024, 512, 256) over the pooled rows and the dense
features, and with the first REPLAY_BATCHES batches replayed: the host's batch generator
(numpy over ~1-4M ids a step) is not what the GPU check measures (sub-stage f measures
the file data path).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

from torch import nn

from worker.tasks.base import Batch
from worker.tasks.tables import TablesTask

GIB = 1 << 30
CAP_GIB = 40.0        # the device emulated (torch.cuda.set_per_process_memory_fraction)
RESIDENT_BYTES = 12   # GPU bytes an element of SparseAdam's design: the row, m and v
HYBRID_BYTES = 4      # hybridps, fp32 rows (m and v on the shard server)
LARGER = 2.5          # sub-stage b: that many times what the resident design holds
BOTH_HOLD = 1 / 8     # sub-stage a: this share of the resident design's bound
REPLAY_BATCHES = 8
TOP_MLP = (1024, 512, 256)
# (name, share of the rows, ids a sample): 8 large, 8 medium, 10 small tables
TABLES: list[tuple[str, float, int]] = (
    [(f"cat_{j}", 1.0, (20, 10, 5)[j] if j < 3 else 1) for j in range(8)]
    + [(f"cat_{j}", 0.03, 1) for j in range(8, 16)]
    + [(f"cat_{j}", 0.001, 1) for j in range(16, 26)])
MIN_ROWS = 1000
DYNAMIC_TABLES = ("cat_3", "cat_4", "cat_5")  # sub-stage e: large single-hot tables


def ids_per_sample() -> int:
    return sum(pool for _, _, pool in TABLES)


def table_rows(elements: float, dim: int, min_rows: int = MIN_ROWS) -> dict[str, int]:
    """Each table's rows for about `elements` embedding elements in all at width `dim`."""
    rows = elements / dim
    total = sum(share for _, share, _ in TABLES)
    return {name: max(min_rows, int(rows * share / total)) for name, share, _ in TABLES}


def tables_spec(rows: dict[str, int], dynamic: tuple[str, ...] = ()) -> str:
    """--tables for the job; `dynamic`: those tables dynamic (LRU, admit every id) with
    their rows as the capacity."""
    pools = {name: pool for name, _, pool in TABLES}
    return ",".join(f"{n}:{r}" + (f":{pools[n]}" if pools[n] > 1 else "")
                    + (":dynamic" if n in dynamic else "") for n, r in rows.items())


def job_args(rows: dict[str, int], dim: int, batch: int,
             dynamic: tuple[str, ...] = ()) -> list[str]:
    return ["--task", "gpu_prod_job:ProductionTask", "--tables", tables_spec(rows, dynamic),
            "--dim", str(dim), "--batch-size", str(batch)]


def sizes_from_cap(cap_bytes: int) -> dict[str, Any]:
    """The tables' element counts of sub-stages a and b from the emulated device's bytes:
    the resident design holds at most cap / 12 elements (the step's working set left out,
    so the true figure is lower and b is at least 2.5x it)."""
    resident = cap_bytes / RESIDENT_BYTES
    return {"cap_gib": round(cap_bytes / GIB, 3),
            "resident_bound_elements": int(resident),
            "both_hold_elements": int(resident * BOTH_HOLD),
            "larger_elements": int(resident * LARGER),
            "larger_hybridps_gib": round(resident * LARGER * HYBRID_BYTES / GIB, 2),
            "larger_resident_gib": round(resident * LARGER * RESIDENT_BYTES / GIB, 2)}


class ProductionTask(TablesTask):
    """--task tables with DLRM's top MLP and the first REPLAY_BATCHES batches replayed."""

    name = "production"

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self._replay: dict[tuple[int, int, int], Batch] = {}
        self.top_mlp = list(TOP_MLP)
        if cfg.run.model_config:  # {"top_mlp": [...]}: the dry run's small one
            self.top_mlp = [int(w) for w in
                            json.loads(Path(cfg.run.model_config).read_text())["top_mlp"]]

    def build_dense(self) -> nn.Module:
        widths = [self.input_width(), *self.top_mlp]
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(widths):
            layers += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(widths[-1], 1))

    def batch(self, step: int, rank: int, world_size: int) -> Batch:
        key = (step % REPLAY_BATCHES, rank, world_size)
        if key not in self._replay:
            self._replay[key] = super().batch(key[0], rank, world_size)
        return self._replay[key]


# -- on paper: 8 GPUs -----------------------------------------------------------------------

def a2a_bytes_per_step(batch: int, dim: int, world: int, distinct_ids: float | None = None,
                       row_bytes: int = 4) -> dict[str, float]:
    """One rank's all_to_all bytes a step (sent; as many received) under row-wise sharding,
    requester pooling: its ids to their owners (int64), the rows back (forward) and their
    gradients to the owners (backward), for the (W-1)/W of its distinct ids another rank
    owns. `distinct_ids`: a rank's distinct (table, id) pairs a step; None: every id
    distinct (the upper bound, 58 a sample)."""
    ids = ids_per_sample() * batch if distinct_ids is None else distinct_ids
    remote = ids * (world - 1) / world
    out = {"ids_bytes": remote * 8, "rows_bytes": remote * dim * row_bytes,
           "grads_bytes": remote * dim * row_bytes}
    out["total_bytes"] = sum(out.values())
    return out


def owner_pooled_bag_bytes(batch: int, dim: int, world: int, row_bytes: int = 4) -> float:
    """The three bag tables pooled at their owners instead (--pool-at owner): a rank
    receives a partial sum per bag from each other owner, and sends as many gradients."""
    bags = sum(1 for _, _, pool in TABLES if pool > 1)
    return 2 * bags * batch * dim * row_bytes * (world - 1)


def server_rows_needed(distinct_global: float, steps_per_s: float) -> float:
    """Rows/s one node's shard server applies: every rank pushes the distinct rows it owns
    of the global batch, so the node's server (one node: all W ranks) updates the
    global batch's distinct rows once a step."""
    return distinct_global * steps_per_s


def distinct_ids(rows: dict[str, int], dim: int, samples: int) -> int:
    """Distinct (table, id) pairs in `samples` samples of the job (its first batch)."""
    import torch

    from hybridps.cli import parse_config
    from worker.config.task_defaults import task_defaults
    from worker.config.train_config import TrainConfig

    cfg = parse_config(TrainConfig, [*job_args(rows, dim, samples), "--local-optimizer",
                                     "--device", "cpu"], defaults=task_defaults, environ={})
    got = ProductionTask(cfg).batch(0, 0, 1)
    ids = [*got.ids.values(), *(i for i, _ in got.bags.values())]
    return sum(int(torch.unique(i).numel()) for i in ids)


def paper_table(world: int = 8) -> list[dict[str, Any]]:
    """The on-paper figures of docs/gpu_check.md for a 40 GiB device: per shape and table
    size, a rank's distinct ids a step, its all_to_all bytes a step (distinct ids, and
    every id distinct), and the distinct rows of the global batch (what the node's server
    updates a step)."""
    sizes = sizes_from_cap(int(CAP_GIB * GIB))
    out = []
    for dim, batch in ((64, 16384), (128, 65536)):
        for key in ("both_hold_elements", "larger_elements"):
            rows = table_rows(sizes[key], dim)
            rank = distinct_ids(rows, dim, batch)
            glob = distinct_ids(rows, dim, world * batch)
            out.append({"dim": dim, "batch": batch, "tables": key,
                        "elements": sum(rows.values()) * dim,
                        "ids_per_rank_step": ids_per_sample() * batch,
                        "distinct_per_rank_step": rank,
                        "a2a_mib_distinct": round(a2a_bytes_per_step(
                            batch, dim, world, rank)["total_bytes"] / 2**20, 1),
                        "a2a_mib_upper_bound": round(a2a_bytes_per_step(
                            batch, dim, world)["total_bytes"] / 2**20, 1),
                        "owner_pooled_bags_mib": round(owner_pooled_bag_bytes(
                            batch, dim, world) / 2**20, 1),
                        "distinct_global_step": glob})
    return out


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    for line in paper_table():
        print(json.dumps(line))
