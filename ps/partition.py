"""One rank's optimizer state on the shard server (transport-free: no grpc here).

A *partition* is what one (run_id, rank) registered: for each of its tables the
rows [row_start, row_end) it owns, with Adam's m and v for exactly those rows
(allocated once, at Register), the optimizer step count, the last applied
training step, and the bookkeeping behind GetShardStats.

Row dtype. A rank whose device rows are fp32 (the default) holds the only copy
of its rows: the server answers deltas. A rank that stores its rows in bf16
(worker --row-dtype bf16, half the device bytes) cannot accumulate small Adam
steps in them (bf16 keeps 8 mantissa bits: lr*1e-3 updates would round away),
so its partition also holds an fp32 *master* copy of the rows: seeded once from
the rank's fp32 initial rows (`seed`) or from a checkpoint, updated by the
optimizer in fp32 here, and answered as the new rows rounded to the row dtype
(Answer.rows): the rank's rows are always the master rounded to bf16.

Everything in this module is synchronous and holds no locks of its own; the
Store (ps/store.py) serialises access to one partition with `Partition.lock`.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hybridps.errors import (
    AnswerEvicted,
    Conflict,
    InvalidArgument,
    NonFiniteGradient,
    NotSeeded,
    OutOfOrder,
    ResourceExhausted,
    RowOutOfRange,
)
from hybridps.optim import (
    STATE_OFFSETS,
    OptimizerSpec,
    alloc_state,
    apply_rows_,
    apply_update_,
    mark_rows_,
    scan_push,
)

DEFAULT_ANSWER_CACHE_STEPS = 8
DEFAULT_RATE_WINDOW_S = 10.0
INT64_MAX = 2**63 - 1
MAX_TABLE_NAME_LEN = 256  # answers reserve ~1 KiB per message for header fields
# Device row dtypes a rank may register; every one but float32 gets an fp32 master here.
ROW_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def check_row_dtype(row_dtype: torch.dtype, what: str) -> None:
    if row_dtype not in ROW_DTYPES:
        names = ", ".join(str(d) for d in ROW_DTYPES)
        raise InvalidArgument(f"{what}: row dtype {row_dtype} is not one of {names}")


@dataclass(frozen=True)
class TableSpec:
    """The rows [row_start, row_end) of a num_rows x dim table that one rank owns."""

    name: str
    num_rows: int
    dim: int
    row_start: int
    row_end: int

    @property
    def rows_held(self) -> int:
        return self.row_end - self.row_start

    def validate(self) -> None:
        where = f"table {self.name!r}"
        if not self.name:
            raise InvalidArgument("table name must not be empty")
        if len(self.name) > MAX_TABLE_NAME_LEN:
            raise InvalidArgument(f"table name of {len(self.name)} characters is longer than "
                                  f"{MAX_TABLE_NAME_LEN}")
        if self.num_rows <= 0:
            raise InvalidArgument(f"{where}: num_rows={self.num_rows} must be > 0")
        if self.dim <= 0:
            raise InvalidArgument(f"{where}: dim={self.dim} must be > 0")
        if not 0 <= self.row_start <= self.row_end <= self.num_rows:
            raise InvalidArgument(
                f"{where}: row range [{self.row_start}, {self.row_end}) must satisfy "
                f"0 <= row_start <= row_end <= num_rows={self.num_rows}"
            )

    def describe(self) -> str:
        return (f"{self.name}(num_rows={self.num_rows}, dim={self.dim}, "
                f"rows=[{self.row_start}, {self.row_end}))")


class AnswerSink(Protocol):
    """A transport's buffer for one push's answer (e.g. the rank's shared memory).

    The partition writes every answer to the push into it under its lock: the kernel
    writes the delta into `out` when the push is applied (float32 [U, dim], not
    overlapping the gradients; None: not possible, e.g. another dtype), `write` copies
    (and converts) anything else in - a duplicate's saved answer, master rows, a delta
    that could not go to `out`. `write` raises a ShardError when the answer does not fit.
    """

    @property
    def out(self) -> torch.Tensor | None: ...

    def write(self, answer_UD: torch.Tensor) -> None: ...


@dataclass
class PushChunk:
    """One Push message with its tensors decoded (ids int64 [U], grads float32 [U, dim])."""

    run_id: str
    rank: int
    incarnation: int
    step: int
    table: str
    ids: torch.Tensor
    grads: torch.Tensor
    chunk: int = 0
    num_chunks: int = 1  # 0 is read as 1 (an unchunked push that left the field unset)
    # Push.lr: this push's learning rate (None: the registered optimizer's lr)
    lr: float | None = None
    # Set by SyncSession.received(): this chunk opened a push counted in queue_depth.
    queued: bool = field(default=False, compare=False)
    # Where the answer of a one-chunk push goes besides the return value (the
    # transport's shared memory); None: the answer is only returned.
    sink: AnswerSink | None = field(default=None, compare=False, repr=False)

    @property
    def total_chunks(self) -> int:
        return self.num_chunks if self.num_chunks != 0 else 1

    @property
    def identity(self) -> tuple[str, int, int, int, str]:
        return (self.run_id, self.rank, self.incarnation, self.step, self.table)

    def describe(self) -> str:
        return (f"push run={self.run_id!r} rank={self.rank} incarnation={self.incarnation} "
                f"step={self.step} table={self.table!r}")


@dataclass(frozen=True)
class Answer:
    """The server's answer to one push: rows[ids] = rows[ids] * decay + delta.

    With `rows` (master-rows partitions) `delta` holds the new rows themselves, in
    the registered row dtype, and decay is 0: rows[ids] = delta.
    """

    step: int
    table: str
    ids: torch.Tensor    # int64 [U], global ids, in the push's order
    delta: torch.Tensor  # float32 [U, dim] (rows: [U, dim] in the row dtype)
    decay: float
    duplicate: bool = False
    rows: bool = False
    # The delta is a view of the transport's memory (the rank's shared-memory answer
    # region), which the rank reuses once it has this answer: valid for a re-sent push
    # (the rank did not get the answer, so it has not reused the region), not after.
    borrowed: bool = field(default=False, compare=False)

    def as_duplicate(self) -> Answer:
        return dataclasses.replace(self, duplicate=True)


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


def optimizer_description(spec: OptimizerSpec) -> str:
    if spec.kind == "sgd":
        return f"sgd(lr={spec.lr:g}, weight_decay={spec.weight_decay:g})"
    text = f"{spec.kind}(lr={spec.lr:g}, betas=({spec.beta1:g}, {spec.beta2:g}), eps={spec.eps:g}"
    if spec.kind == "adamw":
        text += f", weight_decay={spec.weight_decay:g}"
    return text + ")"


def check_push_lr(lr: float, what: str) -> None:
    """A push's own lr (Push.lr) must be a finite number >= 0."""
    if not math.isfinite(lr) or lr < 0:
        raise InvalidArgument(f"{what}: lr={lr!r} must be a finite number >= 0")


def optimizer_with_lr(spec: OptimizerSpec, lr: float) -> OptimizerSpec:
    """`spec` at a push's own lr (Push.lr); InvalidArgument names a bad one."""
    if lr == spec.lr:
        return spec
    return dataclasses.replace(spec, lr=lr)  # OptimizerSpec refuses a non-finite / negative lr


def first_duplicate(ids_U: torch.Tensor) -> int | None:
    if ids_U.numel() < 2:
        return None
    # Coalesced gradients come sorted: strictly increasing ids are unique, an O(U) check
    # instead of an O(U log U) sort (which then only runs for unsorted pushes).
    if bool((ids_U[1:] > ids_U[:-1]).all()):
        return None
    sorted_ids = ids_U.sort().values
    same = sorted_ids[1:] == sorted_ids[:-1]
    if not bool(same.any()):
        return None
    return int(sorted_ids[1:][same][0])


class TableState:
    """Optimizer state and counters of one (run, rank, table)."""

    def __init__(self, owner: str, spec: TableSpec, optimizer: OptimizerSpec,
                 answer_cache_steps: int, rate_window_s: float,
                 clock: Callable[[], float], row_dtype: torch.dtype = torch.float32) -> None:
        self.owner = owner  # "run='r' rank=0", for messages
        self.spec = spec
        self.optimizer = optimizer
        self.row_dtype = row_dtype
        rows, dim = spec.rows_held, spec.dim
        try:
            if optimizer.has_moments:
                # Huge pages where available (the kernel touches random rows of tables far
                # beyond the TLB's reach), and m[id], v[id] in different L1 sets
                # (hybridps.optim.alloc_state; zeroed like torch.zeros).
                self.m: torch.Tensor | None = alloc_state(rows, dim,
                                                          offset=STATE_OFFSETS["m"])
                self.v: torch.Tensor | None = alloc_state(rows, dim,
                                                          offset=STATE_OFFSETS["v"])
            else:
                self.m = self.v = None
            # fp32 master rows for a rank with low-precision rows; seeded before any push
            # (and accessed at random rows like m and v: huge pages too).
            self.master: torch.Tensor | None = (
                None if row_dtype == torch.float32
                else alloc_state(rows, dim, offset=STATE_OFFSETS["master"]))
            self.touched = torch.zeros(rows, dtype=torch.bool)
        except (RuntimeError, MemoryError) as exc:
            raise ResourceExhausted(
                f"{owner}: cannot allocate optimizer state for {spec.describe()}: {exc}"
            ) from None
        # Owned rows [0, rows_seeded) of the master hold the rank's rows (all: no master).
        self.rows_seeded = rows if self.master is None else 0
        self.adam_step = 0   # pushes applied == torch optimizer state['step']
        self.last_step = -1  # last training step whose push was applied
        self.pushes_applied = 0
        self.rows_updated = 0
        self.distinct_touched = 0
        self.refusals: collections.Counter[str] = collections.Counter()
        self.answers: collections.OrderedDict[int, Answer] = collections.OrderedDict()
        self.answer_cache_steps = answer_cache_steps
        self.rate = RateWindow(rate_window_s, clock)

    @property
    def where(self) -> str:
        return f"{self.owner} table={self.spec.name!r}"

    @property
    def state_bytes(self) -> int:
        total = self.touched.numel() * self.touched.element_size()
        for t in (self.m, self.v):
            if t is not None:
                total += t.numel() * t.element_size()
        return total

    @property
    def master_bytes(self) -> int:
        master = self.master
        return 0 if master is None else master.numel() * master.element_size()

    # -- master rows -----------------------------------------------------------------

    def seed(self, row_start: int, rows_ND: torch.Tensor, what: str) -> int:
        """Copy fp32 rows [row_start, row_start + N) (global ids) into the master.

        Chunks go in order from the first owned row; re-sending one is harmless
        (a retried RPC). Returns the owned rows seeded so far.
        """
        spec = self.spec
        if self.master is None:
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
        self.master[local:local + n].copy_(rows_ND)
        self.rows_seeded = max(self.rows_seeded, local + n)
        return self.rows_seeded

    # -- validation (no state change) ------------------------------------------------

    def check_rows(self, ids: torch.Tensor, grads: torch.Tensor, what: str) -> None:
        """Raise if ids/grads are not a valid (part of a) coalesced push for this table."""
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
            return
        bad, increasing, nonfinite = scan_push(ids, grads, spec.row_start, spec.row_end)
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
              sink: AnswerSink | None = None, lr: float | None = None) -> Answer:
        """Apply a validated push that is the next step; returns (and saves) the answer,
        written into `sink` too (PushChunk.sink). `lr`: the push's own learning rate
        (checked by optimizer_with_lr), else the registered one."""
        local = ids - self.spec.row_start if self.spec.row_start else ids
        count = self.adam_step + 1
        out = sink.out if sink is not None and self.master is None else None
        optimizer = self.optimizer if lr is None else optimizer_with_lr(self.optimizer, lr)
        delta, decay = apply_rows_(optimizer, self.m, self.v, local, grads, count, out=out)
        self.adam_step = count
        self.last_step = step
        self.pushes_applied += 1
        n = ids.shape[0]
        self.rows_updated += n
        if n:
            self.distinct_touched += mark_rows_(self.touched, local)
        self.rate.add(n)
        if self.master is not None:
            # The optimizer step lands on the fp32 master (exactly what the rank would do to
            # fp32 rows); the rank gets the new rows rounded once to its row dtype.
            apply_update_(self.master, local, delta, float(decay))
            new_rows = self.master.index_select(0, local).to(self.row_dtype)
            answer = Answer(step=step, table=self.spec.name, ids=ids, delta=new_rows,
                            decay=0.0, rows=True)
        else:
            # A delta the kernel wrote into the sink stays there, and the cache only
            # borrows it (no [U, dim] copy a push): the cache is read for a re-sent push
            # alone, and a rank re-sends only pushes it got no answer for, whose regions
            # it has not reused.
            in_sink = out is not None and (n == 0 or delta.data_ptr() == out.data_ptr())
            answer = Answer(step=step, table=self.spec.name, ids=ids, delta=delta,
                            decay=float(decay), borrowed=in_sink)
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
                 row_dtype: torch.dtype = torch.float32) -> None:
        self.run_id = run_id
        self.rank = rank
        self.world_size = world_size
        self.incarnation = incarnation
        self.optimizer = optimizer
        self.row_dtype = row_dtype
        self.lock = threading.Lock()
        owner = f"run={run_id!r} rank={rank}"
        self.tables: dict[str, TableState] = {
            t.name: TableState(owner, t, optimizer, answer_cache_steps, rate_window_s, clock,
                               row_dtype)
            for t in tables
        }

    @property
    def where(self) -> str:
        return f"run={self.run_id!r} rank={self.rank}"

    def specs(self) -> list[TableSpec]:
        return [t.spec for t in self.tables.values()]

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

