"""The cost of a dynamic table's Page call on the shard server against the store's fill,
under a memory budget (ps/core/paging.py): every call pages out CALL rows and the quota
drops as many of the rows seen longest ago.

    python bench/bench_page_cost.py            # fills of 64K, 256K and 1M paged rows
    python bench/bench_page_cost.py --quick    # 16K and 64K
    python bench/bench_page_cost.py --json out.json

Side by side in one process, interleaved call by call, the median over calls of:
- ordered: the server's store, which finds the rows to drop in O(rows dropped)
  (hybridps/paged_order.py);
- scan: the same store sorting every live row by (seen, id) for each drop (the rule
  before, and the worker's --local-optimizer store's still).
Both drop exactly the same ids (checked at each call). Goal: ordered's cost does not grow
with the fill (O(rows in the call)).

Then the memory a store really holds under a budget (--max-state-bytes 64 and 128 MiB,
one run of one rank: its whole share): 2.4M ids paged out 8,192 a call, most of them
dropped; reported: the table's quota, the bytes the drops are decided on (rows,
tombstones, the id map at its size), the bytes the store holds (pool capacity, id map,
drop order, tombstones: `dynamic_held_bytes` in the stats) and the process's resident
memory grown (VmRSS).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import bench_parser, child_env, log, write_json

from hybridps.optim import OptimizerSpec
from hybridps.paged_rows import PagedOut
from ps.core.paging import PageCall
from ps.core.partition import TableSpec, TableState
from ps.core.store import Store

CALL = 8192
DIM = 16


class Variant:
    """One store filled with `fill` paged rows; `call()` times one Page call."""

    def __init__(self, fill: int, ordered: bool) -> None:
        self.store = Store()
        self.store.register("bench", 0, 1, 0, [TableSpec("u", CALL, DIM, 0, CALL,
                                                         dynamic=True)],
                            OptimizerSpec(kind="adam", lr=0.01))
        part = self.store.partition("bench", 0)
        assert part is not None
        self.table: TableState = part.tables["u"]
        assert self.table.paging is not None
        self.table.paging.store.ordered = ordered
        self.seq = 0
        self.next_id = 0
        while len(self.table.paging.store) < fill:
            self.call()

    def call(self) -> tuple[float, np.ndarray]:
        self.seq += 1
        ids = torch.arange(self.next_id, self.next_id + CALL, dtype=torch.int64)
        self.next_id += CALL
        rng = np.random.default_rng(self.seq)
        seen = torch.from_numpy(self.seq - rng.integers(0, 64, size=CALL))
        page = PageCall(self.seq, self.seq, 0, PagedOut(
            ids, torch.randn(CALL, DIM), {}, seen, torch.ones(CALL, dtype=torch.int64)),
            torch.arange(CALL, dtype=torch.int64), torch.empty(0, dtype=torch.int64),
            torch.empty(0, dtype=torch.int64))
        if self.table.paged_quota:  # hold the fill: this call's rows go beyond it
            self.table.paged_quota = self.table.paged_bytes
        started = time.perf_counter()
        result = self.store.page("bench", 0, 0, "u", page)
        return time.perf_counter() - started, result.dropped

    def hold(self) -> None:
        self.table.paged_quota = self.table.paged_bytes


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def memory_under_budget(budget_mb: int, ids: int) -> dict[str, float]:
    store = Store(max_state_bytes=budget_mb * 2**20, run_shares=1)
    store.register("mem", 0, 1, 0, [TableSpec("u", CALL, DIM, 0, CALL, dynamic=True)],
                   OptimizerSpec(kind="adam", lr=0.01))
    part = store.partition("mem", 0)
    assert part is not None
    table = part.tables["u"]
    assert table.paging is not None
    base = _rss()
    for seq in range(1, ids // CALL + 1):
        out = torch.arange(seq * CALL, (seq + 1) * CALL, dtype=torch.int64)
        store.page("mem", 0, 0, "u", PageCall(seq, seq, 0, PagedOut(
            out, torch.randn(CALL, DIM), {}, torch.full((CALL,), seq, dtype=torch.int64),
            torch.ones(CALL, dtype=torch.int64)), torch.arange(CALL, dtype=torch.int64),
            torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)))
    paged = table.paging.store
    mib = 2**20
    row = {"budget_mib": budget_mb, "quota_mib": table.paged_quota / mib,
           "rows": len(paged), "dropped": paged.dropped,
           "counted_mib": table.paged_bytes / mib, "held_mib": paged.held_bytes / mib,
           "rss_growth_mib": (_rss() - base) / mib}
    log(f"budget {budget_mb} MiB: quota {row['quota_mib']:.1f}  counted "
        f"{row['counted_mib']:.1f}  held {row['held_mib']:.1f}  RSS grown "
        f"{row['rss_growth_mib']:.1f} MiB ({row['rss_growth_mib'] / budget_mb:.2f}x)  rows "
        f"{len(paged)}  dropped {paged.dropped}")
    return row


def main() -> None:
    parser = bench_parser(__doc__, quick="fills of 16K and 64K rows")
    parser.add_argument("--memory-mb", type=int, default=0,
                        help="only the memory part, at this budget (one process each)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a server's update thread; no pool contention in a call
    ids = 300_000 if args.quick else 2_400_000
    if args.memory_mb:
        print(json.dumps(memory_under_budget(args.memory_mb, ids)))
        return
    fills = [16_384, 65_536] if args.quick else [65_536, 262_144, 1_048_576]
    calls = 10 if args.quick else 20
    results = []
    for fill in fills:
        log(f"fill {fill}: building both stores")
        variants = {"ordered": Variant(fill, True), "scan": Variant(fill, False)}
        for v in variants.values():
            v.hold()
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(calls):
            dropped = {}
            for name, v in variants.items():
                seconds, dropped[name] = v.call()
                times[name].append(seconds)
            assert np.array_equal(dropped["ordered"], dropped["scan"])
        row = {"fill": fill, "call_rows": CALL,
               **{f"{name}_ms": 1e3 * statistics.median(t) for name, t in times.items()}}
        log(f"fill {fill}: ordered {row['ordered_ms']:.1f} ms  scan {row['scan_ms']:.1f} ms "
            "per call (median)")
        results.append(row)
    memory = []  # each budget in a fresh process: no memory freed by another reused
    for mb in [16] if args.quick else [64, 128]:
        child = subprocess.run([sys.executable, __file__, "--memory-mb", str(mb),
                                *(["--quick"] if args.quick else [])], env=child_env(),
                               capture_output=True, text=True, check=True)
        sys.stderr.write(child.stderr)
        memory.append(json.loads(child.stdout.strip().splitlines()[-1]))
    write_json(args.json, {"benchmark": "page_cost", "results": results,
                           "memory": memory}, args)


if __name__ == "__main__":
    main()
