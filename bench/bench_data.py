"""The file data path (worker/data/) against what training consumes, side by side.

    python bench/bench_data.py                      # a few minutes on CPU
    python bench/bench_data.py --rows 1048576 --batch-size 4096 --repeats 5

1. A Criteo-shaped Parquet set (label, dense_0..12, cat_0..25; the synthetic CTR
   generator's rows, worker/tasks/ctr/synthetic.py) in row groups of --group-rows.
2. The loader: samples/s of one rank (rank 0 of 2) reading its share --loader-epochs
   times (each epoch's buffers decoded and shuffled anew), in the training process
   (--data-workers 0) and from one DataLoader worker process (--data-workers 1; the
   worker's start is not counted), against the samples/s one rank of the dlrm job
   consumes (its training samples/s on generated batches).
3. The dlrm job trained from the Parquet set (--task dlrm --train-files: the one file path,
   worker/data/source.py) against the same job on generated batches (--task dlrm), one
   process each, --local-optimizer; the runs alternate, --repeats times, and the medians
   are compared.

The goals: the loader at least 3x the job's consumption with one worker
process, the job from Parquet at least 0.95x its speed on generated batches.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from worker.data.task import FilesTask
from worker.tasks.ctr.batch import NUM_DENSE, NUM_SPARSE

ROOT = Path(__file__).resolve().parents[1]


def write_set(folder: Path, rows: int, group_rows: int, files: int, table_rows: int) -> None:
    import numpy as np
    import pyarrow as pa

    from worker.tasks.ctr.synthetic import SyntheticCTR

    gen = SyntheticCTR([table_rows] * NUM_SPARSE, seed=0)
    per_file = rows // files
    index = 0
    for f in range(files):
        with _Writer(folder / f"part-{f:03d}.parquet") as w:
            done = 0
            while done < per_file:
                n = min(group_rows, per_file - done)
                b = gen.batch(index, n, "train")
                index += 1
                w.write(pa.table({
                    "label": b.labels.astype(np.int8),
                    **{f"dense_{j}": b.dense[:, j] for j in range(NUM_DENSE)},
                    **{f"cat_{j}": b.sparse[:, j] for j in range(NUM_SPARSE)}}))
                done += n


class _Writer:
    """A ParquetWriter opened on the first table (its schema), one row group a table."""

    def __init__(self, path: Path) -> None:
        self.path, self.writer = path, None

    def __enter__(self) -> _Writer:
        return self

    def write(self, table: object) -> None:
        import pyarrow.parquet as pq

        if self.writer is None:
            self.writer = pq.ParquetWriter(self.path, table.schema)  # type: ignore[attr-defined]
        self.writer.write_table(table, row_group_size=table.num_rows)  # type: ignore[attr-defined]

    def __exit__(self, *exc: object) -> None:
        if self.writer is not None:
            self.writer.close()


def loader_rate(pattern: str, args: argparse.Namespace, workers: int) -> float:
    """Samples/s of rank 0 of 2 reading --loader-epochs passes over its share (every
    buffer decoded and shuffled; with a worker process, timed from its first batch on)."""
    from worker.config.train_config import TrainConfig

    cfg = TrainConfig.of(local_optimizer=True, task="files", train_files=pattern,
                         batch_size=args.batch_size, num_rows=args.table_rows,
                         data_workers=workers)
    task = FilesTask(cfg)
    steps = args.loader_epochs * task.source.steps_per_epoch(2)
    first = 0
    if workers:
        task.batch(0, 0, 2)  # the worker process starts (imports torch): not counted
        first = 1
    t0 = time.perf_counter()
    for step in range(first, steps):
        task.batch(step, 0, 2)
    rate = (steps - first) * args.batch_size / (time.perf_counter() - t0)
    task.source.close()
    return rate


def job_rate(task_flags: list[str], args: argparse.Namespace, out: Path) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    env.update(OMP_NUM_THREADS=str(args.threads),
               PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(ROOT / "worker" / "main.py"), "--local-optimizer",
           "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--dim",
           str(args.dim), "--eval-batches", "0", "--eval-every", "0", "--progress", "false",
           "--log-every", "50", "--results", str(out), *task_flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    res = json.loads(out.read_text())
    return {"samples_per_s": float(res["samples_per_s"]),
            "data_ms": 1000 * float(res["step_time_s"]["data"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=262144)
    parser.add_argument("--group-rows", type=int, default=16384)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--table-rows", type=int, default=10000)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--steps", type=int, default=60, help="training steps of each job run")
    parser.add_argument("--loader-epochs", type=int, default=3,
                        help="passes the loader makes over rank 0's share")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the jobs")
    parser.add_argument("--json", default="", help="also write the numbers here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        t0 = time.perf_counter()
        write_set(folder, args.rows, args.group_rows, args.files, args.table_rows)
        print(f"wrote {args.rows} rows in {args.files} files ({time.perf_counter() - t0:.1f}s)",
              flush=True)
        pattern = str(folder / "*.parquet")
        generated = ["--task", "dlrm", "--table-rows", str(args.table_rows)]
        from_files = [*generated, "--train-files", pattern]
        rates: dict[str, list[float]] = {k: [] for k in (
            "loader_inproc", "loader_1_worker", "dlrm_generated", "dlrm_parquet")}
        data_ms: dict[str, list[float]] = {"dlrm_generated": [], "dlrm_parquet": []}
        for r in range(args.repeats):  # interleaved: drift hits both sides alike
            rates["loader_inproc"].append(loader_rate(pattern, args, 0))
            rates["loader_1_worker"].append(loader_rate(pattern, args, 1))
            for name, flags in (("dlrm_generated", generated), ("dlrm_parquet", from_files)):
                got = job_rate(flags, args, folder / f"{name}-{r}.json")
                rates[name].append(got["samples_per_s"])
                data_ms[name].append(got["data_ms"])
            print(f"repeat {r + 1}/{args.repeats}: " + "  ".join(
                f"{k} {v[-1]:,.0f}" for k, v in rates.items()), flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    consume = med["dlrm_generated"]
    print(f"\nsamples/s per rank, medians of {args.repeats} (batch {args.batch_size}, "
          f"{NUM_SPARSE} tables of {args.table_rows} rows, dim {args.dim}):")
    print(f"  loader, in the training process   {med['loader_inproc']:>12,.0f}  "
          f"{med['loader_inproc'] / consume:5.2f}x the job's consumption")
    print(f"  loader, 1 DataLoader worker       {med['loader_1_worker']:>12,.0f}  "
          f"{med['loader_1_worker'] / consume:5.2f}x   (goal >= 3x)")
    print(f"  dlrm job, generated batches       {consume:>12,.0f}  "
          f"data {statistics.median(data_ms['dlrm_generated']):.1f} ms/step")
    print(f"  dlrm job, from Parquet            {med['dlrm_parquet']:>12,.0f}  "
          f"{med['dlrm_parquet'] / consume:5.2f}x   (goal >= 0.95x)  data "
          f"{statistics.median(data_ms['dlrm_parquet']):.1f} ms/step")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "samples_per_s": rates,
                                               "data_ms": data_ms, "median": med}, indent=1))


if __name__ == "__main__":
    main()
