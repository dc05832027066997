"""Checkpoints side by side: bytes and seconds of a checkpoint and of a restore, and how long
the step loop waits for a checkpoint written in the background vs one written in place.

    python bench/bench_checkpoint.py --quick        # 1M and 10M rows x 8, --local-optimizer
    python bench/bench_checkpoint.py                # 1M and 10M rows x 16, local and server
    python bench/bench_checkpoint.py --big          # also 100M rows (about 40 GB of memory)
    python bench/bench_checkpoint.py --sizes 2000000 --dim 32 --json runs/bench/ck.json

For each table size (`--task tables`: one table, bounded Zipf ids), each update source
(`--sources`: local = --local-optimizer, every byte written by the ranks; server = a real
`python -m ps`, which writes the optimizer state) and each checkpoint mode (`--modes`; the
modes the worker accepts as --checkpoint-mode, or only "full" before that flag exists), a
run of 2 gloo ranks trains STEPS steps with a checkpoint every STEPS/2 steps, once with
`--checkpoint-async false` and once with `--checkpoint-async true`, interleaved; then a run
resumes from the synchronous run's checkpoint. Printed per row: the bytes of the last
checkpoint, seconds until it is complete, how long the step loop waited for it (results
`stall_s`: the snapshot, and a previous write still in progress; median over the run's
checkpoints), that wait as a share of the synchronous checkpoint's, the snapshot's host
memory per rank, and the restore (rank 0's rows, dense; the server's optimizer state
loads inside Register, in the resumed run's setup). Goal (issue 48): the step loop waits
at most 10% of a synchronous checkpoint's time. With a server, the server's share (its
optimizer state) is written inside the snapshot (the Checkpoint RPC answers once the files
are durable), so there the loop waits for it. The page cache decides much of the disk
time (files just written are read back from memory): the numbers say what this machine
does, not what a cluster file system does.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness import REPO, Server, bench_parser, child_env, run_worker, write_json

WORLD = 2
GIB = 2**30
MODE_FLAG = "--checkpoint-mode"


def accepted_modes() -> list[str]:
    """The checkpoint modes this worker knows: those of --checkpoint-mode, else "full"."""
    proc = subprocess.run([sys.executable, "-m", "worker.main", "--help"], cwd=REPO,
                          env=child_env(), capture_output=True, text=True, check=False)
    return ["full", "incremental"] if MODE_FLAG in proc.stdout else ["full"]


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _train(work: Path, name: str, args: list[str]) -> dict[str, Any]:
    return run_worker([*args, "--eval-batches", "1", "--eval-every", "0"],
                      work / f"{name}.json", work / f"{name}.log", world=WORLD)


def one_size(work: Path, rows: int, dim: int, steps: int, source: str, mode: str,
             modes: list[str]) -> dict[str, Any]:
    """The synchronous and the asynchronous run, and the resume, of one configuration."""
    tag = f"{source}-{mode}-{rows}"
    server = Server(work / f"ps-{tag}", "--checkpoint-root", str(work)) \
        if source == "server" else None
    every = max(steps // 2, 1)
    common = ["--task", "tables", "--num-rows", str(rows), "--dim", str(dim),
              "--batch-size", "1024", "--log-every", "1", "--checkpoint-every", str(every),
              "--checkpoint-keep", "0",
              *([MODE_FLAG, mode] if len(modes) > 1 else [])]
    src = ["--local-optimizer"] if server is None else ["--ps", server.address]
    out: dict[str, Any] = {"rows": rows, "dim": dim, "source": source, "mode": mode}
    try:
        for writer in ("sync", "async"):
            ck = work / f"ck-{tag}-{writer}"
            shutil.rmtree(ck, ignore_errors=True)
            res = _train(work, f"{tag}-{writer}", [
                *common, *src, "--run-id", f"{tag}-{writer}", "--steps", str(steps),
                "--checkpoint-dir", str(ck),
                "--checkpoint-async", "true" if writer == "async" else "false"])
            ckpt = res["checkpoint"]
            last = ckpt["written"][-1]
            out[writer] = {
                "bytes": last["bytes"], "checkpoint_s": statistics.median(ckpt["save_s"]),
                "loop_waits_s": statistics.median(ckpt["stall_s"]),
                "snapshot_bytes": ckpt["snapshot_bytes"],
                "setup_s": res["setup_time_s"], "train_s": res["train_time_s"], "ck": str(ck)}
        resumed = _train(work, f"{tag}-resumed", [
            *common, *src, "--run-id", f"{tag}-resumed", "--steps", str(steps + 1),
            "--checkpoint-dir", out["sync"]["ck"], "--resume",
            "--checkpoint-async", "false"])
    finally:
        if server is not None:
            server.close()
    out["restore_s"] = resumed["checkpoint"]["restore_s"]
    out["resume_setup_s"] = resumed["setup_time_s"] - out["sync"]["setup_s"]
    out["wait_share"] = out["async"]["loop_waits_s"] / out["sync"]["loop_waits_s"]
    for writer in ("sync", "async"):
        shutil.rmtree(out[writer].pop("ck"), ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, quick="1M and 10M rows x 8, --local-optimizer only")
    parser.add_argument("--sizes", default="1000000,10000000",
                        help="table rows, comma-separated")
    parser.add_argument("--big", action="store_true", help="also a table of 100M rows")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--sources", default="local,server", help="local, server or both")
    parser.add_argument("--modes", default="",
                        help="checkpoint modes (default: every mode the worker accepts)")
    parser.add_argument("--dir", default="", help="where to write (default: a temp dir)")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s] + ([100_000_000] if args.big else [])
    dim, sources = (8, ["local"]) if args.quick else (args.dim, args.sources.split(","))
    known = accepted_modes()
    modes = args.modes.split(",") if args.modes else known
    unknown = sorted(set(modes) - set(known))
    if unknown:
        parser.error(f"--modes {','.join(unknown)}: this worker knows only {','.join(known)}")
    work = Path(args.dir or tempfile.mkdtemp(prefix="hybridps-bench-ck-"))
    work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    results = [one_size(work, rows, dim, args.steps, source, mode, known)
               for rows in sizes for source in sources for mode in modes]
    print(f"{'rows':>11} {'source':>6} {'mode':>11} {'GiB':>6} {'sync s':>7} "
          f"{'async s':>7} {'loop waits s':>12} {'of sync':>7} {'snapshot GiB':>12} "
          f"{'restore s':>9} {'resume setup s':>14}")
    for r in results:
        s, a = r["sync"], r["async"]
        print(f"{r['rows']:>11,} {r['source']:>6} {r['mode']:>11} {s['bytes'] / GIB:>6.2f} "
              f"{s['checkpoint_s']:>7.2f} {a['checkpoint_s']:>7.2f} "
              f"{s['loop_waits_s']:>5.2f}/{a['loop_waits_s']:<6.2f} {r['wait_share']:>7.1%} "
              f"{a['snapshot_bytes'] / GIB:>12.2f} {r['restore_s']:>9.2f} "
              f"{r['resume_setup_s']:>14.2f}")
    print("loop waits: synchronous/asynchronous, median over a run's checkpoints; of sync: "
          f"the asynchronous wait as a share of the synchronous one (goal: <= 10%); load "
          f"average {os.getloadavg()[0]:.2f}")
    write_json(args.json, {"results": results, "dim": dim, "steps": args.steps,
                           "world_size": WORLD, "loadavg_before": load_before,
                           "loadavg_after": os.getloadavg()}, args)
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
