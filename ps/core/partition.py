"""One rank's optimizer state on the shard server (transport-free: no grpc here).

A *partition* is what one (run_id, rank) registered: for each of its tables the
rows [row_start, row_end) it owns, with the optimizer's state for exactly those rows
(by the names and widths of OptimizerSpec.state_layout(): adam's m and v, rowwise
Adagrad's one sum a row...; allocated once, at Register), the optimizer step count, the
last applied training step, and the bookkeeping behind GetShardStats.

Row dtype. A rank whose device rows are fp32 (the default) holds the only copy
of its rows: the server answers deltas. A rank that stores its rows in bf16
(worker --row-dtype bf16, half the device bytes) cannot accumulate small Adam
steps in them (bf16 keeps 8 mantissa bits: lr*1e-3 updates would round away),
so its partition also holds an fp32 *master* copy of the rows: seeded once from
the rank's fp32 initial rows (`seed`) or from a checkpoint, updated by the
optimizer in fp32 here, and answered as the new rows rounded to the row dtype
(Answer.rows): the rank's rows are always the master rounded to bf16.

Everything in this module is synchronous and holds no locks of its own; the
Store (ps/core/store.py) serialises access to one partition with `Partition.lock`.
"""

from __future__ import annotations

import collections
import hmac
import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridps.errors import (
    AnswerEvicted,
    Conflict,
    InvalidArgument,
    NonFiniteGradient,
    NonFiniteUpdate,
    NotSeeded,
    OutOfOrder,
    ResourceExhausted,
    RowOutOfRange,
)
from hybridps.names import describe_problem
from hybridps.optim import OptimizerSpec, apply_update_, step_rows_, undo_rows_
from hybridps.optim_kinds import SERVER_FLAG_BYTES_PER_ROW, state_floats_per_row
from hybridps.push_checks import PayloadDigest, mark_rows_, scan_push_max
from hybridps.spilled_rows import HeldRows, RowColumns
from hybridps.state_alloc import STATE_OFFSETS, alloc_row_state, alloc_state
from ps.core.overflow import OverflowBound
from ps.core.paging import PagedTable
from ps.core.push import Answer, AnswerSink, first_duplicate, optimizer_with_lr
from ps.core.push import PushChunk as PushChunk  # re-exported: the core's input, next to TableSpec
from ps.core.table_members import MemberSpec, check_members

DEFAULT_ANSWER_CACHE_STEPS = 8
DEFAULT_RATE_WINDOW_S = 10.0
INT64_MAX = 2**63 - 1
# Shapes no host can hold, refused as invalid before any size arithmetic: 2^48 rows is
# 10^5 times the largest tables in use, and a row of 2^20 floats is 4 MiB (a push of one
# row must fit in a gRPC message). Below these, rows x dim x 12 bytes stays far from
# int64 overflow, and --max-state-bytes decides what fits.
MAX_TABLE_ROWS = 2**48
MAX_DIM = 2**20
SECRET_BYTES = 16  # 128 bits
# Device row dtypes a rank may register; every one but float32 gets an fp32 master here.
ROW_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
# the column of the fp32 master rows among a table's row columns (next to the optimizer's)
MASTER = "master"
# Makes the row columns of a table that does not hold them all in memory (ps/core/spill.py):
# (its spec, the columns' layout) -> the holder; None: allocate them in memory.
ColumnsFactory = Callable[["TableSpec", list[tuple[str, int]]], RowColumns | None]


def check_row_dtype(row_dtype: torch.dtype, what: str) -> None:
    if row_dtype not in ROW_DTYPES:
        names = ", ".join(str(d) for d in ROW_DTYPES)
        raise InvalidArgument(f"{what}: row dtype {row_dtype} is not one of {names}")


