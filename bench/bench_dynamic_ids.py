"""Dynamic ids (docs/dynamic_ids.md) on a drifting click stream: a dynamic table with 1/10
of the device rows vs static tables.

    python bench/bench_dynamic_ids.py            # 10M+ raw ids seen, capacity 1/10 of them
    python bench/bench_dynamic_ids.py --quick    # the same shape, small (capacity 1/5)
    python bench/bench_dynamic_ids.py --json out.json

The stream: each sample has one id feature and 4 dense features. Ids are drawn from a
Zipf law over popularity ranks, and the ranks drift (rank r at step t is item r +
t * drift), so new ids keep appearing and old ones fade; an item's raw id is a 64-bit
hash of it (any int64). Planted truth: logit = 2 b(item) + w . dense + bias, b a fixed
hashed value per item (variance 1). Held-out: the stream's next steps.

Compared, trained side by side on the same batches (interleaved chunks of steps, each
variant's samples/s the median over chunks), in one process (world size 1, the
in-process optimizer: --local-optimizer's path, staleness 0):
- dynamic: capacity C = (ids seen) / 10 (--quick: / 5), LRU, admit always; evicted
  rows page out with their Adam state (host memory) and come back bitwise; the loop
  prefetches (ShardedEmbedding.prefetch): step t+1's ids are translated to slots on a
  helper thread while step t's backward, optimizer and update run
  (worker/embedding/dynamic/prefetch.py);
- dynamic_inline: the same table translating each step's ids at its lookup (no prefetch);
- modulo (a): a static table of the same C rows, fed raw id % C (collisions);
- full (b): a static table with a row for every item of the stream (no collisions);
- torchrec (c): TorchRec's ManagedCollisionCollection (MCH, LRU) remapping raw ids to C
  rows of an nn.Embedding (SparseAdam), an evicted row reset; when torchrec imports
  (pyproject's `bench` extra: pip install -e '.[bench]' && pip install --no-deps
  torchrec==1.8.0), otherwise the JSON says why not.

Goals: AUC(dynamic) >= AUC(full) - 0.005 at 1/10 of its device rows; AUC(dynamic)
> AUC(modulo); samples/s(dynamic) >= 0.8 x samples/s(modulo, same capacity).
"""

from __future__ import annotations

import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from harness import bench_parser, log, machine, write_json
from torch import nn

from hybridps.dynamic import DynamicSpec
from hybridps.optim import OptimizerSpec
from worker.embedding.rows import TableConfig
from worker.embedding.sharded import ShardedEmbedding
from worker.tasks.metrics import batch_roc_auc
from worker.tasks.synthetic import zipf_ranks
from worker.tasks.tables import planted_value, raw_ids
from worker.updates.source import LocalSparseOptimizer, StalenessWindow

NUM_DENSE = 4
DIM = 16


@dataclass(frozen=True)
class Shape:
    active: int       # items the Zipf law draws from at any step
    drift: int        # ranks move this many items a step (new ids appear, old fade)
    steps: int
    batch: int
    eval_steps: int
    capacity_share: int  # capacity = ids seen // this
    chunks: int       # interleaving: the steps are trained in this many chunks

    @property
    def universe(self) -> int:
        return self.active + self.drift * (self.steps + self.eval_steps)


FULL = Shape(active=4_000_000, drift=3_300, steps=4000, batch=8192, eval_steps=20,
             capacity_share=10, chunks=20)
QUICK = Shape(active=150_000, drift=60, steps=300, batch=1024, eval_steps=10,
              capacity_share=5, chunks=6)


class Stream:
    """The click stream (module doc): batch(step) from (seed, step) alone."""

    def __init__(self, shape: Shape, seed: int = 0) -> None:
        self.shape, self.seed = shape, seed
        rng = np.random.default_rng([seed, 1])
        self.dense_w = (rng.standard_normal(NUM_DENSE) * 0.5).astype(np.float32)

    def items(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step, 2])
        ranks = zipf_ranks(rng, self.shape.active, self.shape.batch, s=1.05)
        return ranks + step * self.shape.drift  # in [0, universe)

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        items = self.items(step)
        rng = np.random.default_rng([self.seed, step, 3])
        dense = rng.standard_normal((items.size, NUM_DENSE)).astype(np.float32)
        logit = 2.0 * planted_value(items, 0) + dense @ self.dense_w - 0.3
        label = (rng.random(items.size) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return {"item": torch.from_numpy(items), "raw": torch.from_numpy(raw_ids(items, 0)),
                "dense": torch.from_numpy(dense), "label": torch.from_numpy(label)}

    def distinct_seen(self) -> int:
        seen = np.zeros(self.shape.universe, dtype=bool)
        for step in range(self.shape.steps):
            seen[self.items(step)] = True
        return int(seen.sum())


def dense_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(DIM + NUM_DENSE, 32), nn.ReLU(), nn.Linear(32, 1))


