"""Messages <-> the core's values: the shard server's codec (no grpc here).

Requests become the core's arguments (`PushChunk`s, table specs, optimizer arguments),
answers become messages. The Sync stream's messages go through hybridps/wire.py's
copy-free framing: a received push's tensors view the message bytes (or, for a
shared-memory push, the rank's arena: ps/edge/arena_server.py), an inline answer is copied
once into the outgoing bytes. Every malformed message is a `wire.WireError` (or a
`BadShmReference` / `StaleShmEpoch` for a bad reference into the arena) naming the
value; the servicers map those to status codes (ps/edge/status.py `status_for`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybridps import wire
from hybridps.errors import BadShmReference, InvalidArgument
from hybridps.paged_rows import PagedOut
from hybridps.v1 import admin_pb2, shard_pb2
from ps.core.maintenance import RunReaper
from ps.core.paging import PageCall, PageResult
from ps.core.partition import TableSpec
from ps.core.push import Answer, PushChunk
from ps.core.server_stats import ServerStats
from ps.core.store import Store
from ps.core.table_members import MemberSpec
from ps.edge.arena_server import ArenaRegistry, ResolvedShmPush, ShmRef, resolve

# Tensor fields of the Sync messages, from the outer message down (wire.TensorPath).
PUSH_TENSORS = (("push", "chunk", "ids"), ("push", "chunk", "grads"))
UPDATE_TENSORS = (("update", "chunk", "ids"), ("update", "chunk", "delta"))
# --wire-dtype: the dtypes gradients and deltas may travel in (math is always float32).
WIRE_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# -- Register, SeedRows, stats ----------------------------------------------------------

def optimizer_args(msg: shard_pb2.OptimizerConfig) -> dict[str, Any]:
    try:
        kind = shard_pb2.OptimizerConfig.Kind.Name(msg.kind).lower()
    except ValueError:
        kind = f"<unknown kind {msg.kind}>"
    if kind == "kind_unspecified":
        kind = "unspecified"
    return {"kind": kind, "lr": msg.lr, "beta1": msg.beta1, "beta2": msg.beta2,
            "eps": msg.eps, "weight_decay": msg.weight_decay}


def row_dtype_arg(msg: shard_pb2.RegisterRequest) -> torch.dtype:
    """RegisterRequest.row_dtype as a torch dtype (unset: float32, the fp32-rows mode)."""
    if msg.row_dtype == shard_pb2.DTYPE_UNSPECIFIED:
        return torch.float32
    dtype = wire.torch_dtype(msg.row_dtype)
    if dtype is None:
        raise InvalidArgument(f"register: row_dtype {wire.dtype_name(msg.row_dtype)} is not a "
                              "known dtype")
    return dtype


def table_specs(msg: shard_pb2.RegisterRequest) -> list[TableSpec]:
    return [TableSpec(t.name, t.num_rows, t.dim, t.row_start, t.row_end,
                      tuple(MemberSpec(m.name, m.num_rows, m.row_start, m.row_end, m.offset)
                            for m in t.members), t.dynamic)
            for t in msg.tables]


def _tensor(msg: shard_pb2.Tensor, what: str, dtype: torch.dtype, dims: int
            ) -> torch.Tensor:
    t = wire.decode(msg, what)
    if t.dtype != dtype or t.dim() != dims:
        raise InvalidArgument(f"{what} must be {dtype} with {dims} dimension(s), got "
                              f"{t.dtype} of shape {list(t.shape)}")
    return t


def page_call(msg: shard_pb2.PageRequest, dim: int) -> PageCall:
    """A PageRequest as the core's PageCall (every tensor's dtype and rank checked)."""
    what = f"page run={msg.run_id!r} rank={msg.rank} table={msg.table!r}"
    i64 = torch.int64

    def ids(field: shard_pb2.Tensor, name: str) -> torch.Tensor:
        return _tensor(field, f"{what}: {name}", i64, 1)

    in_ids = ids(msg.in_ids, "in_ids")
    if msg.peek:
        empty = torch.empty(0, dtype=i64)
        return PageCall(msg.step, msg.seq, 0, PagedOut(empty, torch.empty(0, dim), {},
                                                       empty, empty),
                        empty, in_ids, empty, peek=True)
    c = msg.counters
    return PageCall(
        step=msg.step, seq=msg.seq, expire_steps=msg.expire_steps,
        out=PagedOut(ids(msg.out_ids, "out_ids"),
                     _tensor(msg.out_rows, f"{what}: out_rows", torch.float32, 2), {},
                     ids(msg.out_seen, "out_seen"), ids(msg.out_freq, "out_freq")),
        out_slots=ids(msg.out_slots, "out_slots"), in_ids=in_ids,
        in_slots=ids(msg.in_slots, "in_slots"),
        counters={f.name: int(getattr(c, f.name)) for f in c.DESCRIPTOR.fields})


def page_response(result: PageResult, dim: int) -> shard_pb2.PageResponse:
    msg = shard_pb2.PageResponse()
    wire.encode(result.found, msg.found)
    wire.encode(result.got.rows.reshape(-1, dim), msg.rows)
    wire.encode(result.got.seen, msg.seen)
    wire.encode(result.got.freq, msg.freq)
    wire.encode(torch.from_numpy(result.dropped.astype("int64")), msg.dropped)
    return msg


def stats_message(stats: ServerStats) -> admin_pb2.ShardStats:
    msg = admin_pb2.ShardStats(
        server_id=stats.server_id, uptime_s=stats.uptime_s,
        runs_freed=stats.runs_freed, partitions_freed=stats.partitions_freed,
        max_state_bytes=stats.max_state_bytes,
        spill_disk_bytes_total=stats.spill_disk_bytes_total,
        spill_max_bytes=stats.spill_max_bytes, spill_enabled=stats.spill_enabled,
        state_bytes_total=stats.state_bytes_total,
        pushes_applied_total=stats.pushes_applied_total,
        rows_updated_total=stats.rows_updated_total,
        master_bytes_total=stats.master_bytes_total,
        dynamic_held_bytes_total=stats.dynamic_held_bytes_total,
    )
    msg.refusals.update(stats.refusals)
    for row in stats.partitions:
        fields = {k: v for k, v in vars(row).items() if k != "refusals"}
        part = msg.partitions.add(**fields)
        part.refusals.update(row.refusals)
    return msg


def add_run_stats(msg: admin_pb2.ShardStats, reaper: RunReaper, run_id: str = "") -> None:
    for rid, run, over_for in reaper.tracker.snapshot(run_id):
        registered, finished = run.summary()
        msg.runs.add(run_id=rid, state=run.state, ranks_registered=registered,
                     ranks_finished=finished, over_for_s=over_for,
                     freed_in_s=(-1.0 if not run.over
                                 else max(0.0, reaper.retention_s - over_for)),
                     why=run.over)


# -- the Sync stream: requests ----------------------------------------------------------

@dataclass
class WirePushChunk(PushChunk):
    """A PushChunk plus what only the transport needs: the dtype of the answer's delta and
    the size of the message it came in."""

    update_dtype: torch.dtype = torch.float32
    message_bytes: int = 0


def decode_request(data: bytes) -> wire.Framed[shard_pb2.SyncRequest]:
    """The Sync stream's request deserializer: never raises (Framed.error instead)."""
    return wire.decode_framed(shard_pb2.SyncRequest, data, PUSH_TENSORS, "push")


