"""KvsAll / 1vsAll scoring speed: the fused block losses against a plain matmul of the same shape.

A rank scores the Q query vectors of the global batch against the E entity rows it owns, in
forward (S = q @ block^T) and backward (grad q = G @ block, grad block = G^T @ q): three
matmuls of 2 * Q * E * D flops each. This prints the achieved GFLOP/s of the whole loss's
forward + backward (worker/tasks/kge/scoring.py) and of the three bare matmuls, and their ratio;
plus the pre-fusion formulation (a dense multi-hot target and F.binary_cross_entropy_with_logits
through autograd) for comparison.

    python bench/bench_kge_scoring.py                       # FB15k-237 shard shapes, 1 thread
    python bench/bench_kge_scoring.py --queries 1024 --entities 7271 --dim 256 --threads 1

Medians of --repeats timed runs each, interleaved (A B C A B C ...).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from worker.tasks.kge.scoring import block_loss


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--queries", type=int, default=1024, help="global batch of queries (Q)")
    ap.add_argument("--entities", type=int, default=7271,
                    help="rows one rank owns (E): FB15k-237 over 2 ranks by default")
    ap.add_argument("--dims", default="128,256")
    ap.add_argument("--positives", type=int, default=2, help="known tails per query (KvsAll)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    q_n, e_n = args.queries, args.entities
    print(f"Q={q_n} queries x E={e_n} owned rows, {args.threads} thread(s), median of "
          f"{args.repeats}")
    print("| dim | variant | ms fwd+bwd | GFLOP/s | vs matmul |")
    print("|---|---|---|---|---|")
    for dim in (int(d) for d in args.dims.split(",")):
        bench_dim(dim, args)


def bench_dim(dim: int, args: argparse.Namespace) -> None:
    q_n, e_n = args.queries, args.entities
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(q_n, dim, generator=g) * 0.1).requires_grad_()
    bias = torch.zeros(q_n, requires_grad=True)
    block = (torch.randn(e_n, dim, generator=g) * 0.1).requires_grad_()
    rows = torch.arange(q_n).repeat_interleave(args.positives)
    cols = torch.randint(0, e_n, (q_n * args.positives,), generator=g)
    grad_s = torch.randn(q_n, e_n, generator=g)
    flops = 3 * 2 * q_n * e_n * dim

    def matmuls() -> None:
        with torch.no_grad():
            s = q @ block.t()
            _ = grad_s @ block
            _ = grad_s.t() @ q
            del s

    def fused(kind: str) -> Callable[[], None]:
        def run() -> None:
            loss = block_loss(kind, q, bias, block, rows, cols, scale=1.0 / q_n,
                              num_entities=e_n)
            loss.backward()
            q.grad = bias.grad = block.grad = None
        return run

    def unfused() -> None:
        target = torch.zeros(q_n, e_n)
        target[rows, cols] = 1.0
        s = q @ block.t() + bias[:, None]
        F.binary_cross_entropy_with_logits(s, target).backward()
        q.grad = bias.grad = block.grad = None

    variants = {"3 x torch.matmul": matmuls, "fused bce (KvsAll)": fused("bce"),
                "fused ce (1vsAll)": fused("ce"), "autograd bce, dense target": unfused}
    for fn in variants.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.repeats):
        for name, fn in variants.items():
            times[name].append(_time(fn))
    base = statistics.median(times["3 x torch.matmul"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {dim} | {name} | {med * 1e3:.1f} | {flops / med / 1e9:.1f} | "
              f"{base / med:.2f} |")


if __name__ == "__main__":
    main()
