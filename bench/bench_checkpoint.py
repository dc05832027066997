"""Checkpoints side by side: bytes and seconds of a checkpoint and of a restore, and how long
the step loop waits for a checkpoint written in the background vs one written in place.

    python bench/bench_checkpoint.py --quick        # 1M and 10M rows x 8, --local-optimizer
    python bench/bench_checkpoint.py                # 1M and 10M rows x 16, local and server
    python bench/bench_checkpoint.py --big          # also 100M rows (about 40 GB of memory, x 16)
    python bench/bench_checkpoint.py --sizes 2000000 --dim 32 --json runs/bench/ck.json

For each table size (`--task tables`: one table, bounded Zipf ids), each update source
(`--sources`: local = --local-optimizer, every byte written by the ranks; server = a real
`python -m ps`, which writes the optimizer state) and each checkpoint mode (`--modes`; the
modes the worker accepts as --checkpoint-mode, or only "full" before that flag exists),
2 gloo ranks train 3*AFTER-1 steps (`--after`, default 8) three times, interleaved: without
a checkpoint, with two (after steps AFTER-1 and 2*AFTER-1) written in place
(`--checkpoint-async false`), and with the same two written in the background
(`--checkpoint-async true`); then a run resumes from the synchronous run's checkpoint.
Printed per row: the checkpoint's bytes, seconds until it is complete, how long each held
the step loop (results `stall_s`: for the background write the snapshot, the first into
freshly allocated host buffers, the second reusing them, less `behind_s`, the time it
waited for the previous write), that as a share of the synchronous one, what a checkpoint
cost the training time
(against the run without one: the background write competes for the CPUs), the snapshot's
host memory per rank, and the restore (rank 0's rows and dense; the server's optimizer
state loads inside Register, in the resumed run's setup). Bytes are the second
checkpoint's (with --checkpoint-mode incremental: a link after AFTER steps; the first of a
process is full). Goal (issue 48): the step loop waits at most 10% of a synchronous
checkpoint's time. With a server, the server's share (its optimizer state) is copied at
the snapshot and written in the background too (the two-step Checkpoint RPC: it answers
at the copy, CheckpointDone once the files are durable, in the checkpoint's background
job); written in place, the loop waits for both. The page cache decides much of the disk
time: the numbers say what this machine does, not what a cluster file system does.
"""

from __future__ import annotations

import os
import shutil
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


def one_size(work: Path, rows: int, dim: int, after: int, source: str, mode: str,
             modes: list[str]) -> dict[str, Any]:
    """The runs without a checkpoint, with a synchronous and with an asynchronous one
    (interleaved), and the resume, of one configuration."""
    tag = f"{source}-{mode}-{rows}"
    server = Server(work / f"ps-{tag}", "--checkpoint-root", str(work)) \
        if source == "server" else None
    steps = 3 * after - 1  # checkpoints after steps after-1 and 2*after-1, then after-1 more
    common = ["--task", "tables", "--num-rows", str(rows), "--dim", str(dim),
              "--batch-size", "1024", "--log-every", "1", "--steps", str(steps),
              *([MODE_FLAG, mode] if len(modes) > 1 else [])]
    src = ["--local-optimizer"] if server is None else ["--ps", server.address]
    out: dict[str, Any] = {"rows": rows, "dim": dim, "source": source, "mode": mode}
    try:
        for writer in ("none", "sync", "async"):
            ck = work / f"ck-{tag}-{writer}"
            shutil.rmtree(ck, ignore_errors=True)
            saving = [] if writer == "none" else [
                "--checkpoint-dir", str(ck), "--checkpoint-every", str(after),
                "--checkpoint-async", "true" if writer == "async" else "false"]
            res = _train(work, f"{tag}-{writer}", [*common, *src, "--run-id",
                                                   f"{tag}-{writer}", *saving])
            out[writer] = {"train_s": res["train_time_s"], "setup_s": res["setup_time_s"]}
            if writer == "none":
                continue
            ckpt = res["checkpoint"]
            out[writer].update(bytes=[w["bytes"] for w in ckpt["written"]],
                               kinds=[w.get("kind", "full") for w in ckpt["written"]],
                               checkpoint_s=ckpt["save_s"],
                               loop_waits_s=ckpt["stall_s"], behind_s=ckpt["behind_s"],
                               snapshot_bytes=ckpt["snapshot_bytes"],
                               cost_s=(res["train_time_s"] - out["none"]["train_s"]) / 2)
        resumed = _train(work, f"{tag}-resumed", [
            *common, *src, "--run-id", f"{tag}-resumed", "--checkpoint-async", "false",
            "--checkpoint-dir", str(work / f"ck-{tag}-sync"), "--resume"])
    finally:
        if server is not None:
            server.close()
    out["restore_s"] = resumed["checkpoint"]["restore_s"]
    out["resume_setup_s"] = resumed["setup_time_s"] - out["sync"]["setup_s"]
    sync, asyn = out["sync"], out["async"]
    # the second checkpoint: its snapshot reuses the first one's host buffers; less the
    # time it waited for the first one's write (when that took longer than AFTER steps)
    asyn["snapshot_s"] = [w - b for w, b in zip(asyn["loop_waits_s"], asyn["behind_s"],
                                                strict=True)]
    out["wait_share"] = [a / s for a, s in zip(asyn["snapshot_s"], sync["loop_waits_s"],
                                               strict=True)]
    for writer in ("none", "sync", "async"):
        shutil.rmtree(work / f"ck-{tag}-{writer}", ignore_errors=True)
    return out


