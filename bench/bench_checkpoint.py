"""Checkpoint and resume time per GiB of state, against a real shard server.

    python bench/bench_checkpoint.py                 # 8M x 32 rows, 2 ranks
    python bench/bench_checkpoint.py --quick         # 2M x 32 rows
    python bench/bench_checkpoint.py --rows 16000000 --dim 64 --json runs/bench/ck.json

One run trains `--task tables` (one table) for 2 steps on 2 gloo ranks with a real
`python -m ps` and checkpoints after step 1; a second run resumes from that checkpoint
(the server loads and re-shards the optimizer state; the ranks load their rows) and
trains 2 more steps. State = rows (4 B/element, written by the ranks) + the server's m
and v (8 B/element), plus the small dense part. Printed: seconds and GiB of the
checkpoint (drain, rows, the server's optimizer state, dense, manifest with crc32 of
every file) and of the resume (rank 0's restore_local: rows, dense; the server's
restore happens inside Register, before it), and seconds per GiB. Disk: the page cache
decides much of it (files just written are read back from memory); the numbers say what
this machine does, not what a cluster file system does.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness import Server, bench_parser, run_worker, write_json  # bench/ is sys.path[0]

WORLD = 2
GIB = 2**30


def _run(args: list[str], results: Path, log_path: Path) -> dict[str, Any]:
    return run_worker([*args, "--eval-batches", "1", "--eval-every", "0"], results, log_path,
                      world=WORLD)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, quick="2M rows")
    parser.add_argument("--rows", type=int, default=8_000_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--dir", default="", help="where to write (default: a temp dir)")
    args = parser.parse_args(argv)
    rows = 2_000_000 if args.quick else args.rows
    work = Path(args.dir or tempfile.mkdtemp(prefix="hybridps-bench-ck-"))
    work.mkdir(parents=True, exist_ok=True)
    ck = work / "ck"
    shutil.rmtree(ck, ignore_errors=True)
    common = ["--task", "tables", "--num-rows", str(rows), "--dim", str(args.dim),
              "--batch-size", "1024", "--checkpoint-dir", str(ck), "--log-every", "1"]
    server = Server(work)
    try:
        first = _run(["--ps", server.address, "--run-id", "bench-ck", "--steps", "2",
                      "--checkpoint-every", "2", *common], work / "first.json",
                     work / "first.log")
        resumed = _run(["--ps", server.address, "--run-id", "bench-ck-resumed", "--steps",
                        "4", "--resume", *common], work / "resumed.json", work / "resumed.log")
    finally:
        server.close()
    state = _dir_bytes(ck / "step-0000000001")
    save_s = first["checkpoint"]["save_s"][0]
    restore_s = resumed["checkpoint"]["restore_s"]
    # The server's restore (m, v) runs inside Register, before restore_local: part of the
    # worker's setup, which also builds the model (rows init) like a fresh run's does: the
    # resume costs the difference.
    resume_setup_s = resumed["setup_time_s"] - first["setup_time_s"]
    out = {
        "rows": rows, "dim": args.dim, "world_size": WORLD,
        "state_gib": state / GIB,
        "rows_gib": rows * args.dim * 4 / GIB, "optim_gib": rows * args.dim * 8 / GIB,
        "checkpoint_s": save_s, "checkpoint_s_per_gib": save_s / (state / GIB),
        "resume_rows_dense_s": restore_s,
        "resume_setup_s": resume_setup_s,
        "fresh_setup_s": first["setup_time_s"], "resumed_setup_s": resumed["setup_time_s"],
        "resume_s_per_gib": resume_setup_s / (state / GIB),
        "load_average": os.getloadavg(),
    }
    print(f"table {rows:,} x {args.dim}: checkpoint {state / GIB:.2f} GiB "
          f"(rows {out['rows_gib']:.2f} + m/v {out['optim_gib']:.2f})")
    print(f"checkpoint: {save_s:.2f} s = {out['checkpoint_s_per_gib']:.2f} s/GiB")
    print(f"resume: {resume_setup_s:.2f} s = {out['resume_s_per_gib']:.2f} s/GiB (worker setup "
          f"{resumed['setup_time_s']:.2f} s resumed vs {first['setup_time_s']:.2f} s fresh; "
          f"of it rows + dense on rank 0 {restore_s:.2f} s, the rest the server's Register "
          "with restore)")
    print(f"load average {out['load_average'][0]:.2f}")
    write_json(args.json, out)
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
