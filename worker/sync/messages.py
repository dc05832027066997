"""The rank's side of the shard protocol's messages: what it sends, built and serialized.

Pure functions and values, no I/O. A push goes inline (its ids and gradients in the
message, split into chunks of at most --max-chunk-bytes; hybridps/wire.py frames them
without protobuf copies) or by reference into the rank's arena (worker/sync/arena.py);
several by-reference pushes of one step travel as one PushBatch.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from hybridps import wire
from hybridps.optim import OptimizerSpec
from hybridps.optim_kinds import KINDS
from hybridps.v1 import shard_pb2
from worker.embedding.groups import Member
from worker.embedding.rows import TableConfig
from worker.sync.arena import PlacedShmPush, ShmSlot

# OptimizerSpec.kind -> the name of its OptimizerConfig.Kind (ps/edge/sync_codec.py maps it back;
# tests/hybridps/test_optimizers.py round-trips every kind)
OPTIMIZER_KIND = {kind: kind.upper() for kind in KINDS}
# Where a push's tensors lie in a SyncRequest (wire.TensorPath).
PUSH_IDS, PUSH_GRADS = ("push", "chunk", "ids"), ("push", "chunk", "grads")


def make_incarnation() -> int:
    """Grows across restarts: wall-clock milliseconds, then torchelastic's restart count."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    return int(time.time() * 1000) * 1000 + min(restarts, 999)


def optimizer_message(spec: OptimizerSpec) -> shard_pb2.OptimizerConfig:
    return shard_pb2.OptimizerConfig(kind=OPTIMIZER_KIND[spec.kind], lr=spec.lr,
                                     beta1=spec.beta1, beta2=spec.beta2, eps=spec.eps,
                                     weight_decay=spec.weight_decay)


def table_specs(tables: Sequence[TableConfig], ranges: dict[str, tuple[int, int]],
                members: Mapping[str, Sequence[Member]] | None = None
                ) -> list[shard_pb2.TableSpec]:
    """Register's tables; `members`: the tables of each group (worker/embedding/groups.py)."""
    members = members or {}
    return [shard_pb2.TableSpec(
                name=t.name, num_rows=t.num_rows, dim=t.dim, row_start=ranges[t.name][0],
                row_end=ranges[t.name][1],
                members=[shard_pb2.TableMember(name=m.name, num_rows=m.num_rows,
                                               row_start=m.start, row_end=m.end,
                                               offset=m.offset)
                         for m in members.get(t.name, ())],
                dynamic=t.dynamic is not None)
            for t in tables]


@dataclass
class PushEncoder:
    """Who pushes (run, rank, incarnation) and how (dtypes): builds the push messages."""

    run_id: str
    rank: int
    incarnation: int
    wire_dtype: torch.dtype   # gradients go, and deltas come back, in this dtype
    answer_dtype: torch.dtype  # what a shared-memory answer region holds

    @property
    def update_dtype(self) -> int:
        return (shard_pb2.DTYPE_UNSPECIFIED if self.wire_dtype == torch.float32
                else wire.wire_dtype(self.wire_dtype))

    def _push(self, step: int, table: str, lr: float | None) -> shard_pb2.Push:
        """`lr`: the push's own learning rate (Push.lr; None: the registered one)."""
        return shard_pb2.Push(run_id=self.run_id, rank=self.rank, incarnation=self.incarnation,
                              step=step, table=table, lr=lr,
                              update_dtype=self.update_dtype)  # type: ignore[arg-type]

    def inline(self, step: int, table: str, ids_U: torch.Tensor, grads_UD: torch.Tensor,
               max_chunk_bytes: int, lr: float | None = None) -> list[bytes]:
        """The push's SyncRequests, its rows split into chunks that fit max_chunk_bytes
        (each chunk carries the push's lr)."""
        grads = grads_UD.to(self.wire_dtype)
        per_chunk = wire.rows_per_chunk(int(grads.shape[1]), max_chunk_bytes,
                                        grads.element_size())
        bounds = list(wire.chunk_bounds(int(ids_U.shape[0]), per_chunk))
        messages = []
        for index, (lo, hi) in enumerate(bounds):
            push = self._push(step, table, lr)
            push.chunk.index, push.chunk.count = index, len(bounds)
            messages.append(wire.encode_framed(shard_pb2.SyncRequest(push=push),
                                               [(PUSH_IDS, ids_U[lo:hi]),
                                                (PUSH_GRADS, grads[lo:hi])]))
        return messages

    def by_reference(self, step: int, table: str, slot: ShmSlot,
                     lr: float | None = None) -> PlacedShmPush:
        push = self._push(step, table, lr)
        push.shm.ids.CopyFrom(slot.refs[0])
        push.shm.grads.CopyFrom(slot.refs[1])
        push.shm.answer.CopyFrom(slot.refs[2])
        return PlacedShmPush(push, slot)


class InlinePush:
    """An inline push's messages, encoded once, by whichever thread first needs them: the
    gRPC stream's loop thread when it sends them (the copy of the gradients then runs
    there, off the training step), and the same bytes on every re-send."""

    def __init__(self, encode: Callable[[], list[bytes]],
                 on_encoded: Callable[[list[bytes]], None] | None = None) -> None:
        self._encode: Callable[[], list[bytes]] | None = encode
        self._on_encoded = on_encoded
        self._messages: list[bytes] | None = None
        self._lock = threading.Lock()

    def messages(self) -> list[bytes]:
        with self._lock:
            if self._messages is None:
                assert self._encode is not None
                self._messages, self._encode = self._encode(), None  # frees the tensors
                if self._on_encoded is not None:
                    self._on_encoded(self._messages)
            return self._messages


# What a transport is handed: a serialized SyncRequest, or an inline push to serialize.
Outgoing = bytes | InlinePush


def serialized(items: Sequence[Outgoing]) -> list[bytes]:
    """The bytes of `items`, in order (inline pushes encoded here if not yet)."""
    out: list[bytes] = []
    for item in items:
        if isinstance(item, InlinePush):
            out += item.messages()
        else:
            out.append(item)
    return out


def placed_message(placed: Sequence[PlacedShmPush], epoch: int) -> bytes:
    """One SyncRequest for pushes by reference, each stamped with `epoch`: the push itself,
    or a PushBatch of several (the server answers them in one UpdateBatch)."""
    if len(placed) == 1:
        return shard_pb2.SyncRequest(push=placed[0].stamped(epoch)).SerializeToString()
    batch = shard_pb2.PushBatch(pushes=[p.stamped(epoch) for p in placed])
    return shard_pb2.SyncRequest(batch=batch).SerializeToString()
