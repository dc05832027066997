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


def main() -> None:
    args = bench_parser(__doc__, quick="fills of 16K and 64K rows").parse_args()
    torch.set_num_threads(1)  # a server's update thread; no pool contention in a call
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
    write_json(args.json, {"benchmark": "page_cost", "results": results}, args)


if __name__ == "__main__":
    main()
