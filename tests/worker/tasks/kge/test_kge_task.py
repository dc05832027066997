"""--task kge: sharded KvsAll / negative sampling equal single-process training, shard-parallel
filtered ranking equals a brute-force full-table ranking, and a short real-server UMLS run.

The 2-rank runs use spawned gloo ranks (tests/testing/spawn_helpers.py) with the real Trainer and
--local-optimizer at --staleness 0 (the server path is covered by the UMLS run and by
tests/worker/train/test_worker_e2e.py, which shows it equals the local optimizer). The graph has 23
entities, so the two shards are uneven (11 / 12 rows), and batches of 2 x 16 examples over
an epoch that does not divide evenly, so the last global batch is short.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hybridps.datasets import shipped_dataset
from tests.testing.helpers import start_ps_server
from tests.testing.reference_trainer import LocalEmbedding, train_reference
from tests.testing.spawn_helpers import run_ranks
from worker.config.task_defaults import config_with_task_defaults
from worker.tasks.base import HybridModel, build_dense_seeded
from worker.tasks.kge.data import load_kg_dataset
from worker.tasks.kge.task import KGETask, id_maps_dir

REPO = Path(__file__).resolve().parents[4]
UMLS = shipped_dataset("umls")  # hybridps/data/umls
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
NUM_ENTITIES, NUM_RELATIONS = 23, 4
SCENARIOS: dict[str, dict[str, Any]] = {
    # Keci(p=1, q=1) has a per-query bias term and learnable coefficients: every code path.
    "kvsall": {"training": "kvsall", "model": "keci", "dim": 9},
    "negsample": {"training": "negsample", "model": "complex", "dim": 8, "neg_ratio": 3},
    # 1vsAll cross-entropy, N3, a warm-up and reduce-on-plateau fed by evaluations every
    # epoch, the best model restored: the reference follows the same hooks
    "1vsall": {"training": "1vsall", "model": "complex", "dim": 8,
               "reg": "n3", "reg_weight": 0.02, "warmup_epochs": 1.5, "plateau_factor": 0.5,
               "plateau_patience": 0, "eval_every_epochs": 1},
    "kvsall-smooth": {"training": "kvsall", "model": "distmult", "dim": 6,
                      "label_smoothing": 0.1, "reg": "l2", "reg_weight": 0.01,
                      "rel_reg_weight": 0.003, "warmup_epochs": 0.5},
    "kvsall-ce": {"training": "kvsall", "model": "qmult", "dim": 8, "loss": "ce"},
}


def write_graph(directory: Path, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    triples = {(int(h), int(r), int(t)) for h, r, t in zip(
        rng.integers(0, NUM_ENTITIES, 260), rng.integers(0, NUM_RELATIONS, 260),
        rng.integers(0, NUM_ENTITIES, 260), strict=True)}
    ordered = sorted(triples)
    rng.shuffle(ordered)
    splits = {"train": ordered[:170], "valid": ordered[170:200], "test": ordered[200:230]}
    for name, rows in splits.items():
        lines = [f"ent {h:02d}\trel{r}\tent {t:02d}\n" for h, r, t in rows]
        (directory / f"{name}.txt").write_text("".join(lines))
    (directory / "keci.json").write_text(json.dumps({"p": 1, "q": 1}))
    return directory


def scenario_config(data_dir: Path, name: str, **extra: Any) -> Any:
    opts = dict(SCENARIOS[name])
    if opts["model"] == "keci":
        opts["model_config"] = str(data_dir / "keci.json")
    return config_with_task_defaults(
        task="kge", data_dir=str(data_dir), local_optimizer=True, staleness=0, batch_size=16,
        epochs=3, lr=0.05, dense_lr=0.05, eval_every=0, progress=False, log_every=2,
        **opts, **extra)


def _train_on_ranks(ctx: Any, data_dir: str, out_dir: str) -> None:
    """Child (each rank): train every scenario with the real Trainer, dump, evaluate."""
    from worker.train.trainer import Trainer

    for name in SCENARIOS:
        cfg = scenario_config(Path(data_dir), name)
        trainer = Trainer(cfg, ctx)
        try:
            trainer.train()
            trainer.dump_state(str(Path(out_dir) / f"{name}.pt"))
            metrics = trainer.evaluate()
        finally:
            trainer.close()
        if ctx.rank == 0:
            (Path(out_dir) / f"{name}.json").write_text(json.dumps(
                {"metrics": metrics, "steps": trainer.steps,
                 "loss": [v for _, v in trainer.record.loss_curve]}))


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("kge")
    data_dir = write_graph(root / "graph")
    out = root / "out"
    out.mkdir()
    run_ranks("tests.worker.tasks.kge.test_kge_task:_train_on_ranks", 2, str(data_dir), str(out))
    return data_dir, out


@pytest.mark.e2e
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_ranks_equal_single_process(two_rank_runs: tuple[Path, Path], name: str) -> None:
    data_dir, out = two_rank_runs
    cfg = scenario_config(data_dir, name)
    state = torch.load(out / f"{name}.pt")
    ref = train_reference(cfg, world_size=2)
    initial = train_reference(cfg, world_size=2, steps=0)
    steps = json.loads((out / f"{name}.json").read_text())["steps"]
    assert steps == len(ref.losses) == 3 * KGETask(cfg).steps_per_epoch(2)
    rows = state["tables"]["entity"]
    assert not torch.allclose(rows, initial.tables["entity"]), "entity rows never trained"
    torch.testing.assert_close(rows, ref.tables["entity"], rtol=1e-4, atol=2e-5)
    assert set(state["dense"]) == set(ref.dense)
    for key, value in state["dense"].items():
        torch.testing.assert_close(value, ref.dense[key], rtol=1e-4, atol=2e-5, msg=key)


def brute_force_ranks(model: HybridModel, task: KGETask, triples: np.ndarray) -> np.ndarray:
    """Filtered ranks of both directions, full table, written independently of the task."""
    ent = model.embedding.weight("entity").detach()  # type: ignore[operator]
    num_rel = task.num_relations
    known: dict[tuple[int, int], set[int]] = {}
    for h, r, t in task.ds.all_triples().tolist():
        known.setdefault((h, r), set()).add(t)
        known.setdefault((t, r + num_rel), set()).add(h)
    queries = [(h, r, t) for h, r, t in triples.tolist()]
    queries += [(t, r + num_rel, h) for h, r, t in triples.tolist()]
    ranks = []
    with torch.no_grad():
        for h, r, t in queries:
            q, bias, _ = model.dense(ent[[h]], torch.tensor([r]))
            scores = (ent @ q[0] + bias[0]).numpy()
            others = [e for e in range(len(ent)) if e != t and e not in known[(h, r)]]
            greater = sum(scores[e] > scores[t] for e in others)
            equal = sum(scores[e] == scores[t] for e in others)
            ranks.append(1 + greater + equal / 2)
    return np.array(ranks, dtype=np.float64)


@pytest.mark.e2e
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_shard_parallel_eval_equals_brute_force(two_rank_runs: tuple[Path, Path],
                                                name: str) -> None:
    data_dir, out = two_rank_runs
    cfg = scenario_config(data_dir, name)
    task = KGETask(cfg)
    state = torch.load(out / f"{name}.pt")
    emb = LocalEmbedding(task.tables(), seed=cfg.run.seed, init_std=cfg.optim.init_std)
    emb.weight("entity").data.copy_(state["tables"]["entity"])
    dense = build_dense_seeded(task, cfg.run.seed)
    dense.load_state_dict(state["dense"])
    model = HybridModel(emb, dense)
    got = json.loads((out / f"{name}.json").read_text())["metrics"]
    for split in ("valid", "test"):
        ranks = brute_force_ranks(model, task, task.ds.split(split))
        assert got[f"{split}_mrr"] == pytest.approx(float(np.mean(1 / ranks)), abs=1e-12)
        assert got[f"{split}_mr"] == pytest.approx(float(np.mean(ranks)), abs=1e-9)
        for k in (1, 3, 10):
            assert got[f"{split}_hits@{k}"] == pytest.approx(float(np.mean(ranks <= k)))
    # and the single-process path of the task itself agrees
    single = task.evaluate_full(model, 0, 1)
    assert single == pytest.approx(got, abs=1e-12)


@pytest.mark.parametrize(("eps", "tol"), [(1e-30, 1e-6), (1e-8, 1e-4)])
def test_lazy_adam_equals_dense_adam_when_every_row_is_touched(eps: float, tol: float) -> None:
    """KvsAll gives every entity row a gradient each step: SparseAdam == Adam there.

    The one difference is where eps goes (SparseAdam: sqrt(v) + eps, Adam: sqrt(v_hat) +
    eps): with a negligible eps they agree to float rounding, with the default eps to ~1e-5 relative
    (gradients down to 1e-3 here).
    """
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(30, 6, generator=gen)
    grads = [torch.randn(30, 6, generator=gen) * 10 ** -(i % 4) for i in range(25)]
    dense_p = torch.nn.Parameter(start.clone())
    sparse_p = torch.nn.Parameter(start.clone())
    dense_opt = torch.optim.Adam([dense_p], lr=0.1, eps=eps)
    sparse_opt = torch.optim.SparseAdam([sparse_p], lr=0.1, eps=eps)
    for g in grads:
        dense_p.grad = g.clone()
        sparse_p.grad = g.to_sparse()
        dense_opt.step()
        sparse_opt.step()
    torch.testing.assert_close(sparse_p.data, dense_p.data, rtol=tol, atol=tol)


@pytest.mark.e2e
def test_umls_two_ranks_real_server(tmp_path: Path) -> None:
    results = tmp_path / "umls.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with start_ps_server(tmp_path) as ps:
        cmd = [TORCHRUN, "--standalone", "--nproc_per_node", "2", str(REPO / "worker/main.py"),
               "--ps", ps.address, "--task", "kge", "--data-dir", "umls", "--model",
               "distmult", "--epochs", "30", "--staleness", "1", "--eval-every", "30",
               "--results", str(results), "--progress", "false"]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=170, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(results.read_text())
    assert res["mode"] == "server" and res["world_size"] == 2 and res["steps"] == 60
    ev = res["eval"]
    # chance is ~0.04 (135 entities); 30 epochs of DistMult get ~0.6
    assert ev["test_mrr"] > 0.4 and ev["valid_mrr"] > 0.4, ev
    assert 0 < ev["test_hits@1"] <= ev["test_hits@3"] <= ev["test_hits@10"] <= 1
    assert [s for s, _ in res["eval_curve"]] == [29, 59]
    assert results.with_suffix(".png").stat().st_size > 1000
    maps = id_maps_dir(results)
    entity_map = json.loads((maps / "entity_to_id.json").read_text())
    assert entity_map == load_kg_dataset(UMLS).entity_to_id
    assert len(json.loads((maps / "relation_to_id.json").read_text())) == 46
