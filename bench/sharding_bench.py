"""--sharding auto against row_wise on the dlrm job, side by side.

    python bench/sharding_bench.py [--quick] [--repeats 3] [--json PATH]

The dlrm job of bench/bench_vs_torchrec.py (26 tables from 3 to 1,000,000 rows x 16, three
multi-hot, batch 1024 a rank) on 2 gloo ranks against one shard server, Adam, staleness 1,
trained once per repeat with each --sharding, the variants interleaved (row_wise, auto,
row_wise, auto, ...) so that the machine's load hits both alike; each variant's figure is
the median over its repeats of the run's own samples/s (results.json, after warm-up), and
of its forward / a2a / push step times. `auto` places the 24 small tables whole (each on
one rank, balanced) and the two largest row-wise (worker/embedding/sharding.py
place_tables): a table whole on a rank is gathered, pushed and updated there alone.

TorchRec is not compared here (bench/bench_vs_torchrec.py does that where it is
installed; it is not in this project's environment).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness import REPO, Server, bench_parser, log, machine, run_worker, write_json

if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from bench_vs_torchrec import DLRM_TABLES  # the same job

VARIANTS = ("row_wise", "auto")
STEPS, QUICK_STEPS = 150, 40
STEP_PARTS = ("forward", "a2a", "backward", "push", "apply")


def job(steps: int) -> list[str]:
    return ["--task", "tables", "--tables", DLRM_TABLES, "--dim", "16", "--batch-size", "1024",
            "--steps", str(steps), "--staleness", "1", "--log-every", str(steps),
            "--eval-batches", "1"]


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "samples_per_s": statistics.median(r["samples_per_s"] for r in runs),
        "samples_per_s_all": [round(r["samples_per_s"], 1) for r in runs],
        "step_time_s": {part: statistics.median(r["step_time_s"].get(part, 0.0) for r in runs)
                        for part in STEP_PARTS},
        "placement": {name: p["ranks"] for name, p in runs[0]["embedding"]["sharding"].items()
                      if p["scheme"] != "row_wise"},
    }


def main() -> int:
    parser = bench_parser(__doc__, quick=f"{QUICK_STEPS} steps a run instead of {STEPS}")
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant")
    args = parser.parse_args()
    steps = QUICK_STEPS if args.quick else STEPS
    load = os.getloadavg()
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with Server(work / "server") as server:
            for repeat in range(args.repeats):
                for variant in VARIANTS:  # interleaved
                    tag = f"{variant}-{repeat}"
                    res = run_worker(["--ps", server.address, "--run-id", f"shard-{tag}",
                                      "--sharding", variant, *job(steps)],
                                     work / f"{tag}.json", work / f"{tag}.log")
                    runs[variant].append(res)
                    log(f"{tag}: {res['samples_per_s']:.0f} samples/s")
    out = {v: summary(r) for v, r in runs.items()}
    ratio = out["auto"]["samples_per_s"] / out["row_wise"]["samples_per_s"]
    print(f"dlrm job, 2 ranks, {steps} steps, {args.repeats} interleaved repeats (medians):")
    for v in VARIANTS:
        parts = ", ".join(f"{k} {1e3 * s:.2f} ms" for k, s in out[v]["step_time_s"].items())
        print(f"  {v:9s} {out[v]['samples_per_s']:9.0f} samples/s  ({parts})")
    print(f"  auto / row_wise: {ratio:.2f}x; tables placed whole by auto: "
          f"{len(out['auto']['placement'])} of 26 (TorchRec: not installed here)")
    write_json(args.json, {"variants": out, "auto_over_row_wise": ratio, "steps": steps,
                           "machine": machine(load)}, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
