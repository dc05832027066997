"""A planted knowledge graph of any size, generated on the fly (`--task kge_planted`), for the
scale check: millions of entity rows sharded over the ranks, Adam state on the server,
evaluation over all entities, and an MRR whose ceiling is known exactly.

    torchrun --nproc_per_node 2 worker/main.py --ps HOST:PORT --task kge_planted \\
        --num-rows 5000000 --dim 64 --steps 2000 --batch-size 4096 \\
        --planted-community 8 --planted-relations 16

The graph. Entity e belongs to community c(e) = e // S (S = planted_community; --num-rows
is rounded down to a multiple of S). Relation r of R
maps community c to community (c + offset_r) mod C (C = num_rows / S, offset_r fixed by the
seed). A triple (h, r, t): h uniform over the entities, t uniform over the S members of
community (c(h) + offset_r) mod C. Training sees each triple or its reciprocal (t, r + R, h)
with probability 1/2 (the model has 2R relations), with --neg-ratio uniformly corrupted tails
(negative sampling: scoring all millions of entities per example would not fit the machine).
Batches are a pure function of (seed, step), like every task's.

The ceiling. For a query (h, r, ?) the answer is uniform over the S members of the target
community and independent of everything a model can see, so for ANY ranking of the entities
E[1 / rank] <= (1/S) sum_{k=1..S} 1/k = H_S / S (the best any scorer can do: the S members in
the first S places). The test set (planted_test triples, both directions) is ranked against
all entities UNFILTERED (filtering against generated training data would remove the whole
community); `describe()` reports `mrr_ceiling` = H_S / S and chance = ~ln(N)/N.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from worker.config.train_config import TrainConfig
from worker.tasks.base import Batch, HybridModel, TableConfig
from worker.tasks.kge.data import KGDataset, TailIndex
from worker.tasks.kge.task import ENTITY, KGETask


class _Names(dict):  # type: ignore[type-arg]
    """A stand-in id map of n entries that stores none (len only): no 10M-entry dict."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def __len__(self) -> int:
        return self.n


def planted_offsets(num_relations: int, num_communities: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, 7])
    return rng.integers(1, max(num_communities, 2), size=num_relations, dtype=np.int64)


def planted_triples(n: int, *, num_entities: int, community: int, offsets: np.ndarray,
                    rng: np.random.Generator) -> np.ndarray:
    """[n, 3] int64 triples (h, r, t) of the planted graph (module doc)."""
    communities = num_entities // community
    h = rng.integers(0, num_entities, size=n, dtype=np.int64)
    r = rng.integers(0, len(offsets), size=n, dtype=np.int64)
    target = (h // community + offsets[r]) % communities
    t = target * community + rng.integers(0, community, size=n, dtype=np.int64)
    return np.stack([h, r, t], axis=1)


def mrr_ceiling(community: int) -> float:
    """H_S / S: the best expected reciprocal rank any scorer reaches (module doc)."""
    return sum(1.0 / k for k in range(1, community + 1)) / community


class PlantedKGETask(KGETask):
    """KGETask on a generated planted graph: negative sampling, unfiltered ranking."""

    name = "kge_planted"

    def __init__(self, cfg: TrainConfig) -> None:
        options = cfg.kge_train
        self.community = options.planted_community
        n = (cfg.synthetic.num_rows // self.community) * self.community
        if n < 2 * self.community:
            raise ValueError(f"num_rows={cfg.synthetic.num_rows} gives fewer than 2 communities of "
                             f"{self.community}")
        self.offsets = planted_offsets(options.planted_relations, n // self.community, cfg.run.seed)
        test = planted_triples(options.planted_test, num_entities=n, community=self.community,
                               offsets=self.offsets, rng=np.random.default_rng([cfg.run.seed, 9]))
        empty = np.zeros((0, 3), dtype=np.int64)
        relations = {f"r{i}": i for i in range(options.planted_relations)}
        dataset = KGDataset(train=test[:1], valid=empty, test=test, entity_to_id=_Names(n),
                            relation_to_id=relations)
        super().__init__(cfg, dataset)
        self.training = "negsample"
        self.loss_kind = self.options.loss_for("negsample")

    @classmethod
    def plan_tables(cls, cfg: TrainConfig) -> list[tuple[TableConfig, float]]:
        # per sample: head, tail and --neg-ratio negatives are looked up
        return [(TableConfig(ENTITY, cfg.synthetic.num_rows, cfg.run.dim), 2.0 + cfg.kge.neg_ratio)]

    def steps_per_epoch(self, world_size: int) -> int | None:  # type: ignore[override]
        return None  # generated data: --steps

    def hooks(self, model: HybridModel, world_size: int) -> None:  # type: ignore[override]
        return None  # no valid split to schedule on

    @property
    def filter_index(self) -> TailIndex:
        if self._filter is None:  # unfiltered ranking: nothing is left out
            self._filter = TailIndex.from_triples(np.zeros((0, 3), dtype=np.int64),
                                                  self.num_entities, 2 * self.num_relations)
        return self._filter

    def global_batch(self, step: int, world_size: int) -> Batch:
        g = world_size * self.cfg.run.batch_size
        rng = np.random.default_rng([self.cfg.run.seed, 3, step])
        pos = planted_triples(g, num_entities=self.num_entities, community=self.community,
                              offsets=self.offsets, rng=rng)
        flip = rng.random(g) < 0.5  # the reciprocal (t, r + R, h) half of the time
        pos[flip] = np.stack([pos[flip, 2], pos[flip, 1] + self.num_relations, pos[flip, 0]],
                             axis=1)
        new = rng.integers(0, self.num_entities - 1, size=(g, self.cfg.kge.neg_ratio),
                           dtype=np.int64)
        neg = new + (new >= pos[:, 2:3])  # uniform over the entities other than the tail
        return Batch(g, ids={"head": torch.from_numpy(pos[:, 0].copy()),
                             "rel": torch.from_numpy(pos[:, 1].copy()),
                             "tail": torch.from_numpy(pos[:, 2].copy()),
                             "neg": torch.from_numpy(neg)})

    def evaluate_full(self, model: HybridModel, rank: int, world_size: int, *,
                      quick: bool = False) -> dict[str, float]:
        metrics = self.rank_metrics(model, self.ds.test)
        return {f"test_{k}": metrics[k] for k in ("mrr", "mr", "hits@1", "hits@3", "hits@10")}

    def describe(self) -> dict[str, Any]:
        n = self.num_entities
        return {"task": self.name, "tables": [t.__dict__ for t in self.tables()],
                "model": self.cfg.kge.model, "training": "negsample",
                "neg_ratio": self.cfg.kge.neg_ratio,
                "entities": n, "relations": self.num_relations,
                "community": self.community, "test_triples": len(self.ds.test),
                "mrr_ceiling": mrr_ceiling(self.community),
                "mrr_chance": (math.log(n) + 0.5772) / n}

    def eval_cost_in_steps(self, world_size: int, *, quick: bool) -> float:
        return self.ranking_cost_in_steps(len(self.ds.test), world_size)  # test, always

    def save_artifacts(self, results_path: str) -> list[str]:
        return []  # ids are the names (e0 .. e{N-1}): no maps to write
