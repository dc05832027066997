"""The owner's path for bags pooled at the owner: the torch ops against the fused native
kernel (hybridps/pooled_bags.py), thread CPU a step, on ids20-like inputs.

    python bench/bench_pooled_bags.py                 # ids20's owner, K=0 and K=1
    python bench/bench_pooled_bags.py --quick --json runs/bench/pooled_bags.json

One owner of `bench_vs_torchrec.py --jobs ids20` (one 1M x 64 table on 2 ranks, batch
1024 a rank, 20 ids a sample, bounded Zipf 1.1 scattered over the rows): its 500k-row
shard gets, every step, the ids of both requesters' 1024 bags that fall in its half.
What a step costs the owner, in one process and one torch thread:
  torch   OwnerPool.build (the dedupe; stage 2) + the gather, the weight prediction
          (K=1) and PoolAtOwner (stage 3) + its backward + the coalesce check of
          pop_grads;
  native  PoolUnitAtOwner (dedupe, gather with the prediction, bag sums: one call) + its
          backward (one call) + the same pop_grads check.
Both on the same batches, interleaved within each repeat (torch, native, torch, ...), so
the machine's drift falls on both alike; the figure is thread CPU (time.thread_time), not
wall time, median of the repeats. Results are checked bitwise equal while measuring.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import bench_parser, log, write_json

from hybridps import pooled_bags
from hybridps.pooled_bags import BagsAtOwner
from worker.embedding.input_dist import OwnerPool, PoolAtOwner, PoolUnitAtOwner
from worker.embedding.rows import coalesce_grads
from worker.tasks.synthetic import Scatter, zipf_ranks
from worker.updates.staleness import RowPrediction

TABLE_ROWS, DIM, BATCH, POOL, WORLD = 1_000_000, 64, 1024, 20, 2
OWNED = TABLE_ROWS // WORLD  # rank 0's rows: [0, OWNED)


def owner_batch(rng: np.random.Generator, scatter: Scatter) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_M, lengths_B): what rank 0 receives of both requesters' bags (requester order)."""
    ids, lengths = [], []
    for _ in range(WORLD):
        ids_BP = scatter(zipf_ranks(rng, TABLE_ROWS, BATCH * POOL)).reshape(BATCH, POOL)
        mine_BP = ids_BP < OWNED
        ids.append(ids_BP[mine_BP])  # row-major: bag order
        lengths.append(mine_BP.sum(axis=1))
    return (torch.from_numpy(np.concatenate(ids)).to(torch.int64),
            torch.from_numpy(np.concatenate(lengths)).to(torch.int64))


def prediction_for(ids_M: torch.Tensor, gen: torch.Generator) -> RowPrediction:
    """K=1: the rows of the previous step's push have a predicted update."""
    keys = torch.unique(ids_M)
    pred = RowPrediction()
    pred.tables = {"t0": (keys, torch.randn(keys.numel(), DIM, generator=gen) * 1e-3)}
    return pred


def step_torch(weight: torch.Tensor, ids_M: torch.Tensor, lengths_B: torch.Tensor,
               pred: RowPrediction | None, grad_BD: torch.Tensor) -> torch.Tensor:
    pool = OwnerPool.build(ids_M, lengths_B, OWNED)
    with torch.no_grad():
        rows_UD = weight.index_select(0, pool.uniq_U)
        if pred is not None:
            rows_UD = pred.add_to("t0", pool.uniq_U, rows_UD)
    out = PoolAtOwner.apply(weight, rows_UD, pool, pool.uniq_U)
    out.backward(grad_BD)
    return out.detach()


def step_native(weight: torch.Tensor, ids_M: torch.Tensor, lengths_B: torch.Tensor,
                pred: RowPrediction | None, grad_BD: torch.Tensor) -> torch.Tensor:
    entry = BagsAtOwner(ids_M, lengths_B, 0, OWNED)
    out = PoolUnitAtOwner.apply(weight, [entry], None if pred is None else pred.offsets_of("t0"))
    out.backward(grad_BD)
    return out.detach()


def pop_grad(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grad = weight.grad
    assert grad is not None
    [(ids_U, grads_UD)] = coalesce_grads([(grad._indices()[0], grad._values(), OWNED)])
    weight.grad = None
    return ids_U, grads_UD


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--steps", type=int, default=10, help="batches a repeat (each variant)")
    args = p.parse_args()
    repeats, steps = (5, 4) if args.quick else (args.repeats, args.steps)
    torch.set_num_threads(1)
    if pooled_bags.set_pool_kernel("auto") != "native":
        raise SystemExit("the pooled-bags kernel is not built: pip install -e . with a C compiler")
    rng = np.random.default_rng(0)
    gen = torch.Generator().manual_seed(0)
    scatter = Scatter(TABLE_ROWS, 0)
    weight = torch.nn.Parameter(torch.randn(OWNED, DIM, generator=gen))
    batches = [owner_batch(rng, scatter) for _ in range(steps + 1)]
    grads = [torch.randn(ln.numel(), DIM, generator=gen) for _, ln in batches]
    results: dict[str, dict[str, float]] = {}
    for k in (0, 1):
        preds = [None if k == 0 else prediction_for(batches[i][0], gen) for i in range(steps)]
        cpu: dict[str, list[float]] = {"torch": [], "native": []}
        seen: dict[int, tuple[torch.Tensor, ...]] = {}
        for _ in range(repeats):
            for name, fn in (("torch", step_torch), ("native", step_native)):
                pooled_bags.set_pool_kernel("native" if name == "native" else "torch")
                spent = 0
                for i in range(steps):
                    ids_M, lengths_B = batches[i + 1]
                    t0 = time.thread_time_ns()
                    out = fn(weight, ids_M, lengths_B, preds[i], grads[i + 1])
                    ids_U, grads_UD = pop_grad(weight)
                    spent += time.thread_time_ns() - t0
                    got = (out.view(torch.int32), ids_U, grads_UD.view(torch.int32))
                    ref = seen.setdefault(i, got)  # bitwise the other path (not timed)
                    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
                cpu[name].append(spent / steps / 1e6)
        med = {name: statistics.median(v) for name, v in cpu.items()}
        ids_M, lengths_B = batches[1]
        results[f"K{k}"] = {"torch_cpu_ms": med["torch"], "native_cpu_ms": med["native"],
                            "ratio": med["torch"] / med["native"],
                            "ids": ids_M.numel(), "distinct": torch.unique(ids_M).numel(),
                            "bags": lengths_B.numel()}
        log(f"K={k}: {ids_M.numel()} ids ({results[f'K{k}']['distinct']} distinct) in "
            f"{lengths_B.numel()} bags at the owner; thread CPU a step, median of {repeats}: "
            f"torch {med['torch']:.3f} ms, native {med['native']:.3f} ms "
            f"({med['torch'] / med['native']:.2f}x); repeats torch "
            f"{[round(x, 3) for x in cpu['torch']]}, native {[round(x, 3) for x in cpu['native']]}")
    pooled_bags.set_pool_kernel("auto")
    if args.json:
        write_json(args.json, {"benchmark": "pooled_bags", "repeats": repeats, "steps": steps,
                               "results": results})


if __name__ == "__main__":
    main()
