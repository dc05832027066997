"""The shard server's disk tier against the same partition held in memory (ps/core/spill.py,
hybridps/spilled_rows.py): pushes through the store, Adam, a table whose state is 4x the
partition's memory share.

    python bench/bench_spill_columns.py            # 100k x 32 rows, 30 pushes, 3 repeats
    python bench/bench_spill_columns.py --quick    # 1 repeat
    python bench/bench_spill_columns.py --json out.json

Each run: a store (in memory, or spilling beyond a quarter of the state), every row's
state written first (a restore: the whole state exists, 3/4 of it on disk), WARMUP pushes
untimed, then PUSHES timed pushes of the unique ids of up to 2,048 draws; Zipf(1.1) ids
spread over the table by a fixed permutation (hot rows on every page), and uniform ids
(the worst case); "zipf-fresh": the Zipf ids on a table whose state was never written (a
run from its start, no restore: a miss on a row never written reads nothing). The
variants run interleaved within each repeat; reported: the median of the repeats of the
timed pushes' wall time, samples/s (draws a second), the ratio to memory, and the
spilled tier's hit rate (accesses found in memory) and disk traffic. The final states
are checked bitwise equal.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import bench_parser, log, write_json

from hybridps.optim import OptimizerSpec
from ps.core.partition import PushChunk, TableSpec
from ps.core.spill import SpillTier
from ps.core.store import Store

RUN = "bench-spill"
ROWS, DIM = 100_000, 32
DRAWS = 2048
PUSHES, WARMUP = 30, 60
ZIPF_A = 1.1


def pushes(kind: str, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(sorted unique ids, grads) of WARMUP + PUSHES pushes of DRAWS draws each."""
    rng = np.random.default_rng(seed)
    spread = rng.permutation(ROWS)
    out = []
    for _ in range(WARMUP + PUSHES):
        if kind == "zipf":
            draws = rng.zipf(ZIPF_A, DRAWS * 2)
            draws = draws[draws <= ROWS][:DRAWS] - 1
            ids = np.unique(spread[draws])
        else:
            ids = np.unique(rng.integers(0, ROWS, DRAWS))
        grads = rng.standard_normal((ids.size, DIM)).astype(np.float32)
        out.append((torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(grads)))
    return out


def initial_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"m": torch.randn(ROWS, DIM, generator=g) * 0.01,
            "v": torch.rand(ROWS, DIM, generator=g) * 0.01}


def run_once(spill: bool, batches: list[tuple[torch.Tensor, torch.Tensor]],
             init: dict[str, torch.Tensor] | None, tmp: Path) -> dict[str, Any]:
    state_bytes = ROWS * DIM * 2 * 4
    tier = SpillTier(tmp / "spill") if spill else None
    store = Store(max_state_bytes=state_bytes // 4 + ROWS if spill else 0, run_shares=1,
                  spill=tier)
    store.register(RUN, 0, 1, 0, [TableSpec("emb", ROWS, DIM, 0, ROWS)],
                   OptimizerSpec(kind="adam", lr=0.01))
    part = store.partition(RUN, 0)
    assert part is not None
    table = part.tables["emb"]
    if init is not None:
        table.columns.write(0, init)
    session = store.open_session()
    for step, (ids, grads) in enumerate(batches[:WARMUP]):
        session.feed(PushChunk(RUN, 0, 0, step, "emb", ids, grads, 0, 1))
    before = dict(table.columns.counters())
    t0 = time.perf_counter()
    for step, (ids, grads) in enumerate(batches[WARMUP:], start=WARMUP):
        session.feed(PushChunk(RUN, 0, 0, step, "emb", ids, grads, 0, 1))
    wall = time.perf_counter() - t0
    after = table.columns.counters()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    final = {n: t.clone() for n, t in table.columns.read(0, ROWS).items()}
    out: dict[str, Any] = {"wall_s": wall, "state": final, "counters": delta,
                           "memory_bytes": table.columns.memory_bytes,
                           "disk_bytes": table.columns.disk_bytes}
    holder: Any = table.columns
    page_file = getattr(holder, "file", None)
    if page_file is not None:
        out["read_mb"] = page_file.bytes_read / 1e6
        out["written_mb"] = page_file.bytes_written / 1e6
    store.drop_run(RUN, "bench")
    if tier is not None:
        tier.close()
    return out


def main() -> None:
    args = bench_parser(__doc__, quick="one repeat").parse_args()
    torch.set_num_threads(1)  # as a server's partition thread (ps/core/shard_core.py)
    repeats = 1 if args.quick else 3
    init = initial_state(0)
    results: dict[str, Any] = {}
    for kind in ("zipf", "uniform", "zipf-fresh"):
        batches = pushes(kind.removesuffix("-fresh"), 1)
        start = None if kind.endswith("-fresh") else init
        draws = DRAWS * PUSHES
        walls: dict[str, list[float]] = {"memory": [], "spilled": []}
        last: dict[str, dict[str, Any]] = {}
        for _ in range(repeats):
            for variant in ("memory", "spilled"):
                with tempfile.TemporaryDirectory() as tmp:
                    got = run_once(variant == "spilled", batches, start, Path(tmp))
                walls[variant].append(got["wall_s"])
                last[variant] = got
        for name in last["memory"]["state"]:
            assert torch.equal(last["memory"]["state"][name], last["spilled"]["state"][name]), (
                f"{kind}: column {name} differs between memory and spilled")
        c = last["spilled"]["counters"]
        accesses = c.get("hits", 0) + c.get("misses", 0)
        mem, spl = statistics.median(walls["memory"]), statistics.median(walls["spilled"])
        row = {"memory_s": mem, "spilled_s": spl,
               "memory_samples_s": draws / mem, "spilled_samples_s": draws / spl,
               "ratio": mem / spl, "hit_rate": c.get("hits", 0) / max(accesses, 1),
               "fills": c.get("fills", 0), "spills": c.get("spills", 0),
               "spilled_memory_mb": last["spilled"]["memory_bytes"] / 1e6,
               "spilled_disk_mb": last["spilled"]["disk_bytes"] / 1e6,
               "read_mb": last["spilled"].get("read_mb", 0.0),
               "written_mb": last["spilled"].get("written_mb", 0.0),
               "walls": walls}
        results[kind] = row
        log(f"{kind:10s} memory {mem * 1e3:8.1f} ms ({draws / mem:9.0f} samples/s)  spilled "
            f"{spl * 1e3:8.1f} ms ({draws / spl:9.0f} samples/s)  ratio {mem / spl:.2f}  "
            f"hit rate {row['hit_rate']:.3f}  fills {row['fills']} spills {row['spills']}  "
            f"read {row['read_mb']:.1f} MB written {row['written_mb']:.1f} MB (whole run)  "
            f"memory {row['spilled_memory_mb']:.1f} MB disk {row['spilled_disk_mb']:.1f} MB")
    write_json(args.json, results, args)


if __name__ == "__main__":
    main()
