"""The planted graph generator (--task kge_planted) at small size: its structure, its exact
MRR ceiling, and a short training run that learns it (evaluation over all entities)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.config.task_defaults import config_with_task_defaults
from worker.tasks.kge.synth import (
    PlantedKGETask,
    mrr_ceiling,
    planted_offsets,
    planted_triples,
)


def test_triples_follow_the_planted_communities() -> None:
    offsets = planted_offsets(5, 100, seed=0)
    t = planted_triples(20000, num_entities=800, community=8, offsets=offsets,
                        rng=np.random.default_rng(0))
    assert ((t[:, 2] // 8) == (t[:, 0] // 8 + offsets[t[:, 1]]) % 100).all()
    # tails are uniform within the target community
    counts = np.bincount(t[:, 2] % 8, minlength=8)
    assert counts.min() > 0.9 * counts.mean()


def test_ceiling_is_the_best_ranking_of_a_uniform_community() -> None:
    assert mrr_ceiling(1) == 1.0
    assert mrr_ceiling(8) == pytest.approx(sum(1 / k for k in range(1, 9)) / 8)
    # any ranking of 8 equally likely answers: E[1/rank] <= H_8 / 8, with equality when the
    # 8 take the first places, in any order
    rng = np.random.default_rng(1)
    for _ in range(20):
        places = np.sort(rng.choice(50, size=8, replace=False)) + 1
        assert np.mean(1 / places) <= mrr_ceiling(8) + 1e-12


def test_batches_are_a_pure_function_of_the_step_and_use_reciprocals() -> None:
    cfg = config_with_task_defaults(task="kge_planted", num_rows=1000, dim=8, steps=5,
                                    batch_size=64, local_optimizer=True, training="negsample",
                                    neg_ratio=3)
    task = PlantedKGETask(cfg)
    a, b = task.global_batch(3, 2), task.global_batch(3, 2)
    assert all(torch.equal(a.ids[k], b.ids[k]) for k in a.ids)
    assert a.size == 128 and a.ids["neg"].shape == (128, 3)
    assert (a.ids["rel"] >= 16).any() and (a.ids["rel"] < 16).any()
    assert not (a.ids["neg"] == a.ids["tail"][:, None]).any()
    assert task.describe()["mrr_ceiling"] == pytest.approx(mrr_ceiling(8))


@pytest.mark.timeout(300)
def test_small_planted_graph_trains_towards_its_ceiling() -> None:
    from tests.testing.reference_trainer import train_reference
    from worker.tasks.base import HybridModel

    cfg = config_with_task_defaults(task="kge_planted", num_rows=200, dim=32, steps=100,
                                    batch_size=128, local_optimizer=True, training="negsample",
                                    neg_ratio=16, lr=0.05, dense_lr=0.05, init_std=0.1,
                                    model="distmult", planted_relations=4, planted_test=200)
    task = PlantedKGETask(cfg)
    result = train_reference(cfg, world_size=1, task=task)
    from tests.testing.reference_trainer import LocalEmbedding
    from worker.tasks.base import build_dense_seeded

    emb = LocalEmbedding(task.tables(), seed=cfg.run.seed, init_std=cfg.optim.init_std)
    emb.weight("entity").data.copy_(result.tables["entity"])
    dense = build_dense_seeded(task, cfg.run.seed)
    dense.load_state_dict(result.dense)
    metrics = task.evaluate_full(HybridModel(emb, dense), 0, 1)
    ceiling = task.describe()["mrr_ceiling"]
    assert isinstance(ceiling, float)
    assert 0.5 * ceiling < metrics["test_mrr"] <= ceiling + 1e-9, metrics