def _pair(values: list[float], spec: str) -> str:
    return "/".join(format(v, spec) for v in values)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, quick="1M and 10M rows x 8, --local-optimizer only")
    parser.add_argument("--sizes", default="1000000,10000000",
                        help="table rows, comma-separated")
    parser.add_argument("--big", action="store_true", help="also a table of 100M rows")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--after", type=int, default=8,
                        help="steps between checkpoints (and, less one, after the last)")
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
    results = [one_size(work, rows, dim, args.after, source, mode, known)
               for rows in sizes for source in sources for mode in modes]
    print(f"{'rows':>11} {'source':>6} {'mode':>11} {'GiB':>6} {'sync s':>7} "
          f"{'async s':>7} {'loop waits: sync':>16} {'async':>11} {'of sync':>13} "
          f"{'behind':>6} {'train cost s':>13} {'snapshot GiB':>12} {'restore s':>9} "
          f"{'resume setup s':>14}")
    for r in results:
        s, a = r["sync"], r["async"]
        print(f"{r['rows']:>11,} {r['source']:>6} {r['mode']:>11} "
              f"{s['bytes'][-1] / GIB:>6.3f} "
              f"{s['checkpoint_s'][-1]:>7.2f} {a['checkpoint_s'][-1]:>7.2f} "
              f"{_pair(s['loop_waits_s'], '.2f'):>16} {_pair(a['snapshot_s'], '.2f'):>11} "
              f"{_pair(r['wait_share'], '.0%'):>13} {a['behind_s'][-1]:>6.2f} "
              f"{s['cost_s']:>6.2f}/{a['cost_s']:<6.2f} {a['snapshot_bytes'] / GIB:>12.2f} "
              f"{r['restore_s']:>9.2f} {r['resume_setup_s']:>14.2f}")
    print("GiB: of the second checkpoint; sync s / async s: until the second checkpoint "
          "is complete; loop waits: how long "
          "the first/second checkpoint held the step loop (async: the snapshot; the first "
          "into fresh host buffers, the second reusing them; of sync: the share, goal <= "
          "10%); behind: the second also waited that long for the first one's write; train "
          "cost: training time per checkpoint less the run without one, synchronous/"
          "asynchronous (the background write competes for the CPUs); snapshot: host memory "
          f"per rank; load average {os.getloadavg()[0]:.2f}")
    write_json(args.json, {"results": results, "dim": dim, "after": args.after,
                           "world_size": WORLD, "loadavg_before": load_before,
                           "loadavg_after": os.getloadavg()}, args)
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