def request_owner(framed: wire.Framed[shard_pb2.SyncRequest]) -> tuple[str, int, str]:
    """(run, rank, table) a request names, to count a refusal on."""
    request = framed.message
    if request.HasField("batch") and request.batch.pushes:
        first = request.batch.pushes[0]
        return first.run_id, first.rank, ""
    return request.push.run_id, request.push.rank, request.push.table


def request_chunks(framed: wire.Framed[shard_pb2.SyncRequest],
                   arenas: ArenaRegistry | None = None,
                   store: Store | None = None) -> list[WirePushChunk]:
    """The chunks one Sync message carries: its push, or the entries of its batch.

    Inline tensors view the message bytes; a shared-memory push's tensors view the rank's
    arena in `arenas`. A batch is checked whole before any entry is handed on, so a bad
    entry refuses the message and applies none of it."""
    if framed.error is not None:
        raise framed.error
    request = framed.message
    kind = request.WhichOneof("kind")
    if kind == "push":
        return [_push_chunk(request.push, framed, arenas, store)]
    if kind == "batch":
        return _batch_chunks(request.batch, arenas, store)
    raise wire.WireError("push: a Sync message carries neither a push nor a batch")


def _describe(push: shard_pb2.Push) -> str:
    return (f"push run={push.run_id!r} rank={push.rank} step={push.step} "
            f"table={push.table!r}")


