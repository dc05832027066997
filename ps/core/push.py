"""A push as the shard server's core sees it (transport-free: no grpc here): one decoded
Push message (`PushChunk`), the answer to a push (`Answer`), where a transport wants the
answer written (`AnswerSink`), and the checks of a push's own values that do not need its
table (ps/core/partition.py checks the rest against the table)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hybridps.errors import InvalidArgument
from hybridps.optim import OptimizerSpec


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
    # The digest of the push's payload (hybridps/push_checks.py payload_digest): a re-sent
    # step gets this answer only if it carries the same payload (ps/core/session.py).
    digest: tuple[object, ...] = field(default=(), compare=False)

    def as_duplicate(self) -> Answer:
        return dataclasses.replace(self, duplicate=True)


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
