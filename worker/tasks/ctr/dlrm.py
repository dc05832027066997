"""DLRM click-through-rate prediction (`--task dlrm`) on files or synthetic data.

    torchrun --standalone --nproc_per_node 2 worker/main.py --ps 127.0.0.1:50051 --task dlrm
    torchrun ... worker/main.py --ps ... --task dlrm --data-path day_0.tsv --table-rows 1000000
    torchrun ... worker/main.py --ps ... --task dlrm --train-files 'pq/*.parquet' \
        --valid-files 'valid/*.parquet' --table-rows 1000000 --epochs 1

Model (Naumov et al., 2019): a bottom MLP maps the 13 dense features to a `--dim` vector;
each of the 26 categorical features is a row of its own row-wise sharded table (`cat_0` ..
`cat_25`, state on the shard server); the 27 vectors interact by pairwise dot products
(the 351 strictly-lower-triangle entries) which, with the bottom output, feed the top MLP
that gives the click logit. BCE loss. The MLPs and the interaction are the dense module
(FSDP2).

Sizes: `--table-rows` (one int for all tables or 26 comma-separated), else `table_rows` in
the `--model-config` JSON (which may also give `bottom_mlp` / `top_mlp` hidden widths), else
DEFAULT_TABLE_ROWS. Row 0 of every table is the "missing" row.

Data
    no --train-files / --data-path: worker/tasks/ctr/synthetic.SyntheticCTR with a planted
        logistic model; global batch `step` of the "train" split is a pure function of
        (seed, step) and rank r generates only its slice. Held-out data: the "test" split
        (final metrics) and the "valid" split (--eval-every progress); --eval-batches
        global batches each. The planted model's own AUC / log loss on the same held-out
        samples is reported too (`planted_auc`): the ceiling a model can reach.
    --train-files GLOB (Parquet, TorchRec's Criteo .npy, Criteo TSV) or --data-path
        FILE|DIR (Criteo TSV: its files as --train-files): read through the one file path
        of --task files (worker/data/source.py: each rank its share, seeded order,
        --epochs, the reading position in a checkpoint, --data-workers), the columns
        label, dense_0..12 and cat_0..25 (cat_j into table cat_j of --table-rows rows; an id
        outside it by --id-overflow, `hash` by default for this task: the TSV tokens'
        64-bit hashes), or what --features names (every table --dim wide: the dot
        interaction). Held-out data: --valid-files (the quick evaluation over the first
        --eval-batches batches of each rank's share, the final one over all of it).

Metrics over all ranks (held-out): exact ROC AUC from each rank's mergeable summary
(worker.tasks.metrics.auc_summary, all-gathered and merged) and log loss from all-reduced sums:
the same numbers as one process scoring all the held-out samples.
"""

from __future__ import annotations

import glob
import itertools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from worker.config.train_config import TrainConfig
from worker.runtime.gather import dist_info
from worker.tasks.base import Batch, HybridModel, TableConfig, Task
from worker.tasks.ctr.batch import NUM_DENSE, NUM_SPARSE, CTRBatch
from worker.tasks.ctr.criteo import list_criteo_files
from worker.tasks.ctr.synthetic import SyntheticCTR
from worker.tasks.metrics import auc_over_ranks, log_loss_over_ranks, summed_over_ranks
from worker.tasks.sources import BatchSource, file_source

DEFAULT_TABLE_ROWS = 100
DEFAULT_BOTTOM_MLP = (64,)
DEFAULT_TOP_MLP = (128, 64)
TABLE_PREFIX = "cat_"
CONFIG_KEYS = ("table_rows", "bottom_mlp", "top_mlp")


def parse_table_rows(value: int | str | Sequence[int], num_tables: int = NUM_SPARSE
                     ) -> list[int]:
    """One int (every table) or `num_tables` ints, as an int, "R" / "R1,R2,..." or a list."""
    if isinstance(value, str):
        items = [int(v) for v in value.replace(" ", "").split(",") if v]
    elif isinstance(value, int):
        items = [value]
    else:
        items = [int(v) for v in value]
    if len(items) == 1:
        items = items * num_tables
    if len(items) != num_tables:
        raise ValueError(f"table_rows: need 1 or {num_tables} sizes, got {len(items)}")
    if min(items) < 2:
        raise ValueError(f"table_rows: every table needs >= 2 rows (row 0 = missing), "
                         f"got {min(items)}")
    return items