@dataclass(frozen=True)
class TableSpec:
    """The rows [row_start, row_end) of a num_rows x dim table that one rank owns; a group
    of tables when `members` is not empty (ps/core/table_members.py)."""

    name: str
    num_rows: int
    dim: int
    row_start: int
    row_end: int
    members: tuple[MemberSpec, ...] = ()
    dynamic: bool = False  # slots of raw ids, with rows paged out (ps/core/paging.py)

    @property
    def rows_held(self) -> int:
        return self.row_end - self.row_start

    def validate(self) -> None:
        where = f"table {self.name!r}"
        problem = describe_problem("table name", self.name)
        if problem is not None:
            raise InvalidArgument(problem)
        if not 0 < self.num_rows <= MAX_TABLE_ROWS:
            raise InvalidArgument(f"{where}: num_rows={self.num_rows} must be in "
                                  f"[1, 2^48 = {MAX_TABLE_ROWS}]")
        if not 0 < self.dim <= MAX_DIM:
            raise InvalidArgument(f"{where}: dim={self.dim} must be in [1, 2^20 = {MAX_DIM}]")
        if not 0 <= self.row_start <= self.row_end <= self.num_rows:
            raise InvalidArgument(
                f"{where}: row range [{self.row_start}, {self.row_end}) must satisfy "
                f"0 <= row_start <= row_end <= num_rows={self.num_rows}"
            )
        check_members(self, MAX_TABLE_ROWS)
        if self.dynamic and self.members:
            raise InvalidArgument(f"{where}: a dynamic table cannot be a group of tables")

    def describe(self) -> str:
        group = (f", members={'+'.join(m.name for m in self.members)}" if self.members
                 else "")
        return (f"{self.name}(num_rows={self.num_rows}, dim={self.dim}, "
                f"rows=[{self.row_start}, {self.row_end}){group}"
                f"{', dynamic' if self.dynamic else ''})")

    def state_bytes(self, optimizer: str, master: bool) -> int:
        """Host bytes a partition allocates for these rows (TableState) with optimizer
        kind `optimizer`: its float32 state (hybridps/optim_kinds.py), the fp32 master
        rows, two flags a row (touched, and TableState.changed: allocated at the first
        checkpoint, reserved from the start so that the checkpoint cannot take the
        partition past what its Register was granted). Python ints: no overflow, whatever
        the shape."""
        floats = state_floats_per_row(optimizer, self.dim) + (self.dim if master else 0)
        return self.rows_held * (SERVER_FLAG_BYTES_PER_ROW + 4 * floats)


class RateWindow:
    """Rows updated per second over the last `window_s` seconds."""

    def __init__(self, window_s: float, clock: Callable[[], float]) -> None:
        self.window_s = window_s
        self._clock = clock
        self._events: collections.deque[tuple[float, int]] = collections.deque()
        self._first: float | None = None

    def add(self, rows: int) -> None:
        now = self._clock()
        if self._first is None:
            self._first = now
        self._events.append((now, rows))
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()

    def rate(self) -> float:
        if self._first is None:
            return 0.0
        now = self._clock()
        events = list(self._events)  # a snapshot: add() may run in another thread
        rows = sum(n for t, n in events if t >= now - self.window_s)
        span = min(self.window_s, max(now - self._first, 1.0))
        return rows / span


class CounterRate:
    """Per second of a counter that only grows (a spill tier's fills or spills), over about
    the last `window_s` seconds: each reading (a stats call, whoever asks) is set against
    the oldest kept one inside the window, so two pollers see the same rate. At most ~34
    readings are kept: one each window_s / 32, and the newest one older than the window."""

    def __init__(self, window_s: float, clock: Callable[[], float]) -> None:
        self.window_s = window_s
        self._clock = clock
        self._readings: collections.deque[tuple[float, int]] = collections.deque(
            [(clock(), 0)])
        self._lock = threading.Lock()  # stats calls from the loop and from admin threads

    def rate(self, value: int) -> float:
        now = self._clock()
        with self._lock:
            readings = self._readings
            if now - readings[-1][0] >= self.window_s / 32:
                readings.append((now, value))
            while len(readings) > 2 and readings[1][0] <= now - self.window_s:
                readings.popleft()
            start, first = readings[0]
        return (value - first) / (now - start) if now > start else 0.0


