"""Knowledge-graph embeddings (`--task kge`): link prediction on triples files.

    torchrun --standalone --nproc_per_node 2 worker/main.py --ps 127.0.0.1:50051 \\
        --task kge --data-dir umls --model distmult --dim 32 --epochs 100 \\
        --results runs/umls.json

Tables and parameters
    The entity embeddings are the one row-wise sharded table `entity` (state on the shard
    server, SparseAdam); the relation embeddings (2R rows with reciprocals) and any model
    weights are the dense module (`KGEDense`, FSDP2). Scoring models: worker/tasks/kge/models.py
    (DistMult, ComplEx, QMult, Keci; --model-config JSON for Keci's p/q). Every train triple
    (h, r, t) also trains its reciprocal (t, r + R, h).

Training (--training)
    kvsall: one example per distinct (h, r) of train + reciprocals, BCE of its scores against
        ALL entities vs the multi-hot known tails (dicee's KvsAll). Sharded by entity rows: a
        rank computes the query vectors q(h, r) of its own examples (h through the normal
        sharded lookup), all-gathers them (worker/runtime/gather.py, differentiable), and scores
        every query of the global batch against the rows it OWNS (`local_block`), so the gradient
        of the owned rows is local. Rank r's loss is
            L_r = W / (Q * E) * sum_{q in global batch} sum_{e in rows of r} bce(q, e)
        so that the loop's conventions (FSDP averages the dense grads over ranks; row grads
        are scaled by 1/W) give exactly the gradient of the single-process mean BCE over the
        Q x E global batch, and the mean of the L_r over ranks is that loss.
        Every entity row is scored by every step, so every owned row gets a gradient each
        step: SparseAdam's lazy update equals dense Adam here (up to where eps is added).
    negsample: the train triples + reciprocals, each with --neg-ratio tails corrupted
        uniformly (kge_data.sample_negatives, mode "tail"); loss = mean over the global batch
        of (bce(pos, 1) + sum bce(neg, 0)) / (1 + ratio), rank r's share scaled by W / N.
    Global batches are a pure function of (seed, step): epoch e permutes the examples with
    numpy (seed, e), step i of the epoch takes the next W * --batch-size of them (the last
    one may be short), and rank r keeps part r of np.array_split of it.

Evaluation (filtered MRR, Hits@1/3/10 on valid and test, both directions)
    Head prediction is the tail query of the reciprocal relation. Shard-parallel: each rank
    computes q for its part of a chunk of queries, all-gathers them, scores them against its
    own rows, gets the true entity's score from the rank that owns it (all-reduce), counts
    the better/tied unfiltered entities of its rows (worker.tasks.metrics.block_rank_counts), and
    the counts are summed over ranks (all-reduce): equal to a single-process full-table
    ranking. `evaluate_full(quick=True)` (the progress bar) is valid MRR only.

Files: the entity/relation id maps are written next to --results (`<results>.id_maps/`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hybridps.logs import kv
from worker.config.output_paths import id_maps_path
from worker.config.train_config import TrainConfig
from worker.runtime.gather import all_gather_rows, all_reduce_sum, dist_info, gather_sizes
from worker.tasks.base import Batch, HybridModel, TableConfig, Task
from worker.tasks.kge.collapse import (
    CollapseCheck,
    uniform_loss,
    what_to_change,
    zero_model_is_optimal,
)
from worker.tasks.kge.data import (
    KGDataset,
    TailIndex,
    add_reciprocal,
    eval_queries,
    load_kg_dataset,
    sample_negatives,
)
from worker.tasks.kge.models import KGEScorer, build_model
from worker.tasks.kge.schedule import KGEHooks, auto_eval_every
from worker.tasks.kge.scoring import block_loss
from worker.tasks.metrics import (
    block_rank_counts,
    ranking_metrics_from_sums,
    ranking_sums,
    ranks_from_counts,
)

ENTITY = "entity"
EVAL_CELLS = 1 << 25  # queries x owned entities scored at once in evaluation (128 MiB)
MODEL_OPTIONS = {"keci": ("p", "q", "coefficients"), "qmult": ("unit_relation",)}
log = logging.getLogger("worker.kge")


PENALTY_POWERS = {"none": 0.0, "l2": 2.0, "n3": 3.0}


def _scorer(model: HybridModel) -> KGEScorer:
    """The scorer inside the (possibly FSDP-wrapped) dense module, for its pure functions."""
    dense = model.dense
    scorer = getattr(dense, "scorer", None) or getattr(getattr(dense, "module", None),
                                                       "scorer", None)
    if not isinstance(scorer, KGEScorer):
        raise TypeError(f"the dense module {type(dense).__name__} holds no KGEScorer")
    return scorer


def id_maps_dir(results_path: str | Path) -> Path:
    """Where the id maps of a run go: run.json -> run.id_maps/ (the rule the pre-check of
    the paths a run writes uses too)."""
    return Path(id_maps_path(str(results_path)))


def split_bounds(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of part `rank` of np.array_split(range(n), world_size)."""
    q, r = divmod(n, world_size)
    lo = rank * q + min(rank, r)
    return lo, lo + q + (1 if rank < r else 0)