def _push_chunk(push: shard_pb2.Push, framed: wire.Framed[Any] | None,
                arenas: ArenaRegistry | None, store: Store | None) -> WirePushChunk:
    head = _describe(push)
    update_dtype = _update_dtype(push, head)
    data = push.WhichOneof("data")
    sink: ResolvedShmPush | None = None
    if data == "chunk" and framed is not None:
        head += f" chunk {push.chunk.index}"
        # The grads stay a view of the message (read once, by the update). The ids are
        # copied (8 bytes a row): the answer cache keeps them, and a view would keep the
        # whole received message, gradients included, alive with it.
        ids, grads = framed.tensor("ids", head).clone(), framed.tensor("grads", head)
        index, count = push.chunk.index, push.chunk.count
    elif data == "shm":
        sink = _resolve_shm(push.shm, push.run_id, push.rank, head, arenas, store,
                            update_dtype)
        ids, grads, index, count = sink.ids, sink.grads, 0, 1
    else:
        raise wire.WireError(f"{head}: carries neither an inline chunk nor shared-memory "
                             "references")
    return WirePushChunk(
        run_id=push.run_id, rank=push.rank, incarnation=push.incarnation, step=push.step,
        table=push.table, ids=ids, grads=grads, chunk=index, num_chunks=count,
        lr=push.lr if push.HasField("lr") else None,  # unset: the registered lr
        update_dtype=update_dtype, message_bytes=framed.nbytes if framed is not None else 0,
        sink=sink,  # a shared-memory push: the core writes the answer into the arena
    )


def _batch_chunks(batch: shard_pb2.PushBatch, arenas: ArenaRegistry | None,
                  store: Store | None) -> list[WirePushChunk]:
    if not batch.pushes:
        raise wire.WireError("batch push: no pushes")
    first = batch.pushes[0]
    head = f"batch push run={first.run_id!r} rank={first.rank}"
    chunks = []
    for i, entry in enumerate(batch.pushes):
        what = f"{head}: entry {i} (step={entry.step} table={entry.table!r})"
        if entry.WhichOneof("data") != "shm":
            raise wire.WireError(f"{what} is not a shared-memory push (a batch carries "
                                 "shared-memory pushes only)")
        if (entry.run_id, entry.rank) != (first.run_id, first.rank):
            raise wire.WireError(f"{what} is of run={entry.run_id!r} rank={entry.rank}, not "
                                 "the batch's")
        chunks.append(_push_chunk(entry, None, arenas, store))
    return chunks


def _update_dtype(push: shard_pb2.Push, head: str) -> torch.dtype:
    if push.update_dtype == shard_pb2.DTYPE_UNSPECIFIED:
        return torch.float32
    asked = wire.torch_dtype(push.update_dtype)
    if asked not in WIRE_FLOAT_DTYPES:
        raise wire.WireError(f"{head}: update_dtype {wire.dtype_name(push.update_dtype)}"
                             f" is not one of FLOAT32, BFLOAT16, FLOAT16")
    return asked


