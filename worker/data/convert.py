"""Criteo TSV to Parquet, streaming: `python -m worker.data convert` (docs/data.md).

    python -m worker.data convert day_0.tsv --output parquet/ --rows-per-group 65536

Reads the TSV in --rows-per-group line blocks (worker/tasks/ctr/criteo.py's parser: dense
values log(1 + max(x, 0)), a token hashed to its id) and writes each block as one row group,
starting a new file part-NNNNN.parquet every --rows-per-file rows; nothing is held but one
block. Columns: label (int8), dense_0..12 (float32), cat_0..25 (int64). --table-rows R:
ids in [0, R) (0: missing), the dlrm task's hashing; 0 (the default): the 64-bit token
hash in [1, 2^62], to be mapped at training time (--id-overflow hash).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from worker.data.formats import TSV_ID_SPACE
from worker.tasks.ctr.batch import NUM_DENSE, NUM_SPARSE
from worker.tasks.ctr.criteo import iter_criteo_batches

__all__ = ["convert_tsv", "main"]


def convert_tsv(inputs: Sequence[str | Path], output: str | Path, *,
                rows_per_group: int = 65536, rows_per_file: int = 1 << 22,
                table_rows: int = 0) -> list[Path]:
    """The Parquet files written (module doc)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    if rows_per_group < 1 or rows_per_file < 1 or table_rows == 1 or table_rows < 0:
        raise ValueError("need --rows-per-group >= 1, --rows-per-file >= 1 and --table-rows "
                         "0 or >= 2")
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    sizes = table_rows or TSV_ID_SPACE
    paths: list[Path] = []
    writer: pq.ParquetWriter | None = None
    in_file = 0
    for b in iter_criteo_batches([str(p) for p in inputs], rows_per_group, sizes):
        if writer is None or in_file >= rows_per_file:
            if writer is not None:
                writer.close()
            paths.append(out / f"part-{len(paths):05d}.parquet")
            writer, in_file = None, 0
        columns = {"label": b.labels.astype(np.int8),
                   **{f"dense_{j}": b.dense[:, j] for j in range(NUM_DENSE)},
                   **{f"cat_{j}": b.sparse[:, j] for j in range(NUM_SPARSE)}}
        table = pa.table(columns)
        if writer is None:
            writer = pq.ParquetWriter(paths[-1], table.schema)
        writer.write_table(table, row_group_size=len(b))
        in_file += len(b)
    if writer is not None:
        writer.close()
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.data",
                                     description="Data tools of --task files (docs/data.md).")
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="Criteo TSV (.tsv, .txt, .gz) to Parquet, streaming")
    conv.add_argument("inputs", nargs="+", help="TSV files or directories, in order")
    conv.add_argument("--output", required=True, help="directory for part-NNNNN.parquet")
    conv.add_argument("--rows-per-group", type=int, default=65536)
    conv.add_argument("--rows-per-file", type=int, default=1 << 22)
    conv.add_argument("--table-rows", type=int, default=0,
                      help="hash ids into [0, R) (0: keep the 64-bit token hash)")
    example = sub.add_parser("example", help="write a small Parquet set to try --task files")
    example.add_argument("--output", required=True, help="directory for the files")
    example.add_argument("--num-rows", type=int, default=1000, help="ids below this")
    args = parser.parse_args(argv)
    if args.command == "example":
        from worker.data.example import write_example

        paths = write_example(args.output, rows=args.num_rows)
        print(f"wrote {len(paths)} files to {args.output}", flush=True)
        return 0
    try:
        paths = convert_tsv(args.inputs, args.output, rows_per_group=args.rows_per_group,
                            rows_per_file=args.rows_per_file, table_rows=args.table_rows)
    except (ValueError, OSError) as exc:  # a malformed line names its file and line
        print(f"python -m worker.data convert: error: {exc}", file=sys.stderr, flush=True)
        return 2
    print(f"wrote {len(paths)} files to {args.output}", flush=True)
    return 0