def optimizer_description(spec: OptimizerSpec) -> str:
    return spec.describe()


class TableState:
    """Optimizer state and counters of one (run, rank, table).

    Its row-shaped state (the optimizer's columns and the master rows) is `columns`
    (hybridps/spilled_rows.py): in memory (`state` and `master` are then those tensors),
    or paged to a spill file beyond its memory quota (`columns_factory`,
    ps/core/spill.py; `state` is then empty and `master` None). Every access goes through
    `columns.view`, which answers the tensors and rows to update."""

    def __init__(self, owner: str, spec: TableSpec, optimizer: OptimizerSpec,
                 answer_cache_steps: int, rate_window_s: float,
                 clock: Callable[[], float], row_dtype: torch.dtype = torch.float32,
                 columns_factory: ColumnsFactory | None = None) -> None:
        self.owner = owner  # "run='r' rank=0", for messages
        self.spec = spec
        self.optimizer = optimizer
        self.row_dtype = row_dtype
        rows, dim = spec.rows_held, spec.dim
        self.has_master = row_dtype != torch.float32
        layout = list(optimizer.state_widths(dim)) + ([(MASTER, dim)] if self.has_master
                                                      else [])
        spilled = columns_factory(spec, layout) if columns_factory is not None else None
        self.state: dict[str, torch.Tensor] = {}
        self.master: torch.Tensor | None = None
        if spilled is not None:
            self.columns: RowColumns = spilled
        else:
            try:
                # name -> [rows, width] (OptimizerSpec.state_layout()). Huge pages where
                # available (the kernel touches random rows of tables far beyond the TLB's
                # reach), and e.g. m[id], v[id] in different L1 sets
                # (hybridps.state_alloc.alloc_state; zeroed like torch.zeros).
                self.state = alloc_row_state(optimizer.state_widths(dim), rows)
                # fp32 master rows for a rank with low-precision rows; seeded before any
                # push (and accessed at random rows like m and v: huge pages too).
                if self.has_master:
                    self.master = alloc_state(rows, dim, offset=STATE_OFFSETS["master"])
            except (RuntimeError, MemoryError) as exc:
                raise ResourceExhausted(
                    f"{owner}: cannot allocate optimizer state for {spec.describe()}: {exc}"
                ) from None
            self.columns = HeldRows({**self.state, **(
                {} if self.master is None else {MASTER: self.master})})
        self.touched = torch.zeros(rows, dtype=torch.bool)
        # Owned rows [0, rows_seeded) of the master hold the rank's rows (all: no master).
        self.rows_seeded = 0 if self.has_master else rows
        self.adam_step = 0   # pushes applied == torch optimizer state['step']
        self.last_step = -1  # last training step whose push was applied
        self.pushes_applied = 0
        self.rows_updated = 0
        self.distinct_touched = 0
        self.saved_step = -1  # the step of the last checkpoint saved of it (-1: none)
        # the rows whose state changed since that checkpoint (pushes, Page calls): what an
        # incremental checkpoint writes (ps/core/checkpoint.py); kept from the first
        # checkpoint on (the first one is full: nothing to track before it)
        self.changed: torch.Tensor | None = None
        # a group (ps/core/table_members.py): rows updated per member, for the per-table stats
        self.member_rows_updated = [0] * len(spec.members)
        self._member_bounds = torch.tensor([m.offset for m in spec.members[1:]],
                                           dtype=torch.int64)
        self.refusals: collections.Counter[str] = collections.Counter()
        self.answers: collections.OrderedDict[int, Answer] = collections.OrderedDict()
        self.answer_cache_steps = answer_cache_steps
        self.rate = RateWindow(rate_window_s, clock)
        # pages its disk tier reads back and writes (the stats' per-second figures)
        self.fill_rate = CounterRate(rate_window_s, clock)
        self.spill_rate = CounterRate(rate_window_s, clock)
        self.bound = OverflowBound(dim)
        # a dynamic table: the rows paged out of its slots and the Page calls' bookkeeping
        self.paging: PagedTable | None = (PagedTable(dim, optimizer.state_widths(dim))
                                          if spec.dynamic else None)
        # the bytes its paged-out rows may hold (0: no limit); set at Register from the
        # partition's share of the budget (ps/core/limits.py)
        self.paged_quota = 0

    @property
    def where(self) -> str:
        return f"{self.owner} table={self.spec.name!r}"

    @property
    def m(self) -> torch.Tensor | None:
        return self.state.get("m")

    @property
    def v(self) -> torch.Tensor | None:
        return self.state.get("v")

    @property
    def state_bytes(self) -> int:
        """Host memory of its optimizer state (in memory: frames when it spills) and
        flags (the changed flags counted before the first checkpoint allocates them: they
        are reserved); the master rows are `master_bytes`."""
        total = self.touched.numel() * self.touched.element_size() + self.spec.rows_held
        held = self.columns.memory_bytes
        return total + held - self.master_bytes

    @property
    def paged_bytes(self) -> int:
        """Host bytes of the rows a dynamic table holds paged out, with their tombstones."""
        return 0 if self.paging is None else self.paging.store.nbytes

    @property
    def paged_memory_bytes(self) -> int:
        """Host memory of its paged-out rows (`paged_bytes` less what spills to disk)."""
        return 0 if self.paging is None else self.paging.store.memory_bytes

    @property
    def master_bytes(self) -> int:
        """Host memory of the fp32 master rows (their share of the frames when spilled)."""
        if not self.has_master:
            return 0
        widths = dict(self.columns.layout)
        return self.columns.memory_bytes * widths[MASTER] // sum(widths.values())

    def spilled_holders(self) -> list[RowColumns]:
        """Its row columns, and a dynamic table's paged-out payload when it spills."""
        paged = self.paging.store.spilled if self.paging is not None else None
        return [self.columns] + ([paged] if paged is not None else [])

    def state_view(self, local: torch.Tensor, write: bool = True
                   ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, torch.Tensor]:
        """(the optimizer's state by name, the master rows or None, the positions of
        rows `local` in them): resident until the next call."""
        cols, at = self.columns.view(local, write)
        if not self.has_master:
            return cols, None, at
        return {n: t for n, t in cols.items() if n != MASTER}, cols[MASTER], at

    # -- master rows -----------------------------------------------------------------

    def seed(self, row_start: int, rows_ND: torch.Tensor, what: str) -> int:
        """Copy fp32 rows [row_start, row_start + N) (global ids) into the master.

        Chunks go in order from the first owned row; re-sending one is harmless
        (a retried RPC). Returns the owned rows seeded so far.
        """
        spec = self.spec
        if not self.has_master:
            raise InvalidArgument(f"{what}: {self.where} was registered with fp32 rows and "
                                  "holds no master rows to seed")
        if self.last_step >= 0:
            raise Conflict(f"{what}: {self.where} already applied pushes through step "
                           f"{self.last_step}; its master rows can no longer be seeded")
        if rows_ND.dtype != torch.float32 or rows_ND.dim() != 2 or rows_ND.shape[1] != spec.dim:
            raise InvalidArgument(f"{what}: rows must be float32 [N, {spec.dim}], got "
                                  f"{rows_ND.dtype} of shape {list(rows_ND.shape)}")
        n = int(rows_ND.shape[0])
        if not spec.row_start <= row_start <= row_start + n <= spec.row_end:
            raise RowOutOfRange(f"{what}: rows [{row_start}, {row_start + n}) are outside the "
                                f"rows [{spec.row_start}, {spec.row_end}) of {self.where}")
        local = row_start - spec.row_start
        if local > self.rows_seeded:
            raise InvalidArgument(f"{what}: rows from {row_start} leave a gap; seed from row "
                                  f"{spec.row_start + self.rows_seeded} next (in order)")
        if not bool(torch.isfinite(rows_ND).all()):
            raise NonFiniteGradient(f"{what}: the master rows hold non-finite values")
        self.columns.write(local, {MASTER: rows_ND})
        self.bound.observe({}, rows_ND)
        self.rows_seeded = max(self.rows_seeded, local + n)
        return self.rows_seeded

    # -- validation (no state change) ------------------------------------------------

    def check_rows(self, ids: torch.Tensor, grads: torch.Tensor, what: str,
                   digest: PayloadDigest | None = None) -> float:
        """Raise if ids/grads are not a valid (part of a) coalesced push for this table;
        returns the largest |gradient| (for `apply`'s overflow bound). The chunk is added
        to `digest` in the same pass (the push's payload digest, ps/core/session.py)."""
        spec = self.spec
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise InvalidArgument(
                f"{what}: ids must be a 1-D int64 tensor, got {ids.dtype} of shape "
                f"{list(ids.shape)}"
            )
        if grads.dtype != torch.float32:
            raise InvalidArgument(f"{what}: grads must be float32 (or bfloat16/float16 on the "
                                  f"wire), got {grads.dtype}")
        n = ids.shape[0]
        if grads.dim() != 2 or grads.shape[1] != spec.dim:
            raise InvalidArgument(
                f"{what}: grads of shape {list(grads.shape)} must be [U, dim] = [{n}, {spec.dim}] "
                f"(table {spec.name!r} has dim {spec.dim})"
            )
        if grads.shape[0] != n:
            raise InvalidArgument(
                f"{what}: grads have {grads.shape[0]} rows for {n} ids; they must match"
            )
        if n == 0:
            if digest is not None:
                digest.add(ids, grads)
            return 0.0
        bad, increasing, nonfinite, grad_max = scan_push_max(ids, grads, spec.row_start,
                                                             spec.row_end, digest)
        if bad >= 0:
            bad_id = int(ids[bad])
            extra = " (int64 max)" if bad_id == INT64_MAX else ""
            raise RowOutOfRange(
                f"{what}: id {bad_id}{extra} at position {bad} is outside the rows "
                f"[{spec.row_start}, {spec.row_end}) this rank owns of table {spec.name!r} "
                f"({spec.num_rows} rows)"
            )
        # Strictly increasing ids (coalesced pushes come sorted) are unique; others are
        # sorted to find a repeat.
        dup = None if increasing else first_duplicate(ids)
        if dup is not None:
            raise InvalidArgument(
                f"{what}: id {dup} appears more than once; pushes must be coalesced "
                "(send grad.coalesce() rows, each id once)"
            )
        if nonfinite >= 0:
            row, col = divmod(nonfinite, spec.dim)
            raise NonFiniteGradient(
                f"{what}: gradient of id {int(ids[row])} (row {row}, column {col}) is "
                f"{float(grads[row, col])}; non-finite gradients are refused"
            )
        return grad_max

    def classify_step(self, step: int, what: str) -> Answer | None:
        """None when `step` is the next one; the saved answer when it was applied before."""
        if step < 0:
            raise InvalidArgument(f"{what}: step must be >= 0")
        if step == self.last_step + 1:
            if self.rows_seeded < self.spec.rows_held:
                raise NotSeeded(
                    f"{what}: {self.where} keeps fp32 master rows and only "
                    f"{self.rows_seeded} of its {self.spec.rows_held} rows are seeded; "
                    "call SeedRows for every owned row before pushing")
            return None
        if step > self.last_step + 1:
            raise OutOfOrder(
                f"{what}: step {step} skips ahead; the next step expected for "
                f"{self.where} is {self.last_step + 1} (last applied {self.last_step})"
            )
        saved = self.answers.get(step)
        if saved is None:
            held = (f"steps {min(self.answers)}..{max(self.answers)}" if self.answers
                    else "none")
            raise AnswerEvicted(
                f"{what}: step {step} was applied before but its answer is no longer held "
                f"(answers held for {held}; last applied {self.last_step}); "
                "resend only pushes after a held step"
            )
        return saved.as_duplicate()

    # -- the update ------------------------------------------------------------------

    def apply(self, step: int, ids: torch.Tensor, grads: torch.Tensor,
              sink: AnswerSink | None = None, grad_max: float = math.inf,
              lr: float | None = None, digest: tuple[object, ...] = ()) -> Answer:
        """Apply a validated push that is the next step; returns (and saves) the answer,
        written into `sink` too (PushChunk.sink). `grad_max`: the largest |gradient|
        (check_rows); a push whose update could overflow float32 is applied checked and
        refused (NonFiniteUpdate) with nothing changed when it would (OverflowBound).
        `lr`: the push's own learning rate (Push.lr, checked by optimizer_with_lr), else
        the registered one. `digest`: the push's payload digest, kept with its answer."""
        ids_local = ids - self.spec.row_start if self.spec.row_start else ids
        state, master, local = self.state_view(ids_local)
        count = self.adam_step + 1
        out = sink.out if sink is not None and master is None else None
        optimizer = self.optimizer if lr is None else optimizer_with_lr(self.optimizer, lr)
        checked = not self.bound.safe(optimizer, count, grad_max)
        try:
            delta, decay = step_rows_(optimizer, state, local, grads, count,
                                      out=out, check_finite=checked)
        except NonFiniteUpdate as exc:
            raise NonFiniteUpdate(f"push step={step} {self.where}: {exc} (a gradient too "
                                  "large for float32 state); refused, nothing changed") from None
        if master is not None:
            old_rows = master.index_select(0, local) if checked else None
            apply_update_(master, local, delta, float(decay))
            if old_rows is not None and not bool(
                    torch.isfinite(master.index_select(0, local)).all()):
                master.index_copy_(0, local, old_rows)
                undo_rows_()
                raise NonFiniteUpdate(f"push step={step} {self.where}: the update would make "
                                      "the master rows non-finite; refused, nothing changed")
        if checked:
            self.bound.observe(state, master, local)
        else:
            self.bound.advance(optimizer, count, grad_max, float(decay))
        self.adam_step = count
        self.last_step = step
        self.pushes_applied += 1
        n = ids.shape[0]
        self.rows_updated += n
        if n:
            self.distinct_touched += mark_rows_(self.touched, ids_local)
            if self.changed is not None:
                mark_rows_(self.changed, ids_local)
            if self.member_rows_updated:  # local ids are sorted (check_rows)
                cuts = [0, *torch.searchsorted(ids_local, self._member_bounds).tolist(), n]
                for i in range(len(self.member_rows_updated)):
                    self.member_rows_updated[i] += cuts[i + 1] - cuts[i]
        self.rate.add(n)
        if master is not None:
            # The optimizer step landed on the fp32 master above (exactly what the rank would
            # do to fp32 rows); the rank gets the new rows rounded once to its row dtype.
            new_rows = master.index_select(0, local).to(self.row_dtype)
            answer = Answer(step=step, table=self.spec.name, ids=ids, delta=new_rows,
                            decay=0.0, rows=True, digest=digest)
        else:
            # A delta the kernel wrote into the sink stays there, and the cache only
            # borrows it (no [U, dim] copy a push): the cache is read for a re-sent push
            # alone, and a rank re-sends only pushes it got no answer for, whose regions
            # it has not reused.
            in_sink = out is not None and (n == 0 or delta.data_ptr() == out.data_ptr())
            answer = Answer(step=step, table=self.spec.name, ids=ids, delta=delta,
                            decay=float(decay), borrowed=in_sink, digest=digest)
        if sink is not None and not answer.borrowed:
            sink.write(answer.delta)
        self.answers[step] = answer
        while len(self.answers) > self.answer_cache_steps:
            self.answers.popitem(last=False)
        return answer