def _shm_ref(name: str, msg: shard_pb2.ShmTensor) -> ShmRef:
    return ShmRef(name, wire.torch_dtype(msg.dtype), wire.dtype_name(msg.dtype),
                  tuple(msg.shape), int(msg.offset), int(msg.length))


def _resolve_shm(refs: shard_pb2.ShmRefs, run_id: str, rank: int, head: str,
                 arenas: ArenaRegistry | None, store: Store | None,
                 update_dtype: torch.dtype) -> ResolvedShmPush:
    """Resolve a push's shared-memory references (BadShmReference names a bad one)."""
    missing = [f for f in ("ids", "grads", "answer") if not refs.HasField(f)]
    if missing:
        raise BadShmReference(f"{head}: shm push without {', '.join(missing)}")
    part = store.partition(run_id, rank) if store is not None else None
    answer_dtype = (None if part is None else
                    part.row_dtype if part.row_dtype != torch.float32 else update_dtype)
    no_arena = ("this server runs with --shm false" if arenas is None else
                f"run {run_id!r} rank {rank} has no shared-memory arena accepted on this "
                "server (Register with one first)")
    arena = arenas.get(run_id, rank) if arenas is not None else None
    return resolve(arena, int(refs.epoch),
                   (_shm_ref("ids", refs.ids), _shm_ref("grads", refs.grads),
                    _shm_ref("answer", refs.answer)), answer_dtype, head, no_arena)


# -- the Sync stream: answers -----------------------------------------------------------

def shm_update(push: ResolvedShmPush, answer: Answer) -> shard_pb2.Update:
    """The header-only Update of a push whose answer the core wrote into its region."""
    push.arena.pushes += 1
    push.arena.bytes += push.tensor_bytes
    return shard_pb2.Update(step=answer.step, table=answer.table, decay=answer.decay,
                            rows=answer.rows, duplicate=answer.duplicate,
                            shm=shard_pb2.ShmAnswer())


def update_message(update: shard_pb2.Update) -> bytes:
    return shard_pb2.SyncResponse(update=update).SerializeToString()


def batch_message(updates: Sequence[shard_pb2.Update]) -> bytes:
    """The answers to a PushBatch, in its order, in one message."""
    return shard_pb2.SyncResponse(
        batch=shard_pb2.UpdateBatch(updates=updates)).SerializeToString()


def answer_updates(answer: Answer, max_message_bytes: int,
                   delta_dtype: torch.dtype = torch.float32) -> Iterator[bytes]:
    """The answer as encoded SyncResponse messages, split by rows so each fits in
    max_message_bytes; a float32 delta travels in `delta_dtype` (the push's
    update_dtype)."""
    delta = answer.delta
    if delta.dtype == torch.float32 and delta_dtype != torch.float32:
        delta = delta.to(delta_dtype)
    dim = int(delta.shape[1])
    per_chunk = wire.rows_per_chunk(dim, max_message_bytes, delta.element_size())
    bounds = list(wire.chunk_bounds(int(answer.ids.shape[0]), per_chunk))
    for i, (start, end) in enumerate(bounds):
        update = shard_pb2.Update(step=answer.step, table=answer.table, decay=answer.decay,
                                  rows=answer.rows, duplicate=answer.duplicate,
                                  chunk=shard_pb2.InlineAnswer(index=i, count=len(bounds)))
        yield wire.encode_framed(shard_pb2.SyncResponse(update=update),
                                 [(UPDATE_TENSORS[0], answer.ids[start:end]),
                                  (UPDATE_TENSORS[1], delta[start:end])])


def encode_answer(answer: Answer, max_message_bytes: int,
                  delta_dtype: torch.dtype = torch.float32) -> list[bytes]:
    return list(answer_updates(answer, max_message_bytes, delta_dtype))


def encode_response(response: bytes) -> bytes:
    """The Sync stream's response serializer: answers are encoded already."""
    return response
