"""Sparse-Adam row-update throughput against the memory-bandwidth ceiling, in one process.

    python bench/bench_kernel.py                 # full run (~8 GiB RAM)
    python bench/bench_kernel.py --quick         # dim 64, 2 batch sizes, smaller table
    python bench/bench_kernel.py --json runs/bench_kernel.json

What is measured, for each dim (64, 128), batch of unique rows (4k, 16k, 64k) and
thread count (1, 2):
  (a) memory bandwidth, STREAM triad a = b + s*c on float32 arrays far larger than
      the last-level cache, best of several passes: torch.add(out=) and the native
      C triad (hybridps.native), at the same thread counts, at the start, between dims
      and at the end. The ceiling is the best of all of them: a conservative bar
      on a machine whose load varies.
  (b) torch.optim.SparseAdam.step() on an nn.Embedding(sparse=True) of the same size,
      given the same coalesced gradients (building the sparse gradient is not timed),
      on 4 KiB-page tables ("sparse_adam") and on huge-page ones ("sparse_adam_thp");
  (c) the torch reference kernel, hybridps.optim.apply_rows_torch_;
  (d) the native kernel through the public dispatch hybridps.optim.apply_rows_ with a
      reused output buffer (so the Python-side checks are included): "native" on
      state from torch.zeros (4 KiB pages: what a plain torch allocation gives), and
      "native_thp" on state from hybridps.optim.alloc_state (transparent huge pages, and
      m, v at different offsets past 2 MiB, so m[id] and v[id] never share an L1 set:
      the server's layout); "native_thp_checked" is native_thp with check_finite=True,
      what the server runs: the old m, v rows are stored in a per-thread snapshot as the
      kernel goes, so a non-finite result can be undone (hybridps/optim.py).
      Each "x SpAdam" ratio is against SparseAdam on the same kind of pages.
The table is a partition of --table-mib MiB per tensor (4M rows at dim 64, 2M at
dim 128), the same memory for every dim, warmed up once (see Buffers). Every call
takes the next batch of a random permutation of all rows (sorted within the batch,
as torch.unique/coalesce give them) and the next slice of a large gradient pool, so
the rows come from DRAM, not from a cache warmed by earlier calls.

Bytes moved per row (the same model for every implementation, so GB/s and the ratios
compare like with like): read m, v, grad and write m, v, delta = 24 * dim bytes. The
ceiling in rows/s is triad-bandwidth / (24 * dim). Kernel rates use the median call
time of the best of --rounds interleaved windows; the triad uses its best pass.
OPENBLAS_CORETYPE and the like do not matter: no BLAS is involved.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from harness import bench_parser, log, machine, write_json  # bench/ is sys.path[0]

import hybridps.optim as optim
from hybridps import native
from hybridps.optim import OptimizerSpec

BYTES_PER_ELEM = 24  # read m, v, grad; write m, v, delta (float32)
GOAL_FRACTION = 0.5
GOAL_VS_SPARSE_ADAM = 8.0
SPEC = OptimizerSpec("adam", lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)


@dataclass
class Result:
    dim: int
    batch: int
    impl: str  # sparse_adam | torch_ref | native, and *_thp on huge-page tables
    threads: int
    calls: int
    median_s: float
    best_s: float
    rows_per_s: float
    gb_per_s: float
    fraction_of_ceiling: float = math.nan
    vs_sparse_adam: float = math.nan
    window_medians_s: list[float] = field(default_factory=list)


# -- (a) bandwidth --------------------------------------------------------------------------

def triad_bandwidth(arrays: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                    threads: list[int], passes: int) -> dict[str, dict[int, float]]:
    """Best-of-`passes` STREAM triad GB/s (12 bytes per float32 element) per thread count."""
    a, b, c = arrays
    n = a.numel()
    out: dict[str, dict[int, float]] = {"torch": {}, "native": {}}
    ext = native.ext
    try:
        for nt in threads:
            torch.set_num_threads(nt)
            best = math.inf
            for _ in range(passes):
                t0 = time.perf_counter()
                torch.add(b, c, alpha=3.0, out=a)
                best = min(best, time.perf_counter() - t0)
            out["torch"][nt] = 12 * n / best / 1e9
            if ext is not None:
                best = math.inf
                for _ in range(passes):
                    t0 = time.perf_counter()
                    ext.triad(a.data_ptr(), b.data_ptr(), c.data_ptr(), n, 3.0, nt)
                    best = min(best, time.perf_counter() - t0)
                out["native"][nt] = 12 * n / best / 1e9
    finally:
        torch.set_num_threads(max(threads))
    return out


# -- (b)-(d) row updates ------------------------------------------------------------------

class Buffers:
    """The big tensors, allocated once and viewed as [rows, dim] for every dim.

    In a VM, memory the process touches for the first time is slow to allocate
    (host page faults) and random accesses to it stay slow for a while; reusing the
    same memory for every dim, after one warm-up, keeps that out of the numbers.
    """

    def __init__(self, table_bytes: int, pool_bytes: int, thp: bool) -> None:
        n, pool_n = table_bytes // 4, pool_bytes // 4
        # State as a plain torch allocation gives it (4 KiB pages unless
        # THP_MEM_ALLOC_ENABLE=1 or THP "always"): used by SparseAdam (its
        # exp_avg/exp_avg_sq), the torch reference and "native"...
        self.m = torch.zeros(n)
        self.v = torch.zeros(n)
        self.weight = torch.zeros(n).uniform_(-0.1, 0.1)  # the nn.Embedding table
        # ... and from hybridps.optim.alloc_state (transparent huge pages, and each table at
        # its offset past 2 MiB, as the server allocates them) for "native_thp" and
        # "sparse_adam_thp".
        self.m_thp = self._server_state(n, "m") if thp else None
        self.v_thp = self._server_state(n, "v") if thp else None
        self.weight_thp = (self._server_state(n, "master").uniform_(-0.1, 0.1) if thp
                           else None)
        self.pool = torch.empty(pool_n).uniform_(-0.01, 0.01)

    @staticmethod
    def _server_state(n: int, which: str) -> torch.Tensor:
        return optim.alloc_state(n, 1, offset=optim.STATE_OFFSETS[which]).view(-1)

    def tables(self) -> list[torch.Tensor]:
        return [t for t in (self.m, self.v, self.weight, self.m_thp, self.v_thp,
                            self.weight_thp) if t is not None]


class Workload:
    """[rows, dim] views of the buffers, unique-row batches and gradient slices."""

    def __init__(self, bufs: Buffers, dim: int, seed: int = 0) -> None:
        rows = bufs.m.numel() // dim
        self.rows, self.dim = rows, dim

        def view(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[: rows * dim].view(rows, dim)

        self.m, self.v, self.weight = view(bufs.m), view(bufs.v), view(bufs.weight)
        self.m_thp, self.v_thp = view(bufs.m_thp), view(bufs.v_thp)
        self.weight_thp = view(bufs.weight_thp)
        self.pool = bufs.pool[: bufs.pool.numel() // dim * dim].view(-1, dim)
        self.perm = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
        self.cursor = 0  # shared by every measurement: never revisit rows while warm
        self.gcursor = 0

    def batches(self, batch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            if self.cursor + batch > self.rows:
                self.cursor = 0
            ids = self.perm[self.cursor:self.cursor + batch].sort().values
            self.cursor += batch
            if self.gcursor + batch > self.pool.shape[0]:
                self.gcursor = 0
            grads = self.pool[self.gcursor:self.gcursor + batch]
            self.gcursor += batch
            yield ids, grads


def warm_up(bufs: Buffers, max_seconds: float, threads: int) -> dict[str, float]:
    """Untimed random-row updates on each table until its rate stops rising.

    Per table: 0.25 s windows, stopping once two windows in a row are within 15% of
    the best so far (after at least 1 s), or after `max_seconds`. Returns the
    seconds spent per table. Why: tables on fresh huge pages can run far slower for their
    first seconds of random access than later (docs/performance-log.md).
    """
    work = Workload(bufs, 64, seed=1)
    stream = work.batches(4096)
    delta = torch.zeros(4096, 64)
    step = 0
    spent: dict[str, float] = {}
    for name, m, v in (("state", work.m, work.v), ("state_thp", work.m_thp, work.v_thp),
                       ("weight", work.weight, None), ("weight_thp", work.weight_thp, None)):
        if m is None:
            continue
        t0 = time.perf_counter()
        best, steady = 0.0, 0
        while time.perf_counter() - t0 < max_seconds and steady < 2:
            w0, calls = time.perf_counter(), 0
            while time.perf_counter() - w0 < 0.25:
                ids, grads = next(stream)
                step += 1
                calls += 1
                if v is None:
                    optim.apply_update_(m, ids, delta, 1.0, num_threads=threads)
                else:
                    optim.apply_rows_(SPEC, m, v, ids, grads, step, num_threads=threads)
            rate = calls / (time.perf_counter() - w0)
            steady = steady + 1 if rate >= 0.85 * best and time.perf_counter() - t0 > 1 else 0
            best = max(best, rate)
        spent[name] = time.perf_counter() - t0
    bufs.m.zero_()
    bufs.v.zero_()
    if bufs.m_thp is not None and bufs.v_thp is not None:
        bufs.m_thp.zero_()
        bufs.v_thp.zero_()
    return spent


def measure(step_fn: Callable[[torch.Tensor, torch.Tensor], None],
            batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
            seconds: float, min_calls: int,
            prepare: Callable[[torch.Tensor, torch.Tensor], Any] | None = None
            ) -> tuple[int, float, float]:
    """Calls step_fn on fresh batches for ~`seconds`; returns (calls, median, best)."""
    ids, grads = next(batches)  # warm-up: thread pool, allocator, code paths
    if prepare is not None:
        prepare(ids, grads)
    step_fn(ids, grads)
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < min_calls or time.perf_counter() < deadline:
        ids, grads = next(batches)
        if prepare is not None:
            prepare(ids, grads)
        t0 = time.perf_counter()
        step_fn(ids, grads)
        times.append(time.perf_counter() - t0)
    times.sort()
    return len(times), times[len(times) // 2], times[0]


def run_dim(bufs: Buffers, dim: int, batches: list[int], threads: list[int], seconds: float,
            rounds: int, min_calls: int) -> list[Result]:
    work = Workload(bufs, dim)
    rows = work.rows
    assert work.m is not None and work.v is not None and work.weight is not None
    m, v = work.m, work.v
    def sparse_adam_on(weight: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor
                       ) -> tuple[torch.nn.Embedding, torch.optim.SparseAdam]:
        emb = torch.nn.Embedding(rows, dim, sparse=True, _weight=weight)
        opt = torch.optim.SparseAdam(emb.parameters(), lr=SPEC.lr,
                                     betas=(SPEC.beta1, SPEC.beta2), eps=SPEC.eps)
        # Its state lives in our buffers (it would zeros_like() fresh memory).
        opt.state[emb.weight] = {"step": 0, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        return emb, opt

    emb, sparse_adam = sparse_adam_on(work.weight, m, v)
    thp = (sparse_adam_on(work.weight_thp, work.m_thp, work.v_thp)
           if work.weight_thp is not None and work.m_thp is not None
           and work.v_thp is not None else None)
    log(f"dim {dim}: table {rows} rows x {dim} ({m.numel() * 4 >> 20} MiB per tensor)")
    step = 0
    results: list[Result] = []

    def sparse_grad(ids: torch.Tensor, grads: torch.Tensor) -> None:
        grad = torch.sparse_coo_tensor(ids.unsqueeze(0), grads, (rows, dim),
                                       is_coalesced=True)
        emb.weight.grad = grad
        if thp is not None:
            thp[0].weight.grad = grad

    def run_sparse_adam(ids: torch.Tensor, grads: torch.Tensor) -> None:
        sparse_adam.step()

    def run_sparse_adam_thp(ids: torch.Tensor, grads: torch.Tensor) -> None:
        assert thp is not None
        thp[1].step()

    def run_torch_ref(ids: torch.Tensor, grads: torch.Tensor) -> None:
        nonlocal step
        step += 1
        optim.apply_rows_torch_(SPEC, m, v, ids, grads, step)

    out = torch.empty(max(batches), dim)
    for batch in batches:
        stream = work.batches(batch)
        windows: dict[tuple[str, int], list[tuple[int, float, float]]] = {}
        # Rounds of short windows, interleaving implementations and thread counts, so
        # a burst of load from other processes does not hit a single configuration;
        # each configuration keeps its best window.
        for _ in range(rounds):
            for nt in threads:
                def run_native(ids: torch.Tensor, grads: torch.Tensor, nt: int = nt) -> None:
                    nonlocal step
                    step += 1
                    optim.apply_rows_(SPEC, m, v, ids, grads, step, out=out, num_threads=nt)

                def run_native_thp(ids: torch.Tensor, grads: torch.Tensor, nt: int = nt
                                   ) -> None:
                    nonlocal step
                    step += 1
                    optim.apply_rows_(SPEC, work.m_thp, work.v_thp, ids, grads, step,
                                      out=out, num_threads=nt)

                def run_checked_thp(ids: torch.Tensor, grads: torch.Tensor, nt: int = nt
                                    ) -> None:
                    nonlocal step
                    step += 1
                    optim.apply_rows_(SPEC, work.m_thp, work.v_thp, ids, grads, step,
                                      out=out, num_threads=nt, check_finite=True)

                impls: list[tuple[str, Callable[[torch.Tensor, torch.Tensor], None],
                                  Callable[[torch.Tensor, torch.Tensor], Any] | None]] = [
                    ("sparse_adam", run_sparse_adam, sparse_grad),
                    ("torch_ref", run_torch_ref, None),
                ]
                if optim.kernel_name() == "native":
                    impls.append(("native", run_native, None))
                if thp is not None:
                    impls.append(("sparse_adam_thp", run_sparse_adam_thp, sparse_grad))
                    if optim.kernel_name() == "native":
                        impls.append(("native_thp", run_native_thp, None))
                        impls.append(("native_thp_checked", run_checked_thp, None))
                torch.set_num_threads(nt)
                for name, fn, prepare in impls:
                    windows.setdefault((name, nt), []).append(
                        measure(fn, stream, seconds / rounds, min_calls, prepare))
        for (name, nt), wins in windows.items():
            calls = sum(w[0] for w in wins)
            med = min(w[1] for w in wins)
            best = min(w[2] for w in wins)
            rps = batch / med
            results.append(Result(dim, batch, name, nt, calls, med, best, rps,
                                  rps * BYTES_PER_ELEM * dim / 1e9,
                                  window_medians_s=[w[1] for w in wins]))
            log(f"  dim {dim} batch {batch:6d} {name:15s} threads {nt}: "
                f"{rps / 1e6:7.2f} M rows/s ({calls} calls, window medians "
                + ", ".join(f"{batch / w[1] / 1e6:.2f}" for w in wins) + ")")
    torch.set_num_threads(max(threads))
    emb.weight.grad = None
    if thp is not None:
        thp[0].weight.grad = None
    return results


# -- report ---------------------------------------------------------------------------------

def finish(results: list[Result], ceiling: dict[int, float]) -> None:
    # Ratios against SparseAdam on the same kind of pages (4 KiB or huge).
    base = {(r.dim, r.batch, r.threads, "_thp" in r.impl): r.rows_per_s
            for r in results if r.impl.startswith("sparse_adam")}
    for r in results:
        r.fraction_of_ceiling = r.gb_per_s / ceiling[r.threads]
        sa = base.get((r.dim, r.batch, r.threads, "_thp" in r.impl))
        r.vs_sparse_adam = r.rows_per_s / sa if sa else math.nan


def table(results: list[Result], ceiling: dict[int, float]) -> str:
    head = (f"{'dim':>4} {'batch':>6} {'impl':<15} {'thr':>3} {'Mrows/s':>8} {'GB/s':>6} "
            f"{'ceil Mrows/s':>12} {'of ceil':>7} {'x SpAdam':>8} {'goal':>5}")
    lines = [head, "-" * len(head)]
    for r in results:
        ceil_rows = ceiling[r.threads] * 1e9 / (BYTES_PER_ELEM * r.dim)
        goal = ""
        if r.impl.startswith("native"):
            ok = (r.fraction_of_ceiling >= GOAL_FRACTION
                  and r.vs_sparse_adam >= GOAL_VS_SPARSE_ADAM)
            goal = "ok" if ok else "MISS"
        lines.append(
            f"{r.dim:>4} {r.batch:>6} {r.impl:<15} {r.threads:>3} {r.rows_per_s / 1e6:>8.2f} "
            f"{r.gb_per_s:>6.1f} {ceil_rows / 1e6:>12.2f} {r.fraction_of_ceiling:>7.0%} "
            f"{r.vs_sparse_adam:>8.1f} {goal:>5}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, quick="dim 64, batches 4k and 64k, 512 MiB table, shorter "
                     "timings")
    p.add_argument("--dims", default="64,128")
    p.add_argument("--batches", default="4096,16384,65536")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--table-mib", type=int, default=1024,
                   help="MiB per table tensor (m, v, weight): 4M rows at dim 64, 2M at 128; "
                        "keep it well above the last-level cache")
    p.add_argument("--pool-mib", type=int, default=256, help="MiB of gradient pool")
    p.add_argument("--warmup-s", type=float, default=5.0,
                   help="at most this many seconds of untimed random-row updates per table "
                        "after allocation (stops earlier once the rate is steady)")
    p.add_argument("--seconds", type=float, default=0.45,
                   help="per configuration, split over --rounds windows")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--triad-mib", type=int, default=256, help="MiB per triad array")
    p.add_argument("--no-thp", action="store_true",
                   help="skip the *_thp rows (tables from hybridps.optim.alloc_state, huge pages)")
    args = p.parse_args(argv)
    if args.quick:
        args.dims, args.batches = "64", "4096,65536"
        args.table_mib, args.pool_mib, args.triad_mib = 512, 128, 256
        args.seconds, args.warmup_s = 0.3, 3.0
    dims = [int(x) for x in args.dims.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    threads = [int(x) for x in args.threads.split(",")]
    started = time.perf_counter()
    load_before = os.getloadavg()
    info = optim.kernel_info()
    log(f"kernel: {info}")
    if info["kernel"] != "native":
        log("native kernel not in use: measuring SparseAdam and the torch path only")

    t0 = time.perf_counter()
    n = args.triad_mib * 2**20 // 4
    triad_arrays = (torch.zeros(n), torch.rand(n), torch.rand(n))
    bufs = Buffers(args.table_mib << 20, args.pool_mib << 20, thp=not args.no_thp)
    warmed = warm_up(bufs, args.warmup_s, max(threads))
    log(f"setup {time.perf_counter() - t0:.1f}s (warm-up s per table: "
        + ", ".join(f"{k} {x:.1f}" for k, x in warmed.items()) + ")")
    bandwidth = {"start": triad_bandwidth(triad_arrays, threads, passes=5)}
    log(f"triad GB/s at start: {bandwidth['start']}")
    results: list[Result] = []
    for i, dim in enumerate(dims):
        results += run_dim(bufs, dim, batches, threads, args.seconds, args.rounds,
                           min_calls=2)
        label = "end" if i == len(dims) - 1 else f"after dim {dim}"
        bandwidth[label] = triad_bandwidth(triad_arrays, threads, passes=5)
        log(f"triad GB/s {label}: {bandwidth[label]}")
    ceiling = {nt: max(bw[impl].get(nt, 0.0) for bw in bandwidth.values()
                       for impl in ("torch", "native")) for nt in threads}
    finish(results, ceiling)

    print("memory bandwidth ceiling (STREAM triad, best over the run, torch/native), GB/s: "
          + ", ".join(f"{nt} thread{'s' if nt > 1 else ''}: {ceiling[nt]:.1f}"
                      for nt in threads))
    for label, bw in bandwidth.items():
        print(f"  triad {label}: " + "; ".join(
            f"{impl} " + ", ".join(f"{nt}t {g:.1f}" for nt, g in sorted(v.items()))
            for impl, v in bw.items() if v))
    print(f"bytes per row: {BYTES_PER_ELEM} x dim (read m, v, grad; write m, v, delta)")
    print(table(results, ceiling))
    met = {impl: all(r.fraction_of_ceiling >= GOAL_FRACTION
                     and r.vs_sparse_adam >= GOAL_VS_SPARSE_ADAM
                     for r in results if r.impl == impl)
           for impl in ("native", "native_thp") if any(r.impl == impl for r in results)}
    load_after = os.getloadavg()
    elapsed = time.perf_counter() - started
    verdict = ", ".join(f"{impl}: {'met' if ok else 'NOT met'}" for impl, ok in met.items())
    print(f"goal (>= {GOAL_FRACTION:.0%} of ceiling and >= {GOAL_VS_SPARSE_ADAM:g}x SparseAdam "
          f"in every config): {verdict or 'no native kernel'}; "
          f"load average {load_before[0]:.2f} -> {load_after[0]:.2f}; {elapsed:.0f}s")
    write_json(args.json, {
        "kernel": info,
        "bandwidth_gbps": {**bandwidth, "ceiling": ceiling},
        "bytes_per_row": f"{BYTES_PER_ELEM} * dim",
        "goal": {"fraction_of_ceiling": GOAL_FRACTION,
                 "vs_sparse_adam": GOAL_VS_SPARSE_ADAM, "met": met},
        "results": [asdict(r) for r in results],
        "machine": machine(load_before,
                           THP_MEM_ALLOC_ENABLE=os.environ.get("THP_MEM_ALLOC_ENABLE")),
        "elapsed_s": elapsed,
    }, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
