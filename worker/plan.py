"""Sizing: bytes per device, per shard server and on the wire, before anything is allocated.

Per embedding row of width D (float32 everywhere):
- device of the rank that owns the row: the row itself, 4*D bytes
  (+ the optimizer state with --local-optimizer, which keeps it on the device);
- host of the shard server of that rank's node: the optimizer state (its layout,
  hybridps/optim_kinds.py: 8*D bytes for adam/adamw (m and v), 4*D + 4 for
  partial_rowwise_adam, 4*D for adagrad, 4 for rowwise_adagrad, 0 for sgd), plus 2 bytes
  (the "touched" and "changed" flags); the server holds no copy of the rows;
- on the wire, per step and rank: every touched owned row once up (id 8 B +
  gradient 4*D B) and once down (id + delta).
With --row-dtype bf16 the row takes 2*D bytes on the device and the server adds an
fp32 master copy, 4*D bytes (with --local-optimizer that master is on the device).
Rows are split evenly: rank r of W owns ceil(R/W) rows of a table of R rows at
most, and a node's server holds the state of its ranks' rows.

    from worker.plan import plan_for_config, format_plan
    plan = plan_for_config(cfg, world_size=64, ranks_per_node=8)
    print(format_plan(plan)); plan.refusals  # [] when it fits

`python -m worker.plan --world-size 16 --nodes 2 [worker flags]` plans a job on a
cluster from anywhere (no server, no torchrun) and prints the commands to run it;
`python -m worker.plan --rows 1000000000 --dim 128 --nodes 8 --ranks-per-node 8`
is the calculator for one table (docs/deploy.md's worked example);
`worker/main.py --plan` prints the plan of the actual flags and launch.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import math
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hybridps.optim_kinds import (
    SERVER_FLAG_BYTES_PER_ROW,
    describe_layout,
    kind_names,
    state_bytes_per_element,
    state_floats_per_row,
)
from worker.config.update_kinds import UpdateKind, kind_named
from worker.runtime.memory import detect_host_memory

if TYPE_CHECKING:
    from worker.config.train_config import TrainConfig
    from worker.dense.policy import DenseChoice

GB = 10**9
ID_BYTES = 8
FLOAT_BYTES = 4
ANSWER_CACHE_STEPS = 8  # ps.partition.DEFAULT_ANSWER_CACHE_STEPS (kept torch-free here)
SERVER_STATE_SHARE = 0.75  # the server's default --max-state-bytes: this share of its host


class PlanError(ValueError):
    """The plan cannot be made (e.g. a task that cannot say its tables without data)."""


def optimizer_state_bytes(optimizer: str, dim: int = 1) -> float:
    """Bytes of `optimizer`'s state per embedding element of a row of width `dim` (on the
    shard server, or on the device with --local-optimizer; its declared layout,
    hybridps/optim_kinds.py: per-row values are spread over the row)."""
    try:
        return state_bytes_per_element(optimizer, dim)
    except ValueError:
        raise PlanError(f"no state size known for optimizer {optimizer!r} (not one of "
                        f"{', '.join(kind_names())})") from None


@dataclass(frozen=True)
class TableShape:
    name: str
    num_rows: int
    dim: int
    lookups_per_sample: float = 1.0
    # rows one rank pushes a step when the task says (Task.rows_pushed_per_step: KGE's
    # 1vsAll and KvsAll score every entity, so every owned row); None: from the lookups
    pushed_per_step: int | None = None
    sharding: str = ""  # the table's own scheme (TableConfig.sharding); "": --sharding
    lookups: int = 1  # TableConfig.lookups: the placement's lookup cost, as the worker's


@dataclass
class Plan:
    tables: list[TableShape]
    world_size: int
    ranks_per_node: int
    batch_size: int
    optimizer: str
    staleness: int
    update_kind: UpdateKind  # where the optimizer state lives (worker/config/update_kinds.py)
    device_kind: str = "cuda"  # "cuda": per-rank devices; "cpu": ranks share host memory
    device_capacity: int | None = None  # bytes of one rank's device (cuda)
    host_capacity: int | None = None    # bytes of one node's host memory
    notes: list[str] = field(default_factory=list)
    row_bytes: int = FLOAT_BYTES  # per element of a device row: 4 fp32, 2 --row-dtype bf16
    sharding: str = "row_wise"  # --sharding: the scheme of a table that names none
    # the dense part: its parameters (None: not known before the task is built) and the
    # wrapper --dense-parallel gives it (worker/dense/policy.py, as the run decides)
    dense_params: int | None = None
    dense_choice: DenseChoice | None = None

    # -- layout ----------------------------------------------------------------------
    @property
    def nodes(self) -> int:
        return math.ceil(self.world_size / self.ranks_per_node)

    @property
    def placement(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """table -> (scheme, its W + 1 cut points), as the worker places them; {}: every
        table row-wise."""
        return placement(tuple(self.tables), self.world_size, self.sharding)

    def rows_per_rank(self, t: TableShape) -> int:
        """The most rows of `t` one rank holds (its placement's largest range)."""
        if t.name in self.placement:
            cuts = self.placement[t.name][1]
            return max(b - a for a, b in itertools.pairwise(cuts))
        return math.ceil(t.num_rows / self.world_size)

    def rank_rows(self, t: TableShape, rank: int) -> int:
        """Rows of `t` that `rank` holds (row-wise without a placement: the even split's
        largest share)."""
        if t.name in self.placement:
            cuts = self.placement[t.name][1]
            return cuts[rank + 1] - cuts[rank]
        return math.ceil(t.num_rows / self.world_size)

    def most_loaded(self, bytes_per_row: Callable[[TableShape], int]) -> int:
        """The largest total over the ranks of rows held x `bytes_per_row`: what the
        busiest rank needs (a table placed whole loads one rank only, so the sum of each
        table's largest range would overstate it)."""
        return max(sum(self.rank_rows(t, r) * bytes_per_row(t) for t in self.tables)
                   for r in range(self.world_size))

    def placed(self, t: TableShape) -> str:
        scheme, cuts = self.placement.get(t.name, ("row_wise", ()))
        ranks = [r for r in range(len(cuts) - 1) if cuts[r + 1] > cuts[r]]
        return (f"{scheme} on rank {ranks[0]}" if len(ranks) == 1 and scheme != "row_wise"
                else f"{scheme} over {len(ranks) if ranks else self.world_size} ranks")

    def touched_per_step(self, t: TableShape) -> int:
        """Rows one rank pushes per step, at most: what the task says, else its share of
        the global batch's lookups."""
        if t.pushed_per_step is not None:
            return min(self.rows_per_rank(t), t.pushed_per_step)
        return min(self.rows_per_rank(t), math.ceil(self.batch_size * t.lookups_per_sample))

    def state_floats(self, t: TableShape) -> int:
        """float32 values a row: the optimizer's state (its layout) and the fp32 master."""
        return state_floats_per_row(self.optimizer, t.dim) + self.master_copies * t.dim

    # -- bytes -----------------------------------------------------------------------
    @property
    def master_copies(self) -> int:
        """fp32 master rows kept next to the optimizer state: 1 with bf16 rows."""
        return 1 if self.row_bytes < FLOAT_BYTES else 0

    @property
    def device_rows_bytes(self) -> int:
        return self.most_loaded(lambda t: t.dim * self.row_bytes)

    @property
    def device_state_bytes(self) -> int:
        """m, v (and the fp32 master of bf16 rows) on the device: only without a server
        (--local-optimizer)."""
        if self.update_kind.needs_server:
            return 0
        return self.most_loaded(lambda t: self.state_floats(t) * FLOAT_BYTES)

    @property
    def device_step_bytes(self) -> int:
        """Per-step working set (estimate): looked-up rows, their grads, pending updates."""
        total = 0
        for t in self.tables:
            lookups = math.ceil(self.batch_size * t.lookups_per_sample)
            touched = self.touched_per_step(t)
            total += 3 * lookups * t.dim * FLOAT_BYTES
            total += (self.staleness + 3) * touched * (t.dim * FLOAT_BYTES + ID_BYTES)
        return total

    @property
    def device_bytes_per_rank(self) -> int:
        return self.device_rows_bytes + self.device_state_bytes + self.device_step_bytes

    @property
    def host_state_bytes_per_rank(self) -> int:
        if not self.update_kind.needs_server:
            return 0
        return self.most_loaded(
            lambda t: self.state_floats(t) * FLOAT_BYTES + SERVER_FLAG_BYTES_PER_ROW)

    @property
    def host_cache_bytes_per_rank(self) -> int:
        """The server's saved answers (re-sent pushes are answered from them)."""
        if not self.update_kind.needs_server:
            return 0
        return sum(ANSWER_CACHE_STEPS * self.touched_per_step(t) * (t.dim * FLOAT_BYTES
                                                                    + ID_BYTES)
                   for t in self.tables)

    @property
    def host_bytes_per_server(self) -> int:
        per_rank = self.host_state_bytes_per_rank + self.host_cache_bytes_per_rank
        return per_rank * min(self.ranks_per_node, self.world_size)

    @property
    def wire_bytes_per_rank_step(self) -> tuple[int, int]:
        """(push bytes up, update bytes down) of one rank per step, at most."""
        if not self.update_kind.needs_server:
            return 0, 0
        one_way = sum(self.touched_per_step(t) * (ID_BYTES + t.dim * FLOAT_BYTES)
                      for t in self.tables)
        return one_way, one_way

    @property
    def a2a_bytes_per_rank_step(self) -> int:
        """Embedding all_to_all traffic of one rank per step (ids out, rows back, grads out)."""
        return sum(math.ceil(self.batch_size * t.lookups_per_sample)
                   * (ID_BYTES + 2 * t.dim * FLOAT_BYTES) for t in self.tables)

    @property
    def node_bytes_cpu(self) -> int:
        """device=cpu: the ranks' rows and the server's state share one host."""
        return self.device_bytes_per_rank * self.ranks_per_node + self.host_bytes_per_server

    # -- verdict ---------------------------------------------------------------------
    @property
    def refusals(self) -> list[str]:
        out = []
        if self.device_kind == "cuda":
            cap = self.device_capacity
            if cap is not None and self.device_bytes_per_rank > cap:
                out.append(f"device memory: each rank needs {_gb(self.device_bytes_per_rank)} "
                           f"(rows {_gb(self.device_rows_bytes)}) but a device has "
                           f"{_gb(cap)}")
            if self.host_capacity is not None and self.host_bytes_per_server > self.host_capacity:
                out.append(f"host memory: each node's shard server needs "
                           f"{_gb(self.host_bytes_per_server)} but a node has "
                           f"{_gb(self.host_capacity)}")
        elif self.host_capacity is not None and self.node_bytes_cpu > self.host_capacity:
            out.append(f"host memory (device=cpu: {self.ranks_per_node} ranks x "
                       f"{_gb(self.device_bytes_per_rank)} + shard server "
                       f"{_gb(self.host_bytes_per_server)}) = {_gb(self.node_bytes_cpu)} but a "
                       f"node has {_gb(self.host_capacity)}")
        return out

    @property
    def fits(self) -> bool:
        return not self.refusals


def _gb(n: int | float) -> str:
    return f"{n / GB:.3f} GB"


def format_plan(plan: Plan) -> str:
    up, down = plan.wire_bytes_per_rank_step
    g = min(plan.ranks_per_node, plan.world_size)
    lines = [
        f"hybridps plan: {plan.world_size} ranks = {plan.nodes} node(s) x {g} ranks, "
        f"batch {plan.batch_size}/rank, optimizer {plan.optimizer}, staleness {plan.staleness}"
        + (f", {plan.update_kind.flag}" if plan.update_kind.flag else ""),
        "tables:",
    ]
    for t in plan.tables:
        lines.append(f"  {t.name}: {t.num_rows:,} rows x {t.dim} dim, "
                     f"{t.lookups_per_sample:g} lookups/sample, {plan.placed(t)} -> "
                     f"{plan.rows_per_rank(t):,} rows/rank, <= {plan.touched_per_step(t):,} "
                     "rows pushed/rank/step")
    cap_dev = "?" if plan.device_capacity is None else _gb(plan.device_capacity)
    cap_host = "?" if plan.host_capacity is None else _gb(plan.host_capacity)
    lines.append(f"optimizer state: {describe_layout(plan.optimizer)} a row (D: per "
                 "element), " + ", ".join(
                     f"{4 * state_floats_per_row(plan.optimizer, d) / d:g} bytes/element at "
                     f"dim {d}" for d in sorted({t.dim for t in plan.tables}))
                 + (" (+ 4 for the fp32 master)" if plan.master_copies else ""))
    lines += [
        f"device bytes per rank ({plan.device_kind}): {_gb(plan.device_bytes_per_rank)} = rows "
        f"{_gb(plan.device_rows_bytes)} + optimizer state {_gb(plan.device_state_bytes)} + "
        f"step working set {_gb(plan.device_step_bytes)} (dense part, activations, framework "
        f"not included) [capacity {cap_dev}]",
        f"host bytes per shard server: {_gb(plan.host_bytes_per_server)} = {g} ranks x "
        f"(state {_gb(plan.host_state_bytes_per_rank)} + answer cache "
        f"{_gb(plan.host_cache_bytes_per_rank)}) [capacity {cap_host}]",
        f"wire bytes per step: per rank {up / 1e6:.3f} MB up + {down / 1e6:.3f} MB down; per "
        f"server {g * (up + down) / 1e6:.3f} MB; embedding all_to_all "
        f"{plan.a2a_bytes_per_rank_step / 1e6:.3f} MB per rank",
    ]
    if plan.device_kind == "cpu":
        lines.append(f"device=cpu: ranks and server share the host: {_gb(plan.node_bytes_cpu)} "
                     "per node")
    if plan.dense_choice is not None:
        size = ("size known once the task is built" if plan.dense_params is None
                else f"{plan.dense_params:,} parameters")
        lines.append(f"dense part: {size}, --dense-parallel {plan.dense_choice.describe()}")
    lines += [f"note: {n}" for n in plan.notes]
    refusals = plan.refusals
    lines.append("verdict: fits" if not refusals else "verdict: DOES NOT FIT: "
                 + "; ".join(refusals))
    return "\n".join(lines)


# -- from a worker config --------------------------------------------------------------

def table_shapes(cfg: TrainConfig, notes: list[str], world_size: int = 1
                 ) -> list[TableShape]:
    """The task's tables without building it, when it can say them (`plan_tables`); else
    those of the built task, with the rows it says one rank pushes a step at
    `world_size`."""
    from worker.tasks import build_task, task_class, task_tables

    cls = task_class(cfg.run.task)
    plan_tables = getattr(cls, "plan_tables", None)
    if plan_tables is not None:
        return [TableShape(t.name, t.num_rows, t.dim, float(lookups), sharding=t.sharding,
                           lookups=t.lookups)
                for t, lookups in plan_tables(cfg)]
    task = build_task(cfg)
    pushed = task.rows_pushed_per_step(world_size) or {}
    notes.append(f"task {cfg.run.task!r} has no plan_tables(): it was built to read its tables "
                 "(its data loaded); " + ("the rows it pushes a step are its own figure"
                                          if pushed else "1 lookup per sample assumed"))
    return [TableShape(t.name, t.num_rows, t.dim, pushed_per_step=pushed.get(t.name),
                       sharding=t.sharding, lookups=t.lookups) for t in task_tables(task)]


@functools.cache
def placement(tables: tuple[TableShape, ...], world_size: int, default: str
              ) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each table's scheme and cut points, as the worker places them (worker/embedding/
    sharding.py place_tables, over the same costs); {} when every table is row-wise."""
    if all((t.sharding or default) == "row_wise" for t in tables):
        return {}
    from worker.embedding.sharding import TableCost, place_tables

    schemes = place_tables([TableCost(t.name, t.num_rows, t.dim, t.lookups,
                                      t.sharding or default) for t in tables], world_size)
    return {t.name: (schemes[t.name].name, tuple(schemes[t.name].cuts(t.num_rows, world_size)))
            for t in tables}


def detect_device(device_request: str, local_rank: int) -> tuple[str, int | None]:
    """('cuda', bytes of the device) or ('cpu', None), like worker.runtime.dist.pick_device."""
    if device_request == "cpu":
        return "cpu", None
    import torch

    if device_request == "cuda" or torch.cuda.is_available():
        if torch.cuda.is_available() and local_rank < torch.cuda.device_count():
            return "cuda", int(torch.cuda.get_device_properties(local_rank).total_memory)
        return "cuda", None
    return "cpu", None


def plan_for_config(cfg: TrainConfig, *, world_size: int | None = None,
                    ranks_per_node: int | None = None, local_rank: int | None = None,
                    detect: bool = True, device_kind: str | None = None) -> Plan:
    """The plan of `cfg` on this launch's layout (torchrun env) unless given; the device
    and host are this machine's unless `detect` is False (`device_kind` then says which:
    by default cuda unless --device cpu)."""
    env = os.environ
    world = world_size or int(env.get("WORLD_SIZE", "1") or 1)
    per_node = ranks_per_node or int(env.get("LOCAL_WORLD_SIZE", "0") or 0) or world
    local = local_rank if local_rank is not None else int(env.get("LOCAL_RANK", "0") or 0)
    notes: list[str] = []
    plan = Plan(table_shapes(cfg, notes, world), world, per_node, cfg.run.batch_size,
                cfg.optim.optimizer, cfg.sync.staleness, cfg.sync.update_kind, notes=notes,
                row_bytes=2 if cfg.optim.row_dtype == "bf16" else FLOAT_BYTES,
                sharding=cfg.run.sharding)
    if detect:
        kind, detected = detect_device(cfg.run.device, local)
    else:
        kind = device_kind or ("cpu" if cfg.run.device == "cpu" else "cuda")
        detected = None
    plan.device_kind = kind
    sizing = cfg.sizing
    if sizing.device_memory_gb > 0:
        plan.device_capacity = int(sizing.device_memory_gb * GB)
        if kind == "cpu":
            notes.append("--device-memory-gb is ignored on device=cpu (the host is the device)")
    else:
        plan.device_capacity = detected
    if sizing.host_memory_gb > 0:
        plan.host_capacity = int(sizing.host_memory_gb * GB)
    elif detect:
        plan.host_capacity = detect_host_memory()
    plan.dense_params, plan.dense_choice = dense_plan(cfg, plan)
    return plan


def dense_plan(cfg: TrainConfig, plan: Plan) -> tuple[int | None, DenseChoice]:
    """(the dense part's parameters, the --dense-parallel choice) on the plan's layout: the
    run's rule (worker/dense/policy.py) on fp32 parameters, the plan's memory per rank and
    the backend of its device. A task that cannot say its dense size without being built:
    the choice made as for the smallest dense part (the run decides on the real one)."""
    from worker.dense.policy import DenseFacts, choose_dense_parallel, state_copies
    from worker.tasks import task_class

    params = task_class(cfg.run.task).plan_dense_parameters(cfg)
    memory = (plan.device_capacity if plan.device_kind == "cuda" else
              None if plan.host_capacity is None else plan.host_capacity // plan.ranks_per_node)
    facts = DenseFacts(param_bytes=FLOAT_BYTES * (params or 0),
                       state_copies=state_copies(cfg.optim.dense_kind),
                       world_size=plan.world_size,
                       backend="nccl" if plan.device_kind == "cuda" else "gloo",
                       memory_per_rank=memory)
    return params, choose_dense_parallel(cfg.dense, facts)


# -- `python -m worker.plan`: sizing without a cluster -------------------------------

DESCRIPTION = """\
Memory and traffic of a job on a cluster you do not have yet: no server, no torchrun.

  python -m worker.plan --world-size 16 --nodes 2 --task dlrm --batch-size 4096 \\
      --device-memory-gb 80 --host-memory-gb 512
      the job of these worker flags (worker/main.py's; --ps is not needed) on 16 ranks
      over 2 nodes: bytes per GPU, per shard server, on the wire, and the commands to run
      it (or the layout and flags that would fit)
  python -m worker.plan --rows 1000000000 --dim 128 --nodes 8 --ranks-per-node 8
      one table (docs/deploy.md's worked example)
"""


def _layout_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m worker.plan", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Any other flag is the worker's (python "
                                     "worker/main.py --help) and describes the job.")
    parser.add_argument("--world-size", type=int, default=0,
                        help="ranks (GPUs) in all (default: nodes x ranks per node)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes, one shard server each")
    parser.add_argument("--ranks-per-node", type=int, default=0,
                        help="GPUs per node (default: world size / nodes; --rows: 8)")
    parser.add_argument("--rows", type=int, default=0,
                        help="plan one table of this many rows instead of a worker job")
    return parser


def _table_parser() -> argparse.ArgumentParser:
    """The one-table calculator's own flags (with --rows)."""
    parser = argparse.ArgumentParser(prog="python -m worker.plan --rows R")
    parser.add_argument("--dim", type=int, required=True, help="embedding width")
    parser.add_argument("--batch-size", type=int, default=4096, help="samples per rank/step")
    parser.add_argument("--lookups", type=float, default=1.0, help="lookups per sample")
    parser.add_argument("--optimizer", choices=kind_names(), default="adam")
    parser.add_argument("--staleness", type=int, default=1)
    parser.add_argument("--row-dtype", choices=("fp32", "bf16"), default="fp32",
                        help="dtype of the rows on the device (bf16: + fp32 master on the host)")
    parser.add_argument("--device-memory-gb", type=float, default=0.0)
    parser.add_argument("--host-memory-gb", type=float, default=0.0)
    return parser


def layout(world_size: int, nodes: int, ranks_per_node: int) -> tuple[int, int]:
    """(world size, ranks per node) from what was given; ValueError naming a mismatch."""
    if min(nodes, world_size, ranks_per_node) < 0 or nodes < 1:
        raise ValueError(f"--world-size {world_size}, --nodes {nodes}, --ranks-per-node "
                         f"{ranks_per_node}: each must be >= 1")
    if world_size and ranks_per_node and world_size != nodes * ranks_per_node:
        raise ValueError(f"--world-size {world_size} is not --nodes {nodes} x "
                         f"--ranks-per-node {ranks_per_node}")
    if world_size:
        if world_size % nodes:
            raise ValueError(f"--world-size {world_size} does not split evenly over --nodes "
                             f"{nodes}: give a multiple of {nodes}")
        return world_size, world_size // nodes
    if ranks_per_node:
        return nodes * ranks_per_node, ranks_per_node
    raise ValueError("give --world-size N (and --nodes M), or --nodes M --ranks-per-node G")


def fitting_changes(plan: Plan) -> list[str]:
    """What would make a plan that does not fit fit: more nodes of the same size, bf16 rows."""
    out: list[str] = []
    if plan.fits:
        return out
    per_node = min(plan.ranks_per_node, plan.world_size)
    for nodes in range(plan.nodes + 1, 4097):
        bigger = dataclasses.replace(plan, world_size=nodes * per_node, notes=[])
        if bigger.fits:
            out.append(f"{nodes} nodes x {per_node} ranks (--world-size {nodes * per_node} "
                       f"--nodes {nodes}) fit")
            break
    if plan.row_bytes == FLOAT_BYTES:
        half = dataclasses.replace(plan, row_bytes=2, notes=[])
        if half.fits:
            out.append("--row-dtype bf16 fits (rows in bf16 on the device, an fp32 master "
                       "on the shard server)")
    if not plan.update_kind.needs_server:
        served = dataclasses.replace(plan, update_kind=kind_named("server"), notes=[])
        if served.fits:
            out.append(f"a shard server per node instead of {plan.update_kind.flag} fits "
                       "(m, v off the device)")
    return out or ["nothing simple: fewer or smaller tables, or bigger machines"]


def run_commands(plan: Plan, worker_flags: Sequence[str]) -> list[str]:
    """The commands that run the planned job: a shard server per node, then the ranks."""
    per_node = min(plan.ranks_per_node, plan.world_size)
    flags = " ".join(shlex.quote(f) for f in worker_flags)
    # the server refuses a Register beyond --max-state-bytes, by default 3/4 of its host's
    # memory: raised, with headroom over the plan, where that default may be too low
    max_state = math.ceil(plan.host_bytes_per_server * 1.25 / GB) * GB
    default_ok = (plan.host_capacity is not None
                  and max_state <= SERVER_STATE_SHARE * plan.host_capacity)
    server_limit = ("" if not plan.update_kind.needs_server or default_ok
                    else f" --max-state-bytes {max_state}")
    if plan.nodes == 1:
        server = f"python -m ps --port 50051{server_limit}"
        ps = "127.0.0.1:50051"
        launch = f"hybridps-run --standalone --nproc_per_node {per_node}"
    else:
        server = (f"python -m ps --host 0.0.0.0 --port 50051 --auth-token-file ps.token "
                  f"--generate-auth-token true{server_limit}")
        ps = ",".join(f"NODE{i}:50051" for i in range(plan.nodes))
        launch = (f"hybridps-run --nnodes {plan.nodes} --nproc_per_node {per_node} "
                  "--rdzv-backend c10d --rdzv-endpoint NODE0:29400")
        flags = f"--auth-token-file ps.token {flags}".strip()
    lines = ["to run it (docs/deploy.md):"]
    where = "on the node" if plan.nodes == 1 else "on each node"
    if plan.update_kind.needs_server:
        lines += [f"  {where}, its shard server:", f"    {server}"]
        flags = f"--ps {ps} {flags}".strip()
    lines += [f"  {where}, its ranks:", f"    {launch} \\",
              f"        worker/main.py {flags}".rstrip()]
    if plan.nodes > 1:
        lines.append("  (NODE0, NODE1, ...: the nodes' host names; every node shares ps.token)")
    return lines


def _worker_flags(argv: Sequence[str]) -> list[str]:
    """The worker flags that describe the job (the plan's own and --ps left out)."""
    out: list[str] = []
    skip = False
    for token in argv:
        if skip:
            skip = False
            continue
        name = token.split("=", 1)[0]
        if name in ("--ps", "--plan", "--device-memory-gb", "--host-memory-gb"):
            skip = "=" not in token and name != "--plan"
            continue
        out.append(token)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parser = _layout_parser()
    given, rest = parser.parse_known_args(args)
    if given.rows:
        return _one_table(parser, given, rest)
    from hybridps.cli import parse_config
    from worker.config.task_defaults import task_defaults
    from worker.config.train_config import TrainConfig

    try:
        world, per_node = layout(given.world_size, given.nodes, given.ranks_per_node)
    except ValueError as exc:
        parser.error(str(exc))
    cfg = parse_config(TrainConfig, [*rest, "--plan"], prog="python -m worker.plan",
                       defaults=task_defaults)
    try:
        plan = plan_for_config(cfg, world_size=world, ranks_per_node=per_node, detect=False)
    except PlanError as exc:
        print(f"python -m worker.plan: error: {exc}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    if plan.fits:
        print("\n".join(run_commands(plan, _worker_flags(rest))))
        return 0
    print("would fit: " + "; ".join(fitting_changes(plan)))
    return 1


def _one_table(parser: argparse.ArgumentParser, given: argparse.Namespace,
               rest: list[str]) -> int:
    args = _table_parser().parse_args(rest)
    try:
        world, per_node = layout(given.world_size, given.nodes, given.ranks_per_node or
                                 (0 if given.world_size else 8))
    except ValueError as exc:
        parser.error(str(exc))
    if min(given.rows, args.dim, args.batch_size) < 1:
        parser.error("--rows, --dim, --batch-size must be >= 1")
    plan = Plan([TableShape("table", given.rows, args.dim, args.lookups)], world, per_node,
                args.batch_size, args.optimizer, args.staleness, kind_named("server"),
                device_kind="cuda", device_capacity=int(args.device_memory_gb * GB) or None,
                host_capacity=int(args.host_memory_gb * GB) or None,
                row_bytes=2 if args.row_dtype == "bf16" else FLOAT_BYTES)
    print(format_plan(plan))
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
