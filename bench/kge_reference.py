"""Single-process KvsAll reference trainer (full nn.Embedding entity table, no parameter server).

Same setting as dicee's defaults used for the figures in hybridps/data/README.md: KvsAll over
the distinct (h, r) pairs of train + reciprocal triples, BCE-with-logits against multi-hot tails,
Adam (lr 0.1) over all parameters, N(0, 1) init, no dropout/normalisation. Evaluation is
filtered (train + valid + test), both directions via reciprocal relations, computed block-wise
with worker.tasks.metrics exactly like the sharded trainer will (``--eval-blocks`` entity blocks).

    python bench/kge_reference.py --data umls --model distmult --dim 32
    python bench/kge_reference.py --data umls --model keci --dim 32 --p 0 --q 1
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import numpy as np
import torch

from worker.embedding.rows import init_rows
from worker.tasks.kge.data import TailIndex, epoch_batches, eval_queries, load_kg_dataset
from worker.tasks.kge.models import KGEScorer, build_model, init_entity_rows
from worker.tasks.metrics import block_rank_counts, ranking_metrics, ranks_from_counts


@torch.no_grad()
def evaluate(
    model: KGEScorer,
    ent: torch.Tensor,
    triples: np.ndarray,
    num_relations: int,
    filt: TailIndex,
    blocks: int,
    batch_size: int = 1024,
) -> dict[str, float]:
    queries = eval_queries(triples, num_relations)
    bounds = np.linspace(0, ent.shape[0], blocks + 1).astype(int).tolist()
    ranges = list(itertools.pairwise(bounds))
    ranks = []
    for s in range(0, len(queries), batch_size):
        qb = queries[s : s + batch_size]
        h, r, t = (torch.from_numpy(qb[:, i]) for i in range(3))
        q, bias = model.query(ent[h], r)
        per_block = [model.score_query(q, bias, ent[a:b]) for a, b in ranges]
        # the true score comes from the block (rank) that owns the true entity
        true = torch.empty(len(qb))
        for (a, b), sc in zip(ranges, per_block, strict=True):
            inside = (t >= a) & (t < b)
            true[inside] = sc[inside, t[inside] - a]
        greater = torch.zeros(len(qb), dtype=torch.long)
        equal = torch.zeros(len(qb), dtype=torch.long)
        for (a, b), sc in zip(ranges, per_block, strict=True):
            mask = torch.from_numpy(filt.block_mask(qb[:, 0], qb[:, 1], int(a), int(b)))
            g, e = block_rank_counts(sc, true, block_start=int(a), true_ids=t, filter_mask=mask)
            greater += g
            equal += e
        ranks.append(ranks_from_counts(greater, equal))
    return ranking_metrics(torch.cat(ranks))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="umls",
                    help="dataset directory, or a set shipped in hybridps/data (umls, kinship)")
    ap.add_argument("--model", default="distmult")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--p", type=int, default=0)
    ap.add_argument("--q", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-blocks", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--entity-init", choices=("torch", "hybridps"), default="torch",
                    help="torch: N(0,1) from the global stream (dicee); hybridps: the sharded "
                         "table's rows (worker.embedding.sharded.init_rows), so a seed gives both "
                         "trainers the same start (a paired comparison)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    ds = load_kg_dataset(args.data)
    kvs, filt = ds.kvsall_index(), ds.filter_index()
    pairs = torch.from_numpy(kvs.pairs())
    kw = {"p": args.p, "q": args.q} if args.model.lower() == "keci" else {}
    model = build_model(args.model, 2 * ds.num_relations, args.dim, **kw)
    if args.entity_init == "hybridps":
        rows = init_rows(ds.num_entities, args.dim, 0, ds.num_entities, seed=args.seed,
                         table_index=0, init_std=1.0)
    else:
        rows = init_entity_rows(ds.num_entities, args.dim)
    ent = torch.nn.Parameter(rows)
    opt = torch.optim.Adam([ent, *model.parameters()], lr=args.lr)
    loss_fn = torch.nn.BCEWithLogitsLoss()

    t0 = time.perf_counter()
    loss = torch.tensor(0.0)
    for epoch in range(args.epochs):
        for idx in epoch_batches(len(kvs), args.batch_size, seed=args.seed, epoch=epoch):
            h, r = pairs[idx, 0], pairs[idx, 1]
            target = torch.from_numpy(kvs.block_mask_by_pair(idx)).float()
            loss = loss_fn(model.score_against(ent[h], r, ent), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    train_s = time.perf_counter() - t0

    model.eval()
    t1 = time.perf_counter()
    res = {
        split: evaluate(
            model, ent.detach(), ds.split(split), ds.num_relations, filt, args.eval_blocks
        )
        for split in ("valid", "test")
    }
    out = {
        "data": args.data,
        "model": args.model,
        "dim": args.dim,
        "epochs": args.epochs,
        "threads": args.threads,
        "final_loss": float(loss.detach()),
        "train_seconds": round(train_s, 2),
        "eval_seconds": round(time.perf_counter() - t1, 2),
        **{f"{s}_{k}": round(v, 4) for s, m in res.items() for k, v in m.items()},
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