class KGEDense(nn.Module):
    """The dense part: a KGE scorer; forward gives the query vector and bias of (h, r).

    score(h, r, t) = q . t + bias for every model, so the same forward serves 1-vs-all block
    scoring and triple scoring. Everything that touches a parameter runs inside forward
    (FSDP2 gathers the parameters around forward only): the relation dropout mask and the
    relation rows' penalty sum_b sum_i |r_bi|^power (0: none) too.
    """

    def __init__(self, scorer: KGEScorer) -> None:
        super().__init__()
        self.scorer = scorer

    def forward(self, h_rows: torch.Tensor, rel_ids: torch.Tensor,
                rel_mask: torch.Tensor | None = None, penalty_power: float = 0.0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, bias = self.scorer.query(h_rows, rel_ids, rel_mask)
        if bias is None:
            bias = q.new_zeros(q.shape[0])
        penalty = q.new_zeros(())
        if penalty_power:
            rel_rows = self.scorer.relation(rel_ids)
            penalty = self.scorer.squared_moduli(rel_rows).pow(penalty_power / 2).sum()
        return q, bias, penalty


def load_model_options(path: str, model: str) -> dict[str, Any]:
    """Options of --model-config for this model (e.g. {"p": 0, "q": 1} for keci)."""
    if not path:
        return {}
    raw = json.loads(Path(path).read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    allowed = MODEL_OPTIONS.get(model.lower(), ())
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise ValueError(f"{path}: options {unknown} are not options of model {model!r} "
                         f"(allowed: {list(allowed)})")
    return dict(raw)


class KGETask(Task):
    """Link prediction with sharded entity embeddings (see module doc)."""

    name = "kge"

    def __init__(self, cfg: TrainConfig, dataset: KGDataset | None = None) -> None:
        super().__init__(cfg)
        if dataset is None:
            if not cfg.kge.data_dir:
                raise ValueError("task kge needs --data-dir")
            dataset = load_kg_dataset(cfg.kge.data_dir)
        self.ds = dataset
        self.num_entities = dataset.num_entities
        self.num_relations = dataset.num_relations  # base relations R; the model has 2R
        self.model_options = load_model_options(cfg.run.model_config, cfg.kge.model)
        self.options = cfg.kge_train
        self.training = cfg.kge.training
        self.loss_kind = self.options.loss_for(self.training)
        self.penalty_power = PENALTY_POWERS[self.options.reg]
        if self.training == "kvsall":
            self.kvs: TailIndex = dataset.kvsall_index()
            self.examples = self.kvs.pairs()  # [P, 2] (h, r)
        else:
            self.examples = add_reciprocal(dataset.train, self.num_relations)  # [2N, 3]
        if len(self.examples) == 0:
            raise ValueError(f"{cfg.kge.data_dir}: no training triples")
        self._filter: TailIndex | None = None
        self._perm: tuple[int, np.ndarray] | None = None
        self._dropout_rng: torch.Generator | None = None

    # -- Task interface -------------------------------------------------------------------
    def tables(self) -> list[TableConfig]:
        return [TableConfig(ENTITY, self.num_entities, self.cfg.run.dim)]

    def build_dense(self) -> nn.Module:
        kw = self.model_options
        scorer = build_model(self.cfg.kge.model, 2 * self.num_relations, self.cfg.run.dim, **kw)
        with torch.no_grad():  # relations start at N(0, 1) * --init-std, like the entity rows
            scorer.relation.weight.mul_(self.cfg.optim.init_std)
        return KGEDense(scorer)

    def steps_per_epoch(self, world_size: int) -> int:
        return math.ceil(len(self.examples) / (world_size * self.cfg.run.batch_size))

    def hooks(self, model: HybridModel, world_size: int) -> KGEHooks:
        per_epoch = self.steps_per_epoch(world_size)
        every = auto_eval_every(self.options, training=self.training,
                                valid_triples=len(self.ds.valid), examples=len(self.examples),
                                num_entities=self.num_entities, neg_ratio=self.cfg.kge.neg_ratio)
        total = self.cfg.run.epochs * per_epoch if self.cfg.run.epochs else self.cfg.run.steps
        # --eval-every N (steps) replaces the schedule by epochs; its evaluations still feed
        # the plateau schedule, early stopping and the best model
        scheduled = len(self.ds.valid) > 0 and not self.cfg.output.eval_every
        is_main = dist_info(model.lookups)[0] == 0
        model_name, lr = self.cfg.kge.model, self.cfg.optim.lr
        if is_main and zero_model_is_optimal(self.options, model_name):
            log.warning(kv("kge_penalty", reg=self.options.reg,
                           reg_weight=self.options.reg_weight,
                           problem="training will collapse to uniform scores",
                           change=what_to_change(self.options, model_name, lr)))
        collapse = CollapseCheck(
            num_entities=self.num_entities,
            uniform=uniform_loss(self.training, self.loss_kind, self.num_entities,
                                 self.cfg.kge.neg_ratio),
            advice=what_to_change(self.options, model_name, lr))
        return KGEHooks(self.options, model, steps_per_epoch=per_epoch, total_steps=total,
                        eval_every_epochs=every if scheduled else 0, collapse=collapse,
                        is_main=is_main)

    def global_batch(self, step: int, world_size: int) -> Batch:
        per_epoch = self.steps_per_epoch(world_size)
        epoch, i = divmod(step, per_epoch)
        g = world_size * self.cfg.run.batch_size
        idx = self._permutation(epoch)[i * g:(i + 1) * g]
        if self.training == "kvsall":
            h, r = self.examples[idx, 0], self.examples[idx, 1]
            return Batch(len(idx), ids={"pair": torch.from_numpy(idx),
                                        "head": torch.from_numpy(h),
                                        "rel": torch.from_numpy(r)})
        pos = self.examples[idx]
        ids = {"head": torch.from_numpy(pos[:, 0].copy()),
               "rel": torch.from_numpy(pos[:, 1].copy()),
               "tail": torch.from_numpy(pos[:, 2].copy())}
        if self.training == "negsample":
            rng = np.random.default_rng([self.cfg.run.seed, 2, step])
            ratio = self.cfg.kge.neg_ratio
            neg = sample_negatives(pos, self.num_entities, ratio, rng, mode="tail")
            ids["neg"] = torch.from_numpy(neg[:, 2].reshape(len(pos), ratio).copy())
        return Batch(len(idx), ids=ids)

    def batch(self, step: int, rank: int, world_size: int) -> Batch:
        full = self.global_batch(step, world_size)
        return full.slice(*split_bounds(full.size, world_size, rank))

    def loss(self, model: HybridModel, batch: Batch) -> torch.Tensor:
        if self.training == "negsample":
            return self._negsample_loss(model, batch)
        return self._all_entities_loss(model, batch)

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "data_dir": self.cfg.kge.data_dir,
                "model": self.cfg.kge.model,
                "model_options": self.model_options, "training": self.training,
                "loss": self.loss_kind, "kge_options": dataclasses.asdict(self.options),
                "neg_ratio": self.cfg.kge.neg_ratio if self.training == "negsample" else None,
                "entities": self.num_entities, "relations": self.num_relations,
                "train_triples": len(self.ds.train), "valid_triples": len(self.ds.valid),
                "test_triples": len(self.ds.test), "examples": len(self.examples)}

    def eval_cost_in_steps(self, world_size: int, *, quick: bool) -> float:
        """Scores computed: an evaluation ranks 2 queries a triple against every entity; a
        step scores its global batch against every entity (1vsall, kvsall) or 1 + k of them,
        about 3 times over with the backward (as auto_eval_every)."""
        triples = len(self.ds.valid) + (0 if quick or not self.options.eval_test
                                        else len(self.ds.test))
        return self.ranking_cost_in_steps(triples, world_size)

    def ranking_cost_in_steps(self, triples: int, world_size: int) -> float:
        scored = self.num_entities if self.training != "negsample" else 1 + self.cfg.kge.neg_ratio
        step_work = 3.0 * world_size * self.cfg.run.batch_size * scored
        return 2.0 * triples * self.num_entities / step_work

    def rows_pushed_per_step(self, world_size: int) -> dict[str, int] | None:
        """1vsall / kvsall score every entity, so every owned row is pushed every step;
        negsample: the global batch's heads, tails and negatives at most."""
        owned = math.ceil(self.num_entities / world_size)
        if self.training != "negsample":
            return {ENTITY: owned}
        looked_up = world_size * self.cfg.run.batch_size * (2 + self.cfg.kge.neg_ratio)
        return {ENTITY: min(owned, looked_up)}

    def save_artifacts(self, results_path: str) -> list[str]:
        directory = id_maps_dir(results_path)
        self.ds.save_id_maps(directory)
        return [str(directory)]

    # -- training ---------------------------------------------------------------------------
    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            rng = np.random.default_rng([self.cfg.run.seed, epoch])
            order = rng.permutation(len(self.examples))
            self._perm = (epoch, order.astype(np.int64))
        return self._perm[1]

    def _dropout(self, x: torch.Tensor, p: float, rank: int) -> torch.Tensor:
        """Inverted dropout with this rank's own generator (seeded by (seed, rank)): a run is
        a deterministic function of its config."""
        if not p:
            return x
        if self._dropout_rng is None:
            self._dropout_rng = torch.Generator(x.device).manual_seed(
                self.cfg.run.seed * 1_000_003 + rank)
        keep = torch.rand(x.shape, generator=self._dropout_rng, device=x.device) >= p
        return x * keep.to(x.dtype) / (1.0 - p)

    def _relation_mask(self, n: int, rank: int, device: torch.device) -> torch.Tensor | None:
        p = self.options.relation_dropout
        if not p:
            return None
        return self._dropout(torch.ones(n, self.cfg.run.dim, device=device), p, rank)

    def _penalty(self, model: HybridModel, ent_rows: torch.Tensor, rel_penalty: torch.Tensor
                 ) -> torch.Tensor:
        """lambda_e sum |e|^p over the entity rows the examples use + lambda_r sum |r|^p."""
        scorer = _scorer(model)
        ent = scorer.squared_moduli(ent_rows).pow(self.penalty_power / 2).sum()
        return self.options.reg_weight * ent + self.options.relation_reg_weight * rel_penalty

    def _all_entities_loss(self, model: HybridModel, batch: Batch) -> torch.Tensor:
        """kvsall / 1vsall: every query of the global batch against the rows this rank owns."""
        emb = model.lookups
        rank, world, group = dist_info(emb)
        device = batch.ids["head"].device
        sizes = gather_sizes(batch.size, world, group, device)
        total = sum(sizes)
        b = batch.size
        opts = self.options
        with_tail = self.penalty_power and self.training == "1vsall"
        ids = torch.cat([batch.ids["head"], batch.ids["tail"]]) if with_tail else batch.ids["head"]
        rows = emb.lookup(ENTITY, ids)
        h_BD = rows[:b]
        q_BD, bias_B, rel_pen = model.dense(
            self._dropout(h_BD, opts.entity_dropout, rank), batch.ids["rel"],
            self._relation_mask(b, rank, device), self.penalty_power)
        qb_QD = all_gather_rows(torch.cat([q_BD, bias_B.unsqueeze(1)], dim=1), sizes, rank,
                                world, group)
        start, block_ED = emb.local_block(ENTITY)
        end = start + block_ED.shape[0]
        weights_P = None
        if self.training == "kvsall":
            pair_Q = all_gather_rows(batch.ids["pair"], sizes, rank, world, group).cpu().numpy()
            rows_np, cols_np = self.kvs.block_coo_by_pair(pair_Q, start, end)
            if self.loss_kind == "ce":  # the target distribution: uniform over known tails
                counts = np.diff(self.kvs.offsets)[pair_Q]
                weights_P = torch.from_numpy(1.0 / counts[rows_np]).to(device)
        else:
            tail_Q = all_gather_rows(batch.ids["tail"], sizes, rank, world, group)
            inside = (tail_Q >= start) & (tail_Q < end)
            rows_t = torch.nonzero(inside).squeeze(1)
            rows_np, cols_np = rows_t.cpu().numpy(), (tail_Q[rows_t] - start).cpu().numpy()
        dim = q_BD.shape[1]
        # bce: the mean over the Q x E cells (dicee's KvsAll); ce: the mean over queries
        per = self.num_entities if self.loss_kind == "bce" else 1
        loss = block_loss(self.loss_kind, qb_QD[:, :dim], qb_QD[:, dim],
                          self._dropout(block_ED, opts.entity_dropout, rank),
                          torch.from_numpy(rows_np).to(device),
                          torch.from_numpy(cols_np).to(device), weights_P=weights_P,
                          scale=world / (total * per), num_entities=self.num_entities,
                          label_smoothing=opts.label_smoothing, world_size=world, group=group)
        if self.penalty_power:
            loss = loss + self._penalty(model, rows, rel_pen) * (world / total)
        return loss

    def _negsample_loss(self, model: HybridModel, batch: Batch) -> torch.Tensor:
        emb = model.lookups
        rank, world, group = dist_info(emb)
        device = batch.ids["head"].device
        total = sum(gather_sizes(batch.size, world, group, device))
        b = batch.size
        neg_BK = batch.ids["neg"]
        ids = torch.cat([batch.ids["head"], batch.ids["tail"], neg_BK.reshape(-1)])
        rows = emb.lookup(ENTITY, ids)
        h_BD, t_BD, neg_BKD = rows[:b], rows[b:2 * b], rows[2 * b:].reshape(b, -1, rows.shape[1])
        p = self.options.entity_dropout
        q_BD, bias_B, rel_pen = model.dense(self._dropout(h_BD, p, rank), batch.ids["rel"],
                                            self._relation_mask(b, rank, device),
                                            self.penalty_power)
        pos_B = (q_BD * self._dropout(t_BD, p, rank)).sum(dim=1) + bias_B
        neg_score_BK = (torch.einsum("bd,bkd->bk", q_BD, self._dropout(neg_BKD, p, rank))
                        + bias_B.unsqueeze(1))
        if self.loss_kind == "ce":  # softmax over the positive and its negatives
            logits = torch.cat([pos_B.unsqueeze(1), neg_score_BK], dim=1)
            loss = F.cross_entropy(logits, torch.zeros(b, dtype=torch.long, device=device),
                                   reduction="sum") * (world / total)
        else:
            pos_loss = F.binary_cross_entropy_with_logits(pos_B, torch.ones_like(pos_B),
                                                          reduction="sum")
            neg_loss = F.binary_cross_entropy_with_logits(
                neg_score_BK, torch.zeros_like(neg_score_BK), reduction="sum")
            loss = (pos_loss + neg_loss) * (world / (total * (1 + neg_BK.shape[1])))
        if self.penalty_power:
            loss = loss + self._penalty(model, rows[:2 * b], rel_pen) * (world / total)
        return loss

    # -- evaluation -------------------------------------------------------------------------
    @property
    def filter_index(self) -> TailIndex:
        if self._filter is None:
            self._filter = self.ds.filter_index()
        return self._filter

    def evaluate_full(self, model: HybridModel, rank: int, world_size: int, *,
                      quick: bool = False) -> dict[str, float]:
        out: dict[str, float] = {}
        splits = ("valid",) if quick or not self.options.eval_test else ("valid", "test")
        for split in splits:
            triples = self.ds.split(split)
            if len(triples) == 0:
                continue
            metrics = self.rank_metrics(model, triples)
            keys = ("mrr",) if quick else ("mrr", "mr", "hits@1", "hits@3", "hits@10")
            out.update({f"{split}_{k}": metrics[k] for k in keys})
        return out

    @torch.no_grad()
    def rank_metrics(self, model: HybridModel, triples: np.ndarray) -> dict[str, float]:
        """Filtered ranking metrics of both directions of `triples` (all ranks call it)."""
        sums = self.rank_sums(model, triples)
        return ranking_metrics_from_sums(sums)

    @torch.no_grad()
    def rank_sums(self, model: HybridModel, triples: np.ndarray) -> torch.Tensor:
        emb = model.lookups
        rank, world, group = dist_info(emb)
        start, block_ED = emb.local_block(ENTITY)
        block_ED = block_ED.detach()
        end = start + block_ED.shape[0]
        device = block_ED.device
        queries = eval_queries(triples, self.num_relations)
        widest = math.ceil(self.num_entities / world)
        chunk = max(world, min(len(queries), EVAL_CELLS // max(widest, 1)))
        sums = torch.zeros(6, dtype=torch.float64)
        for s in range(0, len(queries), chunk):
            qb = queries[s:s + chunk]
            n = len(qb)
            lo, hi = split_bounds(n, world, rank)
            sizes = [split_bounds(n, world, r)[1] - split_bounds(n, world, r)[0]
                     for r in range(world)]
            h = torch.from_numpy(qb[lo:hi, 0].copy()).to(device)
            rel = torch.from_numpy(qb[lo:hi, 1].copy()).to(device)
            q_BD, bias_B, _ = model.dense(emb.lookup(ENTITY, h), rel)
            qb_QD = all_gather_rows(torch.cat([q_BD, bias_B.unsqueeze(1)], dim=1), sizes, rank,
                                    world, group)
            dim = q_BD.shape[1]
            scores_QE = qb_QD[:, :dim] @ block_ED.t() + qb_QD[:, dim:]
            true_ids = torch.from_numpy(qb[:, 2].copy()).to(device)
            inside = (true_ids >= start) & (true_ids < end)
            true_Q = torch.zeros(n, dtype=scores_QE.dtype, device=device)
            rows = torch.nonzero(inside).squeeze(1)
            true_Q[rows] = scores_QE[rows, true_ids[rows] - start]
            all_reduce_sum(true_Q, world, group)  # exactly one rank holds each true score
            mask = torch.from_numpy(self.filter_index.block_mask(qb[:, 0], qb[:, 1], start, end))
            greater, equal = block_rank_counts(scores_QE, true_Q, block_start=start,
                                               true_ids=true_ids, filter_mask=mask.to(device))
            counts = all_reduce_sum(torch.stack([greater, equal]), world, group)
            sums += ranking_sums(ranks_from_counts(counts[0], counts[1]))
        return sums