@torch.no_grad()
def held_out_auc(forward: Callable[[dict[str, torch.Tensor]], torch.Tensor],
                 stream: Stream) -> float:
    """AUC of `forward` over the stream's held-out steps (after its training steps)."""
    logits, labels = [], []
    first = stream.shape.steps
    for step in range(first, first + stream.shape.eval_steps):
        batch = stream.batch(step)
        logits.append(forward(batch))
        labels.append(batch["label"])
    return float(batch_roc_auc(torch.cat(logits), torch.cat(labels)))


def median_rate(samples: list[int], seconds: list[float]) -> float:
    """The median samples/s over the timed chunks."""
    return statistics.median(n / s for n, s in zip(samples, seconds, strict=True))


@dataclass
class Variant:
    """One table + dense model, trained by the training loop's steps (world size 1)."""

    name: str
    table: TableConfig
    ids_of: Callable[[dict[str, torch.Tensor]], torch.Tensor]
    prefetch: bool = False
    emb: ShardedEmbedding = field(init=False)
    seconds: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.emb = ShardedEmbedding([self.table], seed=0, init_std=0.05)
        self.source = LocalSparseOptimizer(self.emb, OptimizerSpec(kind="adam", lr=0.02))
        self.emb.set_pager(self.source)
        self.window = StalenessWindow(self.source, self.emb, 0)
        self.dense = dense_model(0)
        self.opt = torch.optim.Adam(self.dense.parameters(), lr=0.003)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        rows = self.emb.lookup(self.table.name, self.ids_of(batch))
        out: torch.Tensor = self.dense(torch.cat([rows, batch["dense"]], 1)).squeeze(1)
        return out

    def train(self, stream: Stream, steps: range) -> None:
        t0 = time.perf_counter()
        batch = stream.batch(steps[0])
        for step in steps:
            self.window.before_step(step)
            logits = self.forward(batch)
            # every variant makes the next batch here; within a chunk only, so that no
            # prefetch runs while another variant is timed
            following = stream.batch(step + 1) if step + 1 < steps.stop else None
            if following is not None and self.prefetch:
                self.emb.prefetch(step + 1, [self.table.name], [self.ids_of(following)])
            loss = nn.functional.binary_cross_entropy_with_logits(logits, batch["label"])
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            grads = self.emb.pop_grads()
            self.source.push(step, grads)
            if following is not None:
                batch = following
        self.window.catch_up(steps[-1])
        self.seconds.append(time.perf_counter() - t0)
        self.samples.append(len(steps) * stream.shape.batch)

    def auc(self, stream: Stream) -> float:
        return held_out_auc(self.forward, stream)

    @property
    def samples_per_s(self) -> float:
        return median_rate(self.samples, self.seconds)

    @property
    def device_bytes(self) -> int:
        w = self.emb.weights[self.table.name]
        return w.numel() * w.element_size()


class TorchRecVariant:
    """(c) TorchRec's ManagedCollisionCollection (an MCH module, LRU, eviction every step)
    remapping raw ids to `capacity` rows of an nn.Embedding trained by SparseAdam; an
    evicted row is reset (its row re-drawn, its Adam state zeroed), as TorchRec's managed
    collision embedding modules do: the evicted id's row is lost."""

    name = "torchrec"

    def __init__(self, capacity: int) -> None:
        from torchrec.modules.embedding_configs import EmbeddingConfig
        from torchrec.modules.mc_modules import (
            LRU_EvictionPolicy,
            ManagedCollisionCollection,
            MCHManagedCollisionModule,
        )

        self.capacity = capacity
        module = MCHManagedCollisionModule(
            zch_size=capacity, device=torch.device("cpu"), eviction_policy=LRU_EvictionPolicy(),
            eviction_interval=1)
        self.mcc = ManagedCollisionCollection({"t": module}, [EmbeddingConfig(
            name="t", embedding_dim=DIM, num_embeddings=capacity, feature_names=["f"])])
        torch.manual_seed(0)
        self.emb = nn.Embedding(capacity, DIM, sparse=True)
        with torch.no_grad():
            self.emb.weight.normal_(0.0, 0.05)
        self.sparse_opt = torch.optim.SparseAdam(self.emb.parameters(), lr=0.02)
        self.dense = dense_model(0)
        self.opt = torch.optim.Adam(self.dense.parameters(), lr=0.003)
        self.seconds: list[float] = []
        self.samples: list[int] = []

    def _slots(self, raw: torch.Tensor) -> torch.Tensor:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["f"], values=raw & (2**63 - 1),  # its input range is [0, 2^63 - 1)
            lengths=torch.ones(raw.numel(), dtype=torch.int64))
        return self.mcc(kjt)["f"].values()

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        rows = self.emb(self._slots(batch["raw"]))
        out: torch.Tensor = self.dense(torch.cat([rows, batch["dense"]], 1)).squeeze(1)
        return out

    def train(self, stream: Stream, steps: range) -> None:
        self.mcc.train()
        t0 = time.perf_counter()
        for step in steps:
            batch = stream.batch(step)
            loss = nn.functional.binary_cross_entropy_with_logits(self.forward(batch),
                                                                  batch["label"])
            self.opt.zero_grad()
            self.sparse_opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.sparse_opt.step()
            evicted = self.mcc.evict().get("t")
            if evicted is not None and evicted.numel():
                self._reset(evicted)
        self.seconds.append(time.perf_counter() - t0)
        self.samples.append(len(steps) * stream.shape.batch)

    @torch.no_grad()
    def _reset(self, slots: torch.Tensor) -> None:
        self.emb.weight[slots] = torch.randn(slots.numel(), DIM) * 0.05
        for state in self.sparse_opt.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key][slots] = 0.0

    def auc(self, stream: Stream) -> float:
        self.mcc.eval()
        return held_out_auc(self.forward, stream)

    @property
    def samples_per_s(self) -> float:
        return median_rate(self.samples, self.seconds)

    @property
    def device_bytes(self) -> int:
        return self.emb.weight.numel() * self.emb.weight.element_size()


