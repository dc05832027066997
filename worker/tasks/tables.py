"""`--task tables`: click prediction over a configurable list of tables (benchmarks).

    --task tables                                    # one table t0 of --num-rows rows
    --task tables --dim 64 --batch-size 1024         # TorchRec-like: one 1M x 64 table
    --task tables --tables user:1000000,ad:50000:4   # ad: a bag of 4 ids, mean-pooled
    --task tables --num-rows 50000000 --zipf-rows 1000000   # growth: 50M rows, the same
                                                            # ids touched as at 1M rows

Each sample has, per table, POOL ids (bounded Zipf over popularity ranks, scattered by a
fixed bijection like the default job; with --zipf-rows N the ranks come from the first N
only, so the number of distinct ids a step touches does not grow with the table, while
the bijection still spreads them over all of it) and NUM_DENSE dense features. Planted truth: a
per-row scalar b_t(id) with unit variance computed by hashing the id (no per-row array,
so a 50M-row table costs no host memory for it); the label is
Bernoulli(sigmoid(sum_t mean(b_t[ids]) + w . dense + BIAS)). The model: the tables'
(pooled) rows concatenated with the dense features -> MLP -> logit, BCE loss; all tables
in one fused lookup_many. The work a step is proportional to the ids touched, never to
the table size: what the growth benchmark (bench/bench_train.py) measures, holding the ids
touched fixed with --zipf-rows (over a whole 50M-row table a bounded Zipf touches ~11%
more distinct rows per 2048 ids than over 1M).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from hybridps.dynamic import DynamicSpec, salted
from worker.config.task_options import parse_table_list, parse_tables, table_shardings
from worker.config.train_config import TrainConfig
from worker.tasks.base import Batch, HybridModel, TableConfig
from worker.tasks.click import ClickTask, click_mlp_parameters
from worker.tasks.metrics import batch_roc_auc
from worker.tasks.synthetic import ZIPF_S, Scatter, zipf_ranks

NUM_DENSE = 4
BIAS = -0.2
_U64 = np.uint64


def table_specs(cfg: TrainConfig) -> list[tuple[str, int, int]]:
    """[(name, rows, pool)] from --tables, or one table t0 of --num-rows rows."""
    spec = cfg.tables.tables
    return parse_table_list(spec) if spec else [("t0", cfg.synthetic.num_rows, 1)]


def dynamic_specs(cfg: TrainConfig) -> dict[str, DynamicSpec]:
    """The dynamic tables of --tables (docs/dynamic_ids.md), by name."""
    spec = cfg.tables.tables
    return ({name: d for name, _, _, d in parse_tables(spec) if d is not None} if spec
            else {})


def raw_ids(ranks: np.ndarray, salt: int) -> np.ndarray:
    """A dynamic table's raw int64 ids (any value, negatives too): a bijective hash of the
    popularity rank."""
    return salted(ranks.astype(np.int64).view(_U64), 0x5851F42D4C957F2D + salt).view(np.int64)


def planted_value(ids: np.ndarray, salt: int) -> np.ndarray:
    """b(id): a fixed pseudo-random value per row, uniform with variance 1 (splitmix64)."""
    z = ids.astype(_U64) + _U64((0x9E3779B97F4A7C15 * (salt + 1)) % 2**64)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    z = z ^ (z >> _U64(31))
    u = (z >> _U64(11)).astype(np.float64) * (1.0 / 2**53)
    return ((u - 0.5) * np.sqrt(12.0)).astype(np.float32)


class TablesTask(ClickTask):
    """Click prediction over --tables (see module doc)."""

    name = "tables"
    # the exponent of the ids' bounded Zipf law; 0 is uniform (a subclass may set it:
    # bench/bench_memory_tier.py's worst case)
    zipf_s = ZIPF_S

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__(cfg)
        self.specs = table_specs(cfg)
        # dynamic tables: ROWS is their capacity; their raw ids come from the Zipf law over
        # --num-rows popularity ranks (--zipf-rows: the first N), hashed (`raw_ids`)
        self.dynamic = dynamic_specs(cfg)
        self.scatter = [Scatter(rows, salt) for salt, (_, rows, _) in enumerate(self.specs)]
        # popularity ranks the ids are drawn from (--zipf-rows), scattered over all rows
        zipf_rows = cfg.tables.zipf_rows
        self.zipf_support = [min(cfg.synthetic.num_rows, zipf_rows or cfg.synthetic.num_rows)
                             if name in self.dynamic else min(rows, zipf_rows or rows)
                             for name, rows, _ in self.specs]
        rng = np.random.default_rng([cfg.run.seed, 7907])
        self.dense_w = (rng.standard_normal(NUM_DENSE) * 0.5).astype(np.float32)

    @classmethod
    def plan_tables(cls, cfg: TrainConfig) -> list[tuple[TableConfig, float]]:
        """(table, lookups per sample) without building the task (worker/plan.py)."""
        dynamic = dynamic_specs(cfg)
        schemes = table_shardings(cfg.tables.tables)
        return [(TableConfig(name, rows, cfg.run.dim, dynamic.get(name), schemes.get(name, ""),
                             pool), float(pool))
                for name, rows, pool in table_specs(cfg)]

    def tables(self) -> list[TableConfig]:
        return [t for t, _ in self.plan_tables(self.cfg)]

    def input_width(self) -> int:
        return self.input_width_for(self.cfg)

    @classmethod
    def input_width_for(cls, cfg: TrainConfig) -> int:
        """input_width without the task (plan_dense_parameters); subclasses override this."""
        return len(table_specs(cfg)) * cfg.run.dim + NUM_DENSE

    @classmethod
    def plan_dense_parameters(cls, cfg: TrainConfig) -> int | None:
        return click_mlp_parameters(cls.input_width_for(cfg))

    def evaluate(self, model: HybridModel, batch: Batch) -> dict[str, torch.Tensor]:
        logit_B, label_B = self.forward(model, batch), batch.values["label"]
        planted_B = batch.values["planted_logit"]
        return {"loss": F.binary_cross_entropy_with_logits(logit_B, label_B),
                "planted_loss": F.binary_cross_entropy_with_logits(planted_B, label_B),
                "auc": batch_roc_auc(logit_B, label_B),
                "planted_auc": batch_roc_auc(planted_B, label_B)}

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "pool": {n: p for n, _, p in self.specs},
                "num_dense": NUM_DENSE}

    def lookup_inputs(self, batch: Batch, names: list[str], mode: str = "mean"
                      ) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, str] | None]]:
        """lookup_many's ids and bags for tables `names` of the batch: one id a sample is a
        plain lookup, more are bags pooled by `mode`."""
        pools = {name: pool for name, _, pool in self.specs}
        ids: list[torch.Tensor] = []
        bags: list[tuple[torch.Tensor, str] | None] = []
        for name in names:
            if pools[name] == 1:
                ids.append(batch.ids[name])
                bags.append(None)
            else:
                ids_N, offsets_B = batch.bags[name]
                ids.append(ids_N)
                bags.append((offsets_B, mode))
        return ids, bags

    def forward(self, model: HybridModel, batch: Batch) -> torch.Tensor:
        names = [name for name, _, _ in self.specs]
        ids, bags = self.lookup_inputs(batch, names)
        rows = model.lookups.lookup_many(names, ids, bags=bags)
        out: torch.Tensor = model.dense(torch.cat([*rows, batch.values["dense"]], dim=1))
        return out.squeeze(-1)

    def generate(self, stream: int, index: int, size: int) -> Batch:
        rng = np.random.default_rng([self.cfg.run.seed, stream, index])
        ids: dict[str, torch.Tensor] = {}
        bags: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        logit_B = np.full(size, BIAS, dtype=np.float32)
        for salt, (name, _, pool) in enumerate(self.specs):
            ranks = zipf_ranks(rng, self.zipf_support[salt], size * pool, self.zipf_s)
            ids_BP = (raw_ids(ranks, salt) if name in self.dynamic
                      else self.scatter[salt](ranks)).reshape(size, pool)
            logit_B += planted_value(ids_BP, salt).mean(axis=1)
            if pool == 1:
                ids[name] = torch.from_numpy(ids_BP.reshape(size))
            else:
                offsets_B = torch.arange(0, size * pool, pool, dtype=torch.int64)
                bags[name] = (torch.from_numpy(ids_BP.reshape(-1)), offsets_B)
        dense_BF = rng.standard_normal((size, NUM_DENSE)).astype(np.float32)
        logit_B += dense_BF @ self.dense_w
        label_B = (rng.random(size) < 1.0 / (1.0 + np.exp(-logit_B))).astype(np.float32)
        return Batch(size, ids=ids, bags=bags,
                     values={"dense": torch.from_numpy(dense_BF),
                             "label": torch.from_numpy(label_B),
                             "planted_logit": torch.from_numpy(logit_B)})
