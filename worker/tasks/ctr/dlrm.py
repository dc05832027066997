"""DLRM click-through-rate prediction (`--task dlrm`) on Criteo TSV or synthetic data.

    torchrun --standalone --nproc_per_node 2 worker/main.py --ps 127.0.0.1:50051 --task dlrm
    torchrun ... worker/main.py --ps ... --task dlrm --data-path day_0.tsv --table-rows 1000000

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
    --data-path empty: worker/tasks/ctr_synthetic.SyntheticCTR with a planted logistic model;
        global batch `step` of the "train" split is a pure function of (seed, step) and rank r
        generates only its slice. Held-out data: the "test" split (final metrics) and the
        "valid" split (--eval-every progress); --eval-batches global batches each. The
        planted model's own AUC / log loss on the same held-out samples is reported too
        (`planted_auc`): the ceiling a model can reach.
    --data-path FILE|DIR: Criteo TSV streamed in --batch-size line blocks; block k of the
        stream goes to rank k % W (worker/tasks/ctr/criteo.py's "interleave" split: every rank
        parses only its own blocks), and a rank's j-th block is held out when j % HOLDOUT_EVERY ==
        HOLDOUT_EVERY - 1: every 10th round of W blocks, so each rank holds out the same
        share (the held-out lines depend on W and --batch-size). Every step each rank takes
        its next training block; an epoch is the number of full training blocks the poorest
        rank has (one line count of the data, done only for --epochs), then every rank
        restarts its stream; a --steps run longer than the data starts the next pass.

Metrics over all ranks (held-out): exact ROC AUC from each rank's mergeable summary
(worker.tasks.metrics.auc_summary, all-gathered and merged) and log loss from all-reduced sums:
the same numbers as one process scoring all the held-out samples.
"""

from __future__ import annotations

import gzip
import itertools
import json
from collections.abc import Iterator, Sequence
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
from worker.tasks.ctr.criteo import iter_criteo_batches, list_criteo_files
from worker.tasks.ctr.synthetic import SyntheticCTR
from worker.tasks.metrics import auc_over_ranks, log_loss_over_ranks, summed_over_ranks

DEFAULT_TABLE_ROWS = 100
DEFAULT_BOTTOM_MLP = (64,)
DEFAULT_TOP_MLP = (128, 64)
HOLDOUT_EVERY = 10
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
    labels, dense, sparse = b.to_torch()
    return Batch(len(b), ids={"sparse": sparse}, values={"dense": dense, "label": labels})


def count_lines(files: Sequence[Path]) -> int:
    total = 0
    for path in files:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as f:
            last = b"\n"
            while chunk := f.read(1 << 24):
                total += chunk.count(b"\n")
                last = chunk[-1:]
            total += last != b"\n"  # a final line without its newline
    return total