def torchrec_variant(capacity: int) -> tuple[TorchRecVariant | None, str]:
    """(c) when torchrec imports and builds here; else (None, why not)."""
    try:
        return TorchRecVariant(capacity), "ran"
    except Exception as exc:  # any import or build failure: say why
        return None, f"not run: {type(exc).__name__}: {exc}"


def main() -> int:
    parser = bench_parser(__doc__, quick="the same shape, small (capacity 1/5 of the ids)")
    parser.add_argument("--no-torchrec", action="store_true",
                        help="skip (c), TorchRec's ManagedCollisionCollection")
    args = parser.parse_args()
    load_before = os.getloadavg()
    torch.set_num_threads(1)  # one thread for every variant: the same work compared
    shape = QUICK if args.quick else FULL
    stream = Stream(shape)
    seen = stream.distinct_seen()
    capacity = max(1, seen // shape.capacity_share)
    log(f"stream: {shape.steps} steps x {shape.batch} samples, {seen} distinct ids seen "
        f"(universe {shape.universe}); dynamic capacity {capacity}")
    variants: list[Any] = [
        Variant("dynamic", TableConfig("ids", capacity, DIM, DynamicSpec()),
                lambda b: b["raw"], prefetch=True),
        Variant("dynamic_inline", TableConfig("ids", capacity, DIM, DynamicSpec()),
                lambda b: b["raw"]),
        Variant("modulo", TableConfig("ids", capacity, DIM),
                lambda b: torch.remainder(b["raw"], capacity)),
        Variant("full", TableConfig("ids", shape.universe, DIM), lambda b: b["item"]),
    ]
    torchrec, torchrec_state = (None, "skipped (--no-torchrec)") if args.no_torchrec else (
        torchrec_variant(capacity))
    if torchrec is not None:
        variants.append(torchrec)
    log(f"torchrec: {torchrec_state}")
    bounds = np.linspace(0, shape.steps, shape.chunks + 1).astype(int)
    for c, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        for v in variants:  # interleaved: the machine's load hits every variant alike
            v.train(stream, range(int(lo), int(hi)))
        log(f"chunk {c + 1}/{shape.chunks}: " + "  ".join(
            f"{v.name} {v.samples[-1] / v.seconds[-1]:.0f}/s" for v in variants))
    auc = {v.name: v.auc(stream) for v in variants}
    by = {v.name: v for v in variants}
    dyn = by["dynamic"].emb.dynamic
    assert dyn is not None
    stats = dyn.stats()["ids"]
    result: dict[str, Any] = {
        "quick": args.quick, "distinct_ids_seen": seen, "capacity": capacity,
        "auc_dynamic": auc["dynamic"], "auc_modulo": auc["modulo"], "auc_full": auc["full"],
        "device_bytes_dynamic": by["dynamic"].device_bytes,
        "device_bytes_full": by["full"].device_bytes,
        "host_bytes_dynamic_map": stats["host_bytes"],
        "paged_rows_dynamic": stats["paged"],
        "samples_per_s_dynamic": by["dynamic"].samples_per_s,
        "samples_per_s_dynamic_inline": by["dynamic_inline"].samples_per_s,
        "auc_dynamic_inline": auc["dynamic_inline"],
        "samples_per_s_static_same_capacity": by["modulo"].samples_per_s,
        "samples_per_s_full": by["full"].samples_per_s,
        "dynamic_stats": stats, "torchrec": torchrec_state,
    }
    if torchrec is not None:
        result.update(auc_torchrec=auc["torchrec"], samples_per_s_torchrec=torchrec.samples_per_s,
                      device_bytes_torchrec=torchrec.device_bytes)
    result["goals"] = {
        "auc_within_0.005_of_full": auc["dynamic"] >= auc["full"] - 0.005,
        "auc_above_modulo": auc["dynamic"] > auc["modulo"],
        "throughput_at_least_0.8x_static": result["samples_per_s_dynamic"]
        >= 0.8 * result["samples_per_s_static_same_capacity"],
    }
    for k, v in result.items():
        if k not in ("dynamic_stats",):
            print(f"{k}: {v}")
    write_json(args.json, {**result, "machine": machine(load_before)}, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
