"""Row updates on the training thread: sources, the buffer, and the staleness window.

Two sources of row updates share one interface (`UpdateSource`):
- `worker.sync.client.ShardClient`: the node's shard server (Register, then the Sync stream),
  read on the training thread;
- `LocalSparseOptimizer` (--local-optimizer): the same hybridps.optim kernels run
  in-process, the optimizer's state on the device, no server.
Both fill an `UpdateBuffer`; `StalenessWindow` decides, at each step boundary on the
training thread, which updates are due and applies them to the local rows.

Staleness contract (K = --staleness): before the forward of step t, every
update of steps <= t-1-K is applied to the local rows, and no newer one:
updates are applied exactly in step order (tables in task order), whatever
the timing, so a run is a deterministic function of its config. K=0 is
fully synchronous (and equal to a plain single-process trainer).

No gRPC here: the errors a source raises (`SyncError` and its kinds) name the server
and the step, and the transport lives in worker/sync/client.py.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridps.checkpoint import ShardInfo
from hybridps.optim import OptimizerSpec, apply_update_, step_rows_
from hybridps.paged_rows import PagedOut, PagedRows
from hybridps.paged_spill import drop_over_quota
from hybridps.spilled_rows import HeldRows, RowColumns
from hybridps.state_alloc import alloc_row_state
from worker.embedding.sharded import ShardedEmbedding
from worker.updates.local_spill import (
    MASTER,
    LocalBudget,
    PagedBound,
    SpillDir,
    held_bytes,
    plan_frames,
    plan_paged,
    spill_disk_bytes,
)
from worker.updates.local_state import local_state_rows, restore_local_state, save_local_state
from worker.updates.staleness import RowPredictor

# unit (worker/embedding/groups.py: a group of tables of one width, or a table alone) -> (ids_U unit
# row ids, grads_UD)
Grads = dict[str, tuple[torch.Tensor, torch.Tensor]]
# table -> kind ("optim"; a dynamic table also "paged") -> the checkpoint file written
SavedFiles = dict[str, dict[str, ShardInfo]]
# a checkpoint's hold: what is passed in as it is now, for a write that may run later
Hold = Callable[[Any], Any]


class SyncError(RuntimeError):
    """The sparse optimizer side failed; the message names the server and the step."""


class ServerTimeout(SyncError):
    """An update (or registration) did not arrive within --ps-timeout."""


class ServerUnavailable(SyncError):
    """The shard server stayed unreachable for longer than --ps-timeout."""


class ServerRefused(SyncError):
    """The shard server refused a request (not retryable)."""


@dataclass
class RowUpdate:
    """rows[ids] = rows[ids] * decay + delta for one (step, unit): `table` names a unit
    (worker/embedding/groups.py), its ids are unit row ids (a table alone: its global row ids).

    `rows` (bf16 rows with an fp32 master): delta_UD holds the new rows, rows[ids] = delta.
    """

    step: int
    table: str
    ids_U: torch.Tensor    # int64 unit row ids, inside the owned range
    delta_UD: torch.Tensor
    decay: float
    duplicate: bool = False
    rows: bool = False


@dataclass
class SyncStats:
    # pushes and updates of tables (a group's push or update counts for each of its
    # tables); unit_pushes/unit_updates: the pushes and updates sent (one per group)
    pushes: int = 0
    unit_pushes: int = 0
    unit_updates: int = 0
    push_chunks: int = 0
    push_bytes: int = 0
    push_rows: int = 0
    updates: int = 0
    update_chunks: int = 0
    duplicates: int = 0
    ignored_updates: int = 0
    registers: int = 0
    reconnects: int = 0
    errors: list[str] = field(default_factory=list)
    # Same-node shared memory (worker/sync/arena.py): "off", "on", or "inline: <why not>".
    shm: str = "off"
    shm_pushes: int = 0        # pushes sent by reference into the arena
    shm_bytes: int = 0         # their tensor bytes (ids, gradients, answers) in the arena
    shm_inline_pushes: int = 0  # pushes sent inline while shm was on (the arena was full)
    shm_batches: int = 0       # messages carrying a step's shm pushes of several tables
    #                            (a group's push: of its tables)
    # The Sync transport (worker/sync/transport.py): "stream", the gRPC Sync stream
    transport: str = "stream"
    # --local-optimizer under --local-memory-budget-mb (worker/updates/local_spill.py): the
    # budget's split (state, master and paged rows' bytes in memory, bytes on disk) and
    # the page counters; empty without a budget
    local_memory: dict[str, Any] = field(default_factory=dict)


class UpdateBuffer:
    """Complete updates by step, handed to the training thread in step order.

    Filled by the producer (the shard client's answers or the local optimizer),
    drained by `take` on the training thread; `fail` wakes a waiting `take` with the
    producer's error.
    """

    def __init__(self, tables: Sequence[str]) -> None:
        self.tables = list(tables)
        self._cond = threading.Condition()
        self._ready: dict[int, dict[str, RowUpdate]] = {}
        self._next = 0       # the next step `take` hands out
        self._arrived = -1   # every table of every step <= _arrived has arrived
        self._fatal: SyncError | None = None

    def put(self, update: RowUpdate) -> None:
        with self._cond:
            self._ready.setdefault(update.step, {})[update.table] = update
            while len(self._ready.get(self._arrived + 1, ())) == len(self.tables):
                self._arrived += 1
            self._cond.notify_all()

    def fail(self, exc: SyncError) -> None:
        with self._cond:
            if self._fatal is None:
                self._fatal = exc
            self._cond.notify_all()

    @property
    def fatal(self) -> SyncError | None:
        return self._fatal

    def start_at(self, step: int) -> None:
        """Resume: steps <= `step` are done (in the restored rows); `take` continues after."""
        with self._cond:
            self._next = step + 1
            self._arrived = step

    @property
    def arrived_through(self) -> int:
        return self._arrived

    def missing(self, step: int) -> list[str]:
        with self._cond:
            return [t for t in self.tables if t not in self._ready.get(step, {})]

    def _wait_arrived(self, through_step: int, timeout_s: float,
                      describe_wait: Callable[[int, float], str]) -> bool:
        """With the lock held: until every update through `through_step` arrived; blocked?"""
        blocked = False
        deadline: float | None = None
        while self._arrived < through_step:
            if self._fatal is not None:
                raise self._fatal
            now = time.monotonic()
            if deadline is None:
                deadline = now + timeout_s
                blocked = True
            elif now >= deadline:
                raise ServerTimeout(describe_wait(self._arrived + 1, timeout_s))
            self._cond.wait(deadline - now)
        return blocked

    def take(self, through_step: int, timeout_s: float,
             describe_wait: Callable[[int, float], str]) -> tuple[list[RowUpdate], bool]:
        """Every update of steps [next, through_step], in (step, table) order.

        Blocks until they have all arrived; returns (updates, blocked?). Raises
        the producer's error, or ServerTimeout after `timeout_s` without them.
        """
        with self._cond:
            blocked = self._wait_arrived(through_step, timeout_s, describe_wait)
            out: list[RowUpdate] = []
            for step in range(self._next, through_step + 1):
                row = self._ready.pop(step)
                out.extend(row[t] for t in self.tables)
            self._next = max(self._next, through_step + 1)
        return out, blocked

    def peek(self, through_step: int, timeout_s: float,
             describe_wait: Callable[[int, float], str]) -> list[RowUpdate]:
        """Every update of steps [next, through_step], in (step, table) order, left in the
        buffer (a checkpoint saves the updates that are not in the rows yet). Waits like
        `take`."""
        with self._cond:
            self._wait_arrived(through_step, timeout_s, describe_wait)
            return [self._ready[step][t] for step in range(self._next, through_step + 1)
                    for t in self.tables]

    def restore_pending(self, applied_through: int, updates: Sequence[RowUpdate]) -> None:
        """Resume: steps <= `applied_through` are in the rows, `updates` (every table of each
        step after it, through the checkpoint's step) arrived and wait to be applied."""
        with self._cond:
            self._ready.clear()
            self._next = applied_through + 1
            self._arrived = applied_through
            for update in updates:
                if update.step <= applied_through:
                    raise ValueError(f"pending update of step {update.step} (table "
                                     f"{update.table!r}) is not after step {applied_through}")
                self._ready.setdefault(update.step, {})[update.table] = update
            for step in sorted(self._ready):
                missing = [t for t in self.tables if t not in self._ready[step]]
                if step != self._arrived + 1 or missing:
                    raise ValueError(f"pending updates: step {step} "
                                     + (f"lacks tables {missing}" if missing else
                                        f"follows step {self._arrived}"))
                self._arrived = step


class UpdateSource(ABC):
    """Where pushes go and row updates come from (the server or in-process)."""

    def __init__(self, tables: Sequence[str], timeout_s: float) -> None:
        self.buffer = UpdateBuffer(tables)
        self.timeout_s = timeout_s
        self.stats = SyncStats()
        # unit -> the tables it carries (worker/embedding/groups.py; absent: 1): the stats count the
        # tables' pushes and updates, like those of separate tables
        self.tables_in: dict[str, int] = {}

    def start(self) -> None:  # noqa: B027 - optional hook
        """Connect/register; called once before the first push."""

    def server_security(self) -> Any:
        """The credentials this source talks to its shard server with (None: no server)."""
        return None

    @abstractmethod
    def push(self, step: int, grads: Grads, lr: float | None = None) -> None:
        """Hand over the coalesced gradients of every table for `step` (never blocks).
        `lr`: the rows' learning rate for this step (None: the registered one)."""

    def poll(self) -> None:  # noqa: B027 - optional hook
        """Mid-step: hand on what became ready since the push (never blocks; the shard
        client sends the pushes whose gradients reached the host: worker/runtime/device_copy.py)."""

    def take(self, through_step: int) -> tuple[list[RowUpdate], bool]:
        return self.buffer.take(through_step, self.timeout_s, self.describe_wait)

    def peek(self, through_step: int) -> list[RowUpdate]:
        return self.buffer.peek(through_step, self.timeout_s, self.describe_wait)

    def describe_wait(self, step: int, timeout_s: float) -> str:
        return f"no update for step {step} after {timeout_s:g}s"

    def finish(self, last_step: int) -> None:  # noqa: B027 - optional hook
        """After every update through `last_step` was taken: confirm with the source."""

    def end_run(self, last_step: int, aborted: bool = False, reason: str = "") -> bool:
        """Tell the source this rank is done with the run (server: Finish). True if told."""
        return True

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections/threads; safe to call twice and after errors."""

    # -- checkpoints: each source saves and restores its own optimizer state -------------
    def snapshot_to(self, directory: Path, step: int, hold: Hold,
                    since: int | None = None) -> Callable[[], SavedFiles]:
        """The sparse optimizer state of step `step` (every push <= step applied), held
        through `hold` (a checkpoint's: worker/checkpoint/writer.py), and the write of it
        into checkpoint `directory`, in hybridps/checkpoint.py's optim file format (a
        dynamic table also its paged-out rows, hybridps/dynamic_files.py); it returns the files
        written, per table and kind ("optim", "paged"). `since` S: incremental, the
        optim files may be delta shards of the rows changed since the checkpoint of S
        (the previous one this source snapshotted)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no checkpointable state")

    def restore_from(self, directory: Path, step: int) -> None:
        """Load the sparse optimizer state of checkpoint `directory` (step `step`) for the
        rows this rank owns now (any world size), before the first push."""
        raise NotImplementedError(f"{type(self).__name__} keeps no checkpointable state")


class LocalSparseOptimizer(UpdateSource):
    """--local-optimizer: the shard server's kernels (hybridps.optim) run in-process.

    One optimizer step count per table advancing on every push (exactly like
    the server and torch.optim.SparseAdam); the optimizer's state (by the names of
    spec.state_layout(), laid out like the server's) lives on the rows' device. It runs per
    unit (worker/embedding/groups.py): one kernel call a step for a group of tables, whose step
    count is every member's.
    Updates are computed at push time and applied by the StalenessWindow at
    the same step boundaries as server updates, so results match the server
    path for every --staleness.

    bf16 rows (--row-dtype bf16): like the server, an fp32 master copy of the
    rows (next to m and v, on the rows' device) takes the optimizer steps and
    the updates are the new rows rounded to bf16. This mode is the in-process
    reference, so it keeps the fp32 state where the rows are: it saves no
    device memory (2 + 4 bytes per element + the state: 8 for adam), the server mode does.

    `budget` (--local-memory-budget-mb, worker/updates/local_spill.py): beyond it a unit's
    state and master rows are `SpilledRows` on the host, paged to this rank's spill
    directory; `state` and `masters` then hold only the units kept whole. Every access
    goes through `columns[unit].view`. A dynamic table's paged-out rows are bounded by the
    same budget (`paged_bounds`: a quota, past it drops, and their payload spilled within
    --local-spill-max-gb).
    """

    def __init__(self, embedding: ShardedEmbedding, spec: OptimizerSpec,
                 timeout_s: float = 60.0, budget: LocalBudget | None = None) -> None:
        super().__init__(list(embedding.units), timeout_s)
        self.embedding, self.spec = embedding, spec
        self.tables_in.update({n: len(u.members) for n, u in embedding.units.items()})
        # per unit: the state (name -> [rows, width]) and (bf16 rows only) the fp32 master
        # rows, laid out like its block
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        self.masters: dict[str, torch.Tensor] = {}
        self.counts = dict.fromkeys(embedding.units, 0)
        # per unit, the rows whose state a push changed since the last checkpoint
        self.changed = {name: torch.zeros(u.rows, dtype=torch.bool, device=embedding.device)
                        for name, u in embedding.units.items()}
        # dynamic tables (docs/dynamic_ids.md): the rows paged out of their slots, with
        # their optimizer state, in host memory
        self.paged = {name: PagedRows(t.dim, spec.state_widths(t.dim))
                      for name, t in embedding.tables.items() if t.dynamic is not None}
        self.budget = budget or LocalBudget()
        layouts = {name: [*spec.state_widths(w.shape[1]), *(
            [(MASTER, w.shape[1])] if w.dtype != torch.float32 else [])]
            for name, w in embedding.weights.items()}
        units = [(n, int(embedding.weights[n].shape[0]), layout)
                 for n, layout in layouts.items()]
        what = f"rank {embedding.rank}"
        frames = plan_frames(units, self.budget, what, dynamic=bool(self.paged))
        held = {n: held_bytes(rows, layout, frames[n], self.budget)
                for n, rows, layout in units}
        self.paged_bounds: dict[str, PagedBound] = plan_paged(
            [(n, store, embedding.units[n].rows, held[n]) for n, store in self.paged.items()],
            self.budget, sum(held.values()),
            spill_disk_bytes([u for u in units if frames[u[0]]], self.budget), what)
        self.spill_dir = (SpillDir(self.budget.spill_dir, embedding.rank)
                          if self.budget.spill_dir else None)
        # per dynamic table whose paged payload spills: its holder (module doc of
        # local_spill.py)
        self.paged_payloads: dict[str, RowColumns] = {}
        for name, bound in self.paged_bounds.items():
            store = self.paged[name]
            if bound.quota:
                store.set_quota(bound.quota, embedding.units[name].rows)
            if bound.frames:
                assert self.spill_dir is not None
                payload = self.spill_dir.payload(store, self.budget, bound.frames)
                store.spill_payload(payload)
                self.paged_payloads[name] = payload
        # per unit: its row columns (the state and master rows: HeldRows of the tensors
        # above, or SpilledRows on the host)
        self.columns: dict[str, RowColumns] = {}
        for name, weight in embedding.weights.items():
            rows = int(weight.shape[0])
            if frames[name]:
                assert self.spill_dir is not None
                self.columns[name] = self.spill_dir.columns(layouts[name], rows, self.budget,
                                                            frames[name])
            else:
                self.state[name] = alloc_row_state(spec.state_widths(weight.shape[1]),
                                                   rows, weight.device)
            if weight.dtype != torch.float32:
                blocks = [rows for _, rows in embedding.initial_row_blocks(name)]
                master = (torch.cat(blocks) if blocks else torch.empty(0, weight.shape[1]))
                if frames[name]:
                    self.columns[name].write(0, {MASTER: master})
                else:
                    self.masters[name] = master.to(weight.device)
            if not frames[name]:
                self.columns[name] = HeldRows({**self.state[name], **(
                    {MASTER: self.masters[name]} if name in self.masters else {})})
        self._report_memory()

    @property
    def moments(self) -> dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]:
        """Per unit kept whole: the state named m and v (adam, adamw; None where the
        optimizer keeps no such state)."""
        return {name: (state.get("m"), state.get("v")) for name, state in self.state.items()}

    @torch.no_grad()
    def push(self, step: int, grads: Grads, lr: float | None = None) -> None:
        spec = self.spec if lr is None else dataclasses.replace(self.spec, lr=lr)
        for name in self.buffer.tables:
            ids_U, grads_UD = grads[name]
            start = self.embedding.units[name].start
            self.counts[name] += 1
            self.changed[name].index_fill_(0, ids_U - start, True)
            self.stats.pushes += self.tables_in[name]
            self.stats.push_rows += int(ids_U.numel())
            self.stats.updates += self.tables_in[name]
            self.stats.unit_pushes += 1
            self.stats.unit_updates += 1
            self.buffer.put(self._step_unit(spec, step, name, ids_U, grads_UD))
        if self.budget.memory_bytes:
            self._report_memory()

    def _step_unit(self, spec: OptimizerSpec, step: int, name: str, ids_U: torch.Tensor,
                   grads_UD: torch.Tensor) -> RowUpdate:
        """One optimizer step of unit `name`, on its columns where they are (a spilled
        unit's frames are on the host: rows on a device step a gathered copy there and
        write it back, the same math on the same device as the tensors unbounded)."""
        columns = self.columns[name]
        local_U = ids_U - self.embedding.units[name].start
        spilled = not isinstance(columns, HeldRows)
        cols, at_U = columns.view(local_U.cpu() if spilled else local_U)
        device = grads_UD.device
        moved = spilled and device.type != "cpu"
        frames = cols
        if moved:  # the frames' rows of this push, on the rows' device
            cols = {n: t.index_select(0, at_U).to(device) for n, t in frames.items()}
            at = torch.arange(int(at_U.numel()), device=device)
        else:
            at = at_U
        state = {n: t for n, t in cols.items() if n != MASTER}
        delta_UD, decay = step_rows_(spec, state, at, grads_UD, self.counts[name])
        master_RD = cols.get(MASTER)
        rows_UD = None
        if master_RD is not None:  # the shard server's master-rows math (ps/core/partition.py)
            apply_update_(master_RD, at, delta_UD, float(decay))
            rows_UD = master_RD.index_select(0, at).to(self.embedding.row_dtype)
        if moved:
            for n, t in cols.items():
                frames[n].index_copy_(0, at_U, t.cpu())
        if rows_UD is not None:
            return RowUpdate(step, name, ids_U, rows_UD.to(device), 0.0, rows=True)
        return RowUpdate(step, name, ids_U, delta_UD, float(decay))

    def _report_memory(self) -> None:
        """SyncStats.local_memory: the budget's split (module doc of local_spill.py)."""
        if not self.budget.memory_bytes:
            return
        state = master = disk = 0
        counters: dict[str, int] = {}
        for columns in self.columns.values():
            widths = dict(columns.layout)
            total = sum(widths.values()) or 1
            held = columns.memory_bytes
            part = held * widths.get(MASTER, 0) // total
            master += part
            state += held - part
            disk += columns.disk_bytes
            for key, value in columns.counters().items():
                counters[key] = counters.get(key, 0) + value
        paged_disk = sum(p.disk_bytes for p in self.paged_payloads.values())
        for payload in self.paged_payloads.values():
            for key in ("fills", "spills"):
                counters[f"paged_{key}"] = (counters.get(f"paged_{key}", 0)
                                            + payload.counters().get(key, 0))
        self.stats.local_memory = {
            "budget_bytes": self.budget.memory_bytes, "state_bytes": state,
            "master_bytes": master,
            "paged_bytes": sum(p.memory_bytes for p in self.paged.values()),
            "paged_quota_bytes": sum(b.quota for b in self.paged_bounds.values()),
            "paged_rows": sum(len(p) for p in self.paged.values()),
            "paged_dropped": sum(p.dropped for p in self.paged.values()),
            "paged_disk_bytes": paged_disk,
            "disk_bytes": disk + paged_disk,
            "spilled_units": sorted(n for n, c in self.columns.items()
                                    if not isinstance(c, HeldRows)),
            **counters}

    def snapshot_to(self, directory: Path, step: int, hold: Hold,
                    since: int | None = None) -> Callable[[], SavedFiles]:
        """The same files the shard server writes (worker/updates/local_state.py); the
        changed marks restart with the snapshot (the next pushes are the next delta)."""
        dynamic = self.embedding.dynamic
        looked = {} if since is None or dynamic is None else {
            name: torch.from_numpy(dynamic.looked_up_since(name, since)) for name in self.paged}
        rows = hold(local_state_rows(emb=self.embedding, columns=self.columns,
                                     dynamic=looked,
                                     changed=None if since is None else self.changed))
        paged = {name: hold(store.checkpoint_state(step, since))
                 for name, store in self.paged.items()}
        counts = dict(self.counts)
        for flags in self.changed.values():
            flags.zero_()
        emb, spec = self.embedding, self.spec
        return lambda: save_local_state(directory, step, rank=emb.rank, emb=emb, spec=spec,
                                        rows=rows, counts=counts, paged=paged)

    def restore_from(self, directory: Path, step: int) -> None:
        restore_local_state(directory, step, emb=self.embedding, spec=self.spec,
                            columns=self.columns, counts=self.counts, paged=self.paged)

    def close(self) -> None:
        """Remove this rank's spill files (a cache: checkpoints hold their state)."""
        for columns in self.columns.values():
            columns.close()
        for store in self.paged.values():
            store.close()
        if self.spill_dir is not None:
            self.spill_dir.close()

    # -- dynamic tables: the RowPager of worker/embedding/dynamic/ids.py, in-process ---
    @torch.no_grad()
    def page(self, table: str, step: int, out: PagedOut, out_slots: torch.Tensor,
             in_ids: torch.Tensor, in_slots: torch.Tensor, expire_steps: int,
             counters: Mapping[str, int] | None = None
             ) -> tuple[torch.Tensor, PagedOut, np.ndarray]:
        start = self.embedding.units[table].start
        store = self.paged[table]
        columns = self.columns[table]
        out_R, in_R = out_slots - start, in_slots - start
        if isinstance(columns, HeldRows):
            found, got = store.swap(out, out_R, in_ids, in_R, self.state[table])
        else:  # the frames of both sides' rows, resident for the call
            cols, at = columns.view(torch.cat([out_R, in_R]).cpu())
            k = int(out_R.numel())
            found, got = store.swap(out, at[:k], in_ids, at[k:], cols)
        dropped = store.expire(step, expire_steps)
        quota = self.paged_bounds[table].quota
        if quota:  # the budget's share (module doc of local_spill.py), as the server's
            dropped = np.concatenate([dropped, drop_over_quota(store, quota, step)])
        return found, got, dropped

    def peek_paged(self, table: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.paged[table].peek(ids)

    def local_store(self, table: str) -> tuple[PagedRows, Mapping[str, torch.Tensor]] | None:
        """None for a spilled unit (its slots' state is not one tensor a row per slot) and
        for a bounded store (its drops and spilled payload are the reference step's): the
        fused step (worker/embedding/dynamic/fused.py) leaves them to the reference path."""
        if not isinstance(self.columns[table], HeldRows) or self.paged_bounds[table].quota:
            return None
        return self.paged[table], self.state[table]


@dataclass
class StalenessStats:
    steps: int = 0
    applied_sum: int = 0
    applied_max: int = 0
    lag_sum: int = 0
    lag_max: int = 0
    waits: int = 0
    wait_s: float = 0.0
    updates_applied: int = 0
    histogram: dict[int, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        n = max(self.steps, 1)
        return {"applied_mean": self.applied_sum / n, "applied_max": self.applied_max,
                "arrival_lag_mean": self.lag_sum / n, "arrival_lag_max": self.lag_max,
                "waits": self.waits, "wait_fraction": self.waits / n, "wait_s": self.wait_s,
                "updates_applied": self.updates_applied,
                "histogram": {str(k): v for k, v in sorted(self.histogram.items())}}


class StalenessWindow:
    """Applies due updates at step boundaries, on the training thread.

    Before step t: take and apply every update of steps <= t-1-K (waiting for
    them if needed), none newer. Observed staleness of step t = steps whose
    updates are not in the rows yet = t-1 - newest applied step (K after the
    first K steps); arrival lag = t-1 - newest step fully answered (how far
    behind the server actually was); a wait = the step had to block.
    """

    def __init__(self, source: UpdateSource, embedding: ShardedEmbedding, staleness: int,
                 predictor: RowPredictor | None = None) -> None:
        self.source, self.embedding, self.staleness = source, embedding, staleness
        # --staleness-compensation predict (worker/updates/staleness.py): the forward's view only
        self.predictor = predictor
        self.applied_through = -1
        self.stats = StalenessStats()
        self.last_applied_staleness = 0

    def _apply_through(self, step: int) -> bool:
        if step <= self.applied_through:
            return False
        t0 = time.perf_counter()
        updates, blocked = self.source.take(step)
        if blocked:
            self.stats.waits += 1
            self.stats.wait_s += time.perf_counter() - t0
        predictor = self.predictor
        for u in updates:
            if not u.rows:
                effect_UD = self.embedding.apply_update(u.table, u.ids_U, u.delta_UD, u.decay,
                                                        measure=predictor is not None)
                if predictor is not None and effect_UD is not None:
                    predictor.measured(u.table, u.ids_U, effect_UD)
                continue
            before_UD = None if predictor is None else predictor.rows_before(u.table, u.ids_U)
            self.embedding.set_rows(u.table, u.ids_U, u.delta_UD)
            if predictor is not None and before_UD is not None:
                predictor.applied(u.table, u.ids_U, before_UD)
        self.stats.updates_applied += len(updates)
        self.applied_through = step
        return blocked

    def before_step(self, step: int) -> None:
        """Make the rows hold exactly the updates of steps <= step-1-K."""
        self._apply_through(step - 1 - self.staleness)
        # dynamic tables evict only rows whose every update is applied (docs/dynamic_ids.md)
        self.embedding.begin_step(step, self.applied_through)
        if self.predictor is not None:
            self.predictor.refresh(self.applied_through)
        applied = step - 1 - self.applied_through
        lag = step - 1 - max(self.source.buffer.arrived_through, -1)
        s = self.stats
        s.steps += 1
        s.applied_sum += applied
        s.applied_max = max(s.applied_max, applied)
        s.lag_sum += lag
        s.lag_max = max(s.lag_max, lag)
        s.histogram[applied] = s.histogram.get(applied, 0) + 1
        self.last_applied_staleness = applied

    def catch_up(self, step: int) -> None:
        """After step `step`: apply now what the forward of step+1 will see (updates <=
        step-K), e.g. so that an evaluation after step t sees the model of step t+1."""
        self._apply_through(step - self.staleness)

    def drain(self, last_step: int) -> None:
        """End of training: apply every remaining update, through `last_step`."""
        self._apply_through(last_step)
        if self.predictor is not None:
            self.predictor.clear()

    def pushed(self, step: int, grads: Grads) -> None:
        """After the push of `step`: the rows it holds miss its update until it is applied."""
        if self.predictor is not None:
            self.predictor.pushed_step(step, grads)

    def pending_at(self, step: int) -> list[RowUpdate]:
        """At a checkpoint of `step` (after its push): apply exactly what the forward of
        step+1 sees (updates <= step-K) and return the later updates through `step`, in
        order, left pending. These rows plus these updates are the state of an
        uninterrupted run, so a checkpoint does not change the run (any K)."""
        self._apply_through(step - self.staleness)
        return self.source.peek(step) if self.applied_through < step else []

    def restore_pending(self, applied_through: int, updates: Sequence[RowUpdate]) -> None:
        """Resume: the rows hold the updates <= `applied_through`; `updates` come next."""
        self.source.buffer.restore_pending(applied_through, updates)
        self.applied_through = applied_through