def mlp(widths: Sequence[int], final_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2 or final_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRMDense(nn.Module):
    """Bottom MLP -> dot interaction with the embeddings -> top MLP -> logit."""

    def __init__(self, num_dense: int, num_tables: int, dim: int,
                 bottom: Sequence[int] = DEFAULT_BOTTOM_MLP,
                 top: Sequence[int] = DEFAULT_TOP_MLP) -> None:
        super().__init__()
        self.bottom = mlp([num_dense, *bottom, dim], final_relu=True)
        vectors = num_tables + 1
        li, lj = torch.tril_indices(vectors, vectors, offset=-1)
        self.register_buffer("pair_i", li, persistent=False)
        self.register_buffer("pair_j", lj, persistent=False)
        self.top = mlp([dim + len(li), *top, 1], final_relu=False)

    def forward(self, dense_BF: torch.Tensor, emb_BTD: torch.Tensor) -> torch.Tensor:
        x_BD = self.bottom(dense_BF)
        vec_BVD = torch.cat([x_BD.unsqueeze(1), emb_BTD], dim=1)
        dots_BVV = torch.bmm(vec_BVD, vec_BVD.transpose(1, 2))
        pair_i: torch.Tensor = self.pair_i  # type: ignore[assignment]
        pair_j: torch.Tensor = self.pair_j  # type: ignore[assignment]
        pairs_BP = dots_BVV[:, pair_i, pair_j]
        out: torch.Tensor = self.top(torch.cat([x_BD, pairs_BP], dim=1))
        return out.squeeze(-1).clone()  # not a view: FSDP2 hooks the module's output


def to_batch(b: CTRBatch) -> Batch:
    """A CTRBatch as the Batch the file path makes too: table cat_j's ids under cat_j."""
    labels, dense, sparse = b.to_torch()
    ids = {f"{TABLE_PREFIX}{j}": sparse[:, j].contiguous() for j in range(sparse.shape[1])}
    return Batch(len(b), ids=ids, values={"dense": dense, "label": labels})


def criteo_features(table_rows: Sequence[int], dim: int, id_overflow: str) -> dict[str, Any]:
    """The Criteo columns as a --features document (worker/data/features.py)."""
    return {"label": "label", "dense": [f"dense_{j}" for j in range(NUM_DENSE)],
            "tables": [{"column": f"cat_{j}", "name": f"{TABLE_PREFIX}{j}", "rows": n,
                        "dim": dim} for j, n in enumerate(table_rows)],
            "id_overflow": id_overflow}


def tsv_files(path: str) -> str:
    """--data-path FILE|DIR as --train-files: the file, or the directory's non-hidden files
    in name order (comma-separated escaped globs)."""
    return ",".join(glob.escape(str(p)) for p in list_criteo_files(path))


class DLRMTask(Task):
    """DLRM on files (--train-files, --data-path) or the synthetic generator (module doc)."""

    name = "dlrm"

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__(cfg)
        options: dict[str, Any] = {}
        if cfg.run.model_config:
            options = json.loads(Path(cfg.run.model_config).read_text())
            if not isinstance(options, dict):
                raise ValueError(f"{cfg.run.model_config}: expected a JSON object")
            unknown = sorted(set(options) - set(CONFIG_KEYS))
            if unknown:
                raise ValueError(f"{cfg.run.model_config}: unknown dlrm options {unknown} "
                                 f"(known: {list(CONFIG_KEYS)})")
        rows = cfg.dlrm.table_rows or options.get("table_rows", DEFAULT_TABLE_ROWS)
        self.table_rows = parse_table_rows(rows)
        self.bottom_mlp = [int(v) for v in options.get("bottom_mlp", DEFAULT_BOTTOM_MLP)]
        self.top_mlp = [int(v) for v in options.get("top_mlp", DEFAULT_TOP_MLP)]
        self.synthetic: SyntheticCTR | None = None
        self.source: BatchSource | None = None
        if cfg.files.train_files and cfg.dlrm.data_path:
            raise ValueError("task='dlrm': give --train-files or --data-path, not both")
        if cfg.files.train_files or cfg.dlrm.data_path:
            features: Mapping[str, Any] | None = None
            if not cfg.files.features:
                features = criteo_features(self.table_rows, cfg.run.dim,
                                           cfg.files.id_overflow)
            self.source = file_source(
                cfg, features, what="task 'dlrm'",
                train_files=tsv_files(cfg.dlrm.data_path) if cfg.dlrm.data_path else None)
            widths = {t.dim for t in self.source.spec.tables}
            if widths != {cfg.run.dim}:
                raise ValueError(f"task='dlrm': every table must be --dim {cfg.run.dim} wide "
                                 f"(the dot interaction); --features gives {sorted(widths)}")
        else:
            self.synthetic = SyntheticCTR(self.table_rows, seed=cfg.run.seed)

    # -- Task interface -------------------------------------------------------------------
    def tables(self) -> list[TableConfig]:
        if self.source is not None:
            return [TableConfig(t.name, t.rows, t.dim, t.dynamic, t.sharding)
                    for t in self.source.spec.tables]
        return [TableConfig(f"{TABLE_PREFIX}{j}", n, self.cfg.run.dim)
                for j, n in enumerate(self.table_rows)]

    def build_dense(self) -> nn.Module:
        num_dense = NUM_DENSE if self.source is None else len(self.source.spec.dense)
        return DLRMDense(num_dense, len(self.tables()), self.cfg.run.dim, self.bottom_mlp,
                         self.top_mlp)

    def global_batch(self, step: int, world_size: int) -> Batch:
        if self.source is not None:
            return self.source.global_batch(step, world_size)
        assert self.synthetic is not None
        size = world_size * self.cfg.run.batch_size
        return to_batch(self.synthetic.batch(step, size, "train"))

    def batch(self, step: int, rank: int, world_size: int) -> Batch:
        if self.source is not None:
            return self.source.batch(step, rank, world_size)
        assert self.synthetic is not None
        size = world_size * self.cfg.run.batch_size
        return to_batch(self.synthetic.batch(step, size, "train", rank, world_size))

    def loss(self, model: HybridModel, batch: Batch) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(self.forward(model, batch),
                                                  batch.values["label"])

    def steps_per_epoch(self, world_size: int) -> int | None:
        return None if self.source is None else self.source.steps_per_epoch(world_size)

    def steps_for_epochs(self, epochs: int, world_size: int) -> int | None:
        return None if self.source is None else self.source.steps_for_epochs(epochs, world_size)

    def data_state(self, next_step: int) -> dict[str, Any] | None:
        return None if self.source is None else self.source.data_state(next_step)

    def load_data_state(self, states_by_rank: Sequence[dict[str, Any] | None],
                        next_step: int) -> None:
        if self.source is not None:
            self.source.load_data_state(states_by_rank, next_step)

    def describe(self) -> dict[str, object]:
        out: dict[str, object] = {
            "task": self.name, "table_rows": [t.num_rows for t in self.tables()],
            "dim": self.cfg.run.dim, "bottom_mlp": self.bottom_mlp, "top_mlp": self.top_mlp,
            "data": "files" if self.source is not None else "synthetic",
            "embedding_rows": sum(t.num_rows for t in self.tables())}
        if self.source is not None:
            out.update(self.source.describe())
        return out

    # -- model ------------------------------------------------------------------------------
    def forward(self, model: HybridModel, batch: Batch) -> torch.Tensor:
        """logit_B; the tables' lookups fused into one exchange (a collective); a list
        column's bag pooled by its table's pooling."""
        names = [t.name for t in self.tables()]
        pooling = ({t.name: t.pooling for t in self.source.spec.tables}
                   if self.source is not None else {})
        ids = [batch.bags[n][0] if n in batch.bags else batch.ids[n] for n in names]
        bags = [(batch.bags[n][1], pooling[n]) if n in batch.bags else None for n in names]
        rows = model.lookups.lookup_many(
            names, ids, bags=bags if any(b is not None for b in bags) else None)
        out: torch.Tensor = model.dense(batch.values["dense"], torch.stack(rows, dim=1))
        return out

    # -- evaluation -------------------------------------------------------------------------
    def heldout_batches(self, split: str, rank: int, world_size: int) -> list[Batch]:
        """This rank's part of the held-out data: --eval-batches global batches of the
        generator's `split`; from files, --valid-files (the quick evaluation, split
        "valid": the first --eval-batches batches of the rank's share; else all of it)."""
        n = self.cfg.output.eval_batches
        if self.source is not None:
            return list(self.source.heldout_batches(rank, world_size,
                                                    n if split == "valid" else None))
        assert self.synthetic is not None
        size = world_size * self.cfg.run.batch_size
        return [to_batch(self.synthetic.batch(i, size, split, rank, world_size))
                for i in range(n)]

    @torch.no_grad()
    def evaluate_full(self, model: HybridModel, rank: int, world_size: int, *,
                      quick: bool = False) -> dict[str, float]:
        emb = model.lookups
        _, world, group = dist_info(emb)
        split = "valid" if quick else "test"
        batches = self.heldout_batches(split, rank, world_size)
        count = torch.tensor([len(batches)], dtype=torch.int64)
        if world > 1:  # every rank must run the same number of (collective) forwards
            dist.all_reduce(count, op=dist.ReduceOp.MIN, group=group)
        batches = batches[: int(count)]
        if not batches:
            return {}
        device = getattr(emb, "device", torch.device("cpu"))
        logits, labels, planted = [], [], []
        for b in batches:
            logits.append(self.forward(model, b.to(device)).float().cpu().numpy())
            labels.append(b.values["label"].numpy())
            if self.synthetic is not None and not quick:
                sparse = torch.stack([b.ids[f"{TABLE_PREFIX}{j}"]
                                      for j in range(NUM_SPARSE)], dim=1)
                planted.append(self.synthetic.planted_logits(CTRBatch(
                    b.values["label"].numpy(), b.values["dense"].numpy(), sparse.numpy())))
        score, label = np.concatenate(logits), np.concatenate(labels)
        out = {"auc": auc_over_ranks(score, label, world, group)}
        if quick:
            return out
        out["log_loss"] = log_loss_over_ranks(score, label, world, group)
        if planted:
            plant = np.concatenate(planted)
            out["planted_auc"] = auc_over_ranks(plant, label, world, group)
            out["planted_log_loss"] = log_loss_over_ranks(plant, label, world, group)
        out["heldout_samples"] = float(summed_over_ranks(float(len(label)), world, group))
        return out