class Partition:
    """Everything one (run_id, rank) registered."""

    def __init__(self, run_id: str, rank: int, world_size: int, incarnation: int,
                 tables: list[TableSpec], optimizer: OptimizerSpec, *,
                 answer_cache_steps: int = DEFAULT_ANSWER_CACHE_STEPS,
                 rate_window_s: float = DEFAULT_RATE_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic,
                 row_dtype: torch.dtype = torch.float32, run_digest: str = "",
                 columns_factory: ColumnsFactory | None = None) -> None:
        """`columns_factory`: the row columns of tables that spill (TableState)."""
        self.run_id = run_id
        self.rank = rank
        self.world_size = world_size
        self.incarnation = incarnation
        self.optimizer = optimizer
        self.row_dtype = row_dtype
        self.lock = threading.Lock()
        # Handed to the registering process only (Register's answer); every later call for
        # this partition must carry it (ps/core/partition_auth.py). A new one when the partition
        # is taken over or a newer incarnation registers, so a process of an older
        # incarnation holds a secret that no longer opens anything; the same one for a
        # re-Register of the same process (a reconnect), which carries it.
        self.secret = secrets.token_hex(SECRET_BYTES)
        # The sha256 of the run secret its Register proved ('' when it carried none,
        # hybridps/run_secret.py): what a takeover, and the owner file of a checkpoint
        # directory it writes into, must match (ps/core/partition_auth.py,
        # ps/core/checkpoint_dirs.py).
        self.run_digest = run_digest
        # Refusals of calls for this partition that name no table (a wrong secret, a
        # refused takeover); per-table ones are in TableState.refusals.
        self.refusals: collections.Counter[str] = collections.Counter()
        # what its Register reserved of the budget: a dynamic partition's whole share
        # (ps/core/limits.py), else its fixed state (0: not set, the state counts)
        self.reserved_bytes = 0
        # what its spill files may take of --spill-max-gb (ps/core/spill.py), reserved
        # at Register and released with `close`
        self.disk_reserved_bytes = 0
        owner = f"run={run_id!r} rank={rank}"
        self.tables: dict[str, TableState] = {
            t.name: TableState(owner, t, optimizer, answer_cache_steps, rate_window_s, clock,
                               row_dtype, columns_factory)
            for t in tables
        }

    def close(self) -> None:
        """Release what its tables hold outside memory (their spill files)."""
        for t in self.tables.values():
            t.columns.close()
            if t.paging is not None:
                t.paging.store.close()

    @property
    def disk_bytes(self) -> int:
        return sum(h.disk_bytes for t in self.tables.values() for h in t.spilled_holders())

    @property
    def where(self) -> str:
        return f"run={self.run_id!r} rank={self.rank}"

    def specs(self) -> list[TableSpec]:
        return [t.spec for t in self.tables.values()]

    def new_secret(self) -> str:
        self.secret = secrets.token_hex(SECRET_BYTES)
        return self.secret

    def secret_matches(self, given: str) -> bool:
        """Constant-time comparison with this partition's secret."""
        return hmac.compare_digest(given.encode(), self.secret.encode())

    @property
    def state_bytes(self) -> int:
        """Host bytes of this partition's optimizer state, master rows and paged-out rows."""
        return sum(t.state_bytes + t.master_bytes + t.paged_memory_bytes
                   for t in self.tables.values())

    @property
    def budget_bytes(self) -> int:
        """What it counts against the budget: its reservation or what it holds, the
        larger."""
        return max(self.reserved_bytes, self.state_bytes)

    def difference(self, world_size: int, tables: list[TableSpec],
                   optimizer: OptimizerSpec,
                   row_dtype: torch.dtype = torch.float32) -> str | None:
        """Why a re-Register does not match what this partition holds (None: it matches)."""
        if world_size != self.world_size:
            return f"world_size {world_size} != registered {self.world_size}"
        if row_dtype != self.row_dtype:
            return f"row dtype {row_dtype} != registered {self.row_dtype}"
        if optimizer != self.optimizer:
            return (f"optimizer {optimizer_description(optimizer)} != registered "
                    f"{optimizer_description(self.optimizer)}")
        held = {t.name: t for t in self.specs()}
        asked = {t.name: t for t in tables}
        if set(held) != set(asked):
            return f"tables {sorted(asked)} != registered {sorted(held)}"
        for name, spec in asked.items():
            if spec != held[name]:
                return f"table {spec.describe()} != registered {held[name].describe()}"
        return None

