"""Device and server memory per embedding row: fp32 rows, bf16 rows, and Adam on the device.

    python bench/bench_memory.py                  # dims 16, 64, 128; 262,144-row tables
    python bench/bench_memory.py --quick          # dims 16, 64; 65,536 rows
    python bench/bench_memory.py --json runs/bench_memory.json

Goal 5: device bytes per embedding element = 4 with fp32 rows and 2 with
--row-dtype bf16, next to what keeping Adam state on the device costs (12 bytes per
element: fp32 rows + m + v).

Every hybridps figure is measured from the tensors themselves (numel x element_size
of what is allocated), not computed from a formula:
  - "hybridps fp32 rows" / "hybridps bf16 rows": the rows of a ShardedEmbedding built
    with that row dtype (worker/embedding/sharded.py), on the device; the shard server's state
    for the same rows from a real ps.core.store.Store partition registered with that row
    dtype: m + v (+ a 1-byte touched flag per row) and, for bf16, the fp32 master rows;
  - "device Adam (--local-optimizer)": the same ShardedEmbedding plus the
    LocalSparseOptimizer's m and v (and fp32 master with bf16 rows) next to the rows:
    the sparse Adam state kept where the rows are, as a single-process trainer does;
  - "TorchRec fused Adam": the per-row tensors of FBGEMM's TBE with EmbOptimType.ADAM
    (weights, momentum1, momentum2, all [rows, dim]), allocated here with that layout
    (TorchRec itself is not installed), with fp32 and with fp16 weights (its
    optimizer states stay fp32); and rowwise Adagrad (one fp32 momentum per row), the
    optimizer of TorchRec's side in bench_vs_torchrec.py.
All of this state is dense per row, so bytes per row do not depend on the table
size; --rows only sets how much is allocated to measure them.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from harness import bench_parser, machine, write_json  # bench/ is sys.path[0]

from hybridps.optim import OptimizerSpec
from ps.core.partition import TableSpec
from ps.core.store import Store
from worker.embedding.rows import TableConfig
from worker.embedding.sharded import ShardedEmbedding
from worker.updates.source import LocalSparseOptimizer

DEVICE_ADAM_BYTES_PER_ELEM = 12  # fp32 rows + m + v
GOAL = {"fp32": 4.0, "bf16": 2.0}  # device bytes per element
SPEC = OptimizerSpec("adam", lr=1e-3)


@dataclass
class Row:
    config: str
    dim: int
    rows: int
    device_bytes: int   # measured: the tensors on the worker's device
    server_bytes: int   # measured: the shard server's partition (0: no server)
    measured: str       # what the figures come from

    @property
    def device_per_row(self) -> float:
        return self.device_bytes / self.rows

    @property
    def device_per_elem(self) -> float:
        return self.device_bytes / (self.rows * self.dim)

    @property
    def server_per_row(self) -> float:
        return self.server_bytes / self.rows

    @property
    def rows_vs_device_adam(self) -> float:
        """Rows a device holds relative to keeping Adam state on it (12 B/element)."""
        return DEVICE_ADAM_BYTES_PER_ELEM / self.device_per_elem

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "device_bytes_per_row": self.device_per_row,
                "device_bytes_per_elem": self.device_per_elem,
                "server_bytes_per_row": self.server_per_row,
                "rows_vs_device_adam": self.rows_vs_device_adam}


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def server_bytes(rows: int, dim: int, row_dtype: torch.dtype) -> tuple[int, int]:
    """(m + v + touched, master) bytes of a real Store partition for `rows` x `dim`."""
    store = Store()
    store.register("bench", 0, 1, 0, [TableSpec("t", rows, dim, 0, rows)], SPEC,
                   row_dtype=row_dtype)
    stats = store.stats("bench").partitions[0]
    return stats.state_bytes, stats.master_bytes


def measure(dim: int, rows: int) -> tuple[list[Row], dict[str, Any]]:
    table = [TableConfig("t", rows, dim)]
    out: list[Row] = []
    server_detail: dict[str, Any] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        emb = ShardedEmbedding(table, row_dtype=dtype, init_std=0.05)
        weight = emb.weights["t"]
        assert weight.dtype == dtype
        state, master = server_bytes(rows, dim, dtype)
        server_detail[name] = {"m_v_touched_bytes_per_row": state / rows,
                               "master_bytes_per_row": master / rows}
        out.append(Row(f"hybridps {name} rows (server: m, v{', master' if master else ''})",
                       dim, rows, sum(emb.device_bytes().values()), state + master,
                       "ShardedEmbedding weights; Store partition m, v, touched, master"))
        local = LocalSparseOptimizer(emb, SPEC)
        m, v = local.moments["t"]
        device = _nbytes(weight, m, v, local.masters.get("t"))
        label = "device Adam (--local-optimizer, fp32 rows)" if name == "fp32" else \
            "device Adam (--local-optimizer, bf16 rows + fp32 master)"
        out.append(Row(label, dim, rows, device, 0,
                       "ShardedEmbedding weights + LocalSparseOptimizer m, v, master"))
        del emb, local
    # FBGEMM TBE layout (what TorchRec's fused optimizers keep on the device).
    for wname, wdtype in (("fp32", torch.float32), ("fp16", torch.float16)):
        weights = torch.empty(rows, dim, dtype=wdtype)
        m1 = torch.empty(rows, dim)
        m2 = torch.empty(rows, dim)
        out.append(Row(f"TorchRec fused Adam ({wname} weights)", dim, rows,
                       _nbytes(weights, m1, m2), 0,
                       "TBE layout allocated here: weights, momentum1, momentum2"))
    weights = torch.empty(rows, dim)
    momentum = torch.empty(rows)
    out.append(Row("TorchRec fused rowwise Adagrad (fp32)", dim, rows,
                   _nbytes(weights, momentum), 0,
                   "TBE layout allocated here: weights, momentum1 per row"))
    return out, server_detail


def table(results: list[Row]) -> str:
    head = ("config", "dim", "device B/row", "device B/elem", "server B/row",
            "rows/device vs device Adam")
    lines = [head]
    for r in results:
        lines.append((r.config, str(r.dim), f"{r.device_per_row:.1f}",
                      f"{r.device_per_elem:.2f}",
                      f"{r.server_per_row:.1f}" if r.server_bytes else "-",
                      f"{r.rows_vs_device_adam:.2f}x"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = []
    for line in lines:
        cells = [c.ljust(w) if i == 0 else c.rjust(w)
                 for i, (c, w) in enumerate(zip(line, widths, strict=True))]
        text.append("  ".join(cells))
    return "\n".join(text)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, quick="dims 16, 64 and 65,536-row tables")
    p.add_argument("--dims", default="16,64,128")
    p.add_argument("--rows", type=int, default=262144, help="rows of the measured table")
    args = p.parse_args(argv)
    if args.quick:
        args.dims, args.rows = "16,64", 65536
    dims = [int(x) for x in args.dims.split(",")]
    started = time.perf_counter()
    load_before = os.getloadavg()
    results: list[Row] = []
    server: dict[str, Any] = {}
    for dim in dims:
        rows, detail = measure(dim, args.rows)
        results += rows
        server[str(dim)] = detail
    print(f"memory per embedding row, measured from the tensors ({args.rows:,} rows per "
          f"table; device Adam = {DEVICE_ADAM_BYTES_PER_ELEM} B/element: fp32 rows + m + v)")
    print(table(results))
    for dim in dims:
        d = server[str(dim)]
        print(f"server bytes per row at dim {dim}: fp32 rows: m+v+touched "
              f"{d['fp32']['m_v_touched_bytes_per_row']:.0f}; bf16 rows: m+v+touched "
              f"{d['bf16']['m_v_touched_bytes_per_row']:.0f} + fp32 master "
              f"{d['bf16']['master_bytes_per_row']:.0f}")
    got = {name: {r.dim: r.device_per_elem for r in results
                  if r.config.startswith(f"hybridps {name} rows")} for name in GOAL}
    met = all(v == GOAL[name] for name, per_dim in got.items() for v in per_dim.values())
    print(f"goal 5 (device bytes/element: fp32 rows {GOAL['fp32']:g}, bf16 rows "
          f"{GOAL['bf16']:g}; device Adam {DEVICE_ADAM_BYTES_PER_ELEM}): "
          + ("met" if met else "NOT met") + "; "
          + "; ".join(f"{name} " + ", ".join(f"dim {d}: {v:g}" for d, v in per_dim.items())
                      for name, per_dim in got.items()))
    write_json(args.json, {
        "goal": {"device_bytes_per_elem": GOAL,
                 "device_adam_bytes_per_elem": DEVICE_ADAM_BYTES_PER_ELEM, "met": met},
        "results": [r.as_dict() for r in results],
        "server_bytes_per_row": server,
        "machine": machine(load_before),
        "elapsed_s": time.perf_counter() - started,
    }, args)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