class DLRMTask(Task):
    """DLRM on Criteo TSV (--data-path) or the synthetic generator (see module doc)."""

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
        self.files: list[Path] = []
        if cfg.dlrm.data_path:
            self.files = list_criteo_files(cfg.dlrm.data_path)
        else:
            self.synthetic = SyntheticCTR(self.table_rows, seed=cfg.run.seed)
        self._streams: dict[tuple[int, int], tuple[int, Iterator[CTRBatch]]] = {}
        self._epoch_steps: dict[int, int] = {}

    # -- Task interface -------------------------------------------------------------------
    def tables(self) -> list[TableConfig]:
        return [TableConfig(f"{TABLE_PREFIX}{j}", n, self.cfg.run.dim)
                for j, n in enumerate(self.table_rows)]

    def build_dense(self) -> nn.Module:
        return DLRMDense(NUM_DENSE, NUM_SPARSE, self.cfg.run.dim, self.bottom_mlp, self.top_mlp)

    def global_batch(self, step: int, world_size: int) -> Batch:
        if self.synthetic is not None:
            size = world_size * self.cfg.run.batch_size
            return to_batch(self.synthetic.batch(step, size, "train"))
        parts = [self._criteo_train(step, r, world_size) for r in range(world_size)]
        return to_batch(CTRBatch(*(np.concatenate([getattr(p, k) for p in parts])
                                   for k in ("labels", "dense", "sparse"))))

    def batch(self, step: int, rank: int, world_size: int) -> Batch:
        if self.synthetic is not None:
            size = world_size * self.cfg.run.batch_size
            return to_batch(self.synthetic.batch(step, size, "train", rank, world_size))
        return to_batch(self._criteo_train(step, rank, world_size))

    def loss(self, model: HybridModel, batch: Batch) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(self.forward(model, batch),
                                                  batch.values["label"])

    def steps_per_epoch(self, world_size: int) -> int | None:
        if self.synthetic is not None:
            return None
        return self._steps_per_epoch(world_size)

    def describe(self) -> dict[str, object]:
        out: dict[str, object] = {
            "task": self.name, "table_rows": self.table_rows, "dim": self.cfg.run.dim,
            "bottom_mlp": self.bottom_mlp, "top_mlp": self.top_mlp,
            "data": str(self.cfg.dlrm.data_path) if self.files else "synthetic",
            "embedding_rows": sum(self.table_rows)}
        if self.files:
            out["holdout"] = (f"a rank's block j is held out when j % {HOLDOUT_EVERY} == "
                              f"{HOLDOUT_EVERY - 1}")
        return out

    # -- model ------------------------------------------------------------------------------
    def forward(self, model: HybridModel, batch: Batch) -> torch.Tensor:
        """logit_B; the 26 tables' lookups fused into one exchange (a collective)."""
        emb = model.lookups
        sparse_BT = batch.ids["sparse"]
        rows = emb.lookup_many([f"{TABLE_PREFIX}{j}" for j in range(NUM_SPARSE)],
                               [sparse_BT[:, j] for j in range(NUM_SPARSE)])
        out: torch.Tensor = model.dense(batch.values["dense"], torch.stack(rows, dim=1))
        return out

    # -- evaluation -------------------------------------------------------------------------
    def heldout_batches(self, split: str, rank: int, world_size: int) -> list[Batch]:
        """This rank's part of the held-out data (--eval-batches global batches)."""
        n = self.cfg.output.eval_batches
        if self.synthetic is not None:
            size = world_size * self.cfg.run.batch_size
            return [to_batch(self.synthetic.batch(i, size, split, rank, world_size))
                    for i in range(n)]
        out: list[Batch] = []
        for j, b in self._criteo_blocks(rank, world_size):
            if j % HOLDOUT_EVERY == HOLDOUT_EVERY - 1:
                out.append(to_batch(b))
                if len(out) == n:
                    break
        return out

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
                planted.append(self.synthetic.planted_logits(CTRBatch(
                    b.values["label"].numpy(), b.values["dense"].numpy(),
                    b.ids["sparse"].numpy())))
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

    # -- Criteo streaming -------------------------------------------------------------------
    def _criteo_blocks(self, rank: int, world_size: int) -> Iterator[tuple[int, CTRBatch]]:
        """(j, block): this rank's full blocks in stream order (global block j * W + rank)."""
        stream = iter_criteo_batches(self.files, self.cfg.run.batch_size, self.table_rows,
                                     rank=rank, world_size=world_size, drop_last=True)
        yield from enumerate(stream)

    def _train_blocks(self, rank: int, world_size: int) -> Iterator[CTRBatch]:
        for j, b in self._criteo_blocks(rank, world_size):
            if j % HOLDOUT_EVERY != HOLDOUT_EVERY - 1:
                yield b

    def _steps_per_epoch(self, world_size: int) -> int:
        if world_size not in self._epoch_steps:
            full = count_lines(self.files) // self.cfg.run.batch_size
            blocks = [len(range(r, full, world_size)) for r in range(world_size)]
            steps = min(n - n // HOLDOUT_EVERY for n in blocks)
            if steps < 1:
                raise ValueError(f"{self.cfg.dlrm.data_path}: fewer training lines than "
                                 f"{world_size} ranks x --batch-size {self.cfg.run.batch_size}")
            self._epoch_steps[world_size] = steps
        return self._epoch_steps[world_size]

    def _criteo_train(self, step: int, rank: int, world_size: int) -> CTRBatch:
        """This rank's training block of `step` (sequential steps stream; others re-read)."""
        epoch_steps = self._steps_per_epoch(world_size) if self.cfg.run.epochs else None
        key = (rank, world_size)
        state = self._streams.get(key)
        if state is None or state[0] != step:
            # (re)start at the beginning of step's epoch and skip to `step`
            first = step - step % epoch_steps if epoch_steps else 0
            state = (first, self._train_blocks(rank, world_size))
            for _ in range(step - first):
                state = self._advance(state, rank, world_size, epoch_steps)[0]
        state, block = self._advance(state, rank, world_size, epoch_steps)
        self._streams[key] = state
        return block

    def _advance(self, state: tuple[int, Iterator[CTRBatch]], rank: int, world_size: int,
                 epoch_steps: int | None) -> tuple[tuple[int, Iterator[CTRBatch]], CTRBatch]:
        """Next training block after `state` ((next step, iterator)); restarts per epoch."""
        step, blocks = state
        if epoch_steps and step % epoch_steps == 0:
            blocks = self._train_blocks(rank, world_size)
        block = next(blocks, None)
        if block is None:  # --steps run past the end of the data: next pass
            blocks = self._train_blocks(rank, world_size)
            block = next(blocks, None)
            if block is None:
                raise ValueError(f"{self.cfg.dlrm.data_path}: no full training block of "
                                 f"--batch-size {self.cfg.run.batch_size} lines for rank {rank}")
        return (step + 1, blocks), block
