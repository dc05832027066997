"""gRPC servicers: messages <-> ShardCore calls, and the one exception -> status mapping.

No logic lives here beyond conversion: validation, exactly-once and the update
math are in the transport-free core (ps/store.py, ps/partition.py, ps/core.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc

from hybridps import wire
from hybridps.v1 import admin_pb2, admin_pb2_grpc, shard_pb2, shard_pb2_grpc
from ps.core import ShardCore
from ps.errors import (
    AnswerEvicted,
    Conflict,
    FlushTimeout,
    InvalidArgument,
    NotFound,
    NotRegistered,
    OutOfOrder,
    ResourceExhausted,
    ShardError,
    StaleIncarnation,
)
from ps.partition import Answer, PushChunk, TableSpec
from ps.store import ServerStats, SyncSession, kv

log = logging.getLogger("ps.service")

# Pushes (chunks) decoded ahead of the one being applied on one stream; beyond this the
# stream is not read, so HTTP/2 flow control pushes back on the client. Bounds the
# memory of one stream to about (SYNC_READ_AHEAD + 2) * max_message_bytes.
SYNC_READ_AHEAD = 4


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The one mapping from core exceptions to gRPC status codes."""
    code: grpc.StatusCode
    if isinstance(exc, (InvalidArgument, wire.WireError)):  # incl. NonFinite, RowOutOfRange
        code = grpc.StatusCode.INVALID_ARGUMENT
    elif isinstance(exc, NotFound):
        code = grpc.StatusCode.NOT_FOUND
    elif isinstance(exc, (NotRegistered, StaleIncarnation, Conflict, OutOfOrder,
                          AnswerEvicted)):
        code = grpc.StatusCode.FAILED_PRECONDITION
    elif isinstance(exc, FlushTimeout):
        code = grpc.StatusCode.DEADLINE_EXCEEDED
    elif isinstance(exc, ResourceExhausted):
        code = grpc.StatusCode.RESOURCE_EXHAUSTED
    else:
        return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
    return code, str(exc)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ShardError):
        return exc.reason
    if isinstance(exc, wire.WireError):
        return "wire_error"
    return "internal"


async def abort_with(context: grpc.aio.ServicerContext, rpc: str, exc: BaseException,
                     **fields: Any) -> None:
    """Log the failure and end the RPC with the mapped status (raises AbortError)."""
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error(kv("internal_error", rpc=rpc, error=message, **fields), exc_info=exc)
    else:
        log.warning(kv("refused", rpc=rpc, code=code.name, reason=_reason(exc),
                       error=message, **fields))
    await context.abort(code, message)


# -- message conversion -------------------------------------------------------------

def optimizer_args(msg: shard_pb2.OptimizerConfig) -> dict[str, Any]:
    try:
        kind = shard_pb2.OptimizerConfig.Kind.Name(msg.kind).lower()
    except ValueError:
        kind = f"<unknown kind {msg.kind}>"
    if kind == "kind_unspecified":
        kind = "unspecified"
    return {"kind": kind, "lr": msg.lr, "beta1": msg.beta1, "beta2": msg.beta2,
            "eps": msg.eps, "weight_decay": msg.weight_decay}


def table_specs(msg: shard_pb2.RegisterRequest) -> list[TableSpec]:
    return [TableSpec(t.name, t.num_rows, t.dim, t.row_start, t.row_end) for t in msg.tables]


def push_chunk(msg: shard_pb2.Push) -> PushChunk:
    """Decode a Push (tensors view the message bytes); WireError names the bad tensor."""
    head = (f"push run={msg.run_id!r} rank={msg.rank} step={msg.step} table={msg.table!r} "
            f"chunk {msg.chunk}")
    return PushChunk(
        run_id=msg.run_id, rank=msg.rank, incarnation=msg.incarnation, step=msg.step,
        table=msg.table, ids=wire.decode(msg.ids, f"{head}: ids"),
        grads=wire.decode(msg.grads, f"{head}: grads"), chunk=msg.chunk,
        num_chunks=msg.num_chunks,
    )


def answer_updates(answer: Answer, max_message_bytes: int) -> Iterator[shard_pb2.Update]:
    """The answer as Update messages, split by rows so each fits in max_message_bytes."""
    dim = int(answer.delta.shape[1])
    per_chunk = wire.rows_per_chunk(dim, max_message_bytes)
    bounds = list(wire.chunk_bounds(int(answer.ids.shape[0]), per_chunk))
    for i, (start, end) in enumerate(bounds):
        update = shard_pb2.Update(step=answer.step, table=answer.table, decay=answer.decay,
                                  chunk=i, num_chunks=len(bounds),
                                  duplicate=answer.duplicate)
        wire.encode(answer.ids[start:end], update.ids)
        wire.encode(answer.delta[start:end], update.delta)
        yield update


def stats_message(stats: ServerStats) -> admin_pb2.ShardStats:
    msg = admin_pb2.ShardStats(
        server_id=stats.server_id, uptime_s=stats.uptime_s,
        state_bytes_total=stats.state_bytes_total,
        pushes_applied_total=stats.pushes_applied_total,
        rows_updated_total=stats.rows_updated_total,
    )
    msg.refusals.update(stats.refusals)
    for row in stats.partitions:
        fields = {k: v for k, v in vars(row).items() if k != "refusals"}
        part = msg.partitions.add(**fields)
        part.refusals.update(row.refusals)
    return msg


# -- servicers ----------------------------------------------------------------------

class ShardServicer(shard_pb2_grpc.ShardServiceServicer):
    def __init__(self, core: ShardCore, max_message_bytes: int) -> None:
        self.core = core
        self.max_message_bytes = max_message_bytes

    async def Register(self, request: shard_pb2.RegisterRequest,
                       context: grpc.aio.ServicerContext) -> shard_pb2.RegisterResponse:
        try:
            tables = await self.core.register(
                request.run_id, request.rank, request.world_size, request.incarnation,
                table_specs(request), optimizer_args(request.optimizer))
        except Exception as exc:
            await abort_with(context, "Register", exc, run=request.run_id, rank=request.rank)
            raise  # unreachable: abort raises
        response = shard_pb2.RegisterResponse(server_id=self.core.store.server_id,
                                              max_message_bytes=self.max_message_bytes)
        for t in tables:
            response.tables.add(name=t.name, rows_held=t.rows_held, last_step=t.last_step,
                                created=t.created)
        return response

    async def Sync(self, request_iterator: AsyncIterator[shard_pb2.Push],
                   context: grpc.aio.ServicerContext) -> AsyncIterator[shard_pb2.Update]:
        session = self.core.open_session()
        inbox: asyncio.Queue[PushChunk | BaseException | None] = asyncio.Queue(SYNC_READ_AHEAD)
        reader = asyncio.create_task(self._read(request_iterator, session, inbox))
        current: PushChunk | None = None
        try:
            while True:
                item = await inbox.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                current = item
                answer = await self.core.feed(session, item)
                if answer is None:
                    continue
                if log.isEnabledFor(logging.DEBUG):
                    log.debug(kv("answered", run=item.run_id, rank=item.rank, step=answer.step,
                                 table=answer.table, rows=int(answer.ids.shape[0]),
                                 duplicate=answer.duplicate))
                for update in answer_updates(answer, self.max_message_bytes):
                    yield update
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            fields: dict[str, Any] = {}
            if current is not None:
                fields = {"run": current.run_id, "rank": current.rank, "step": current.step,
                          "table": current.table}
            await abort_with(context, "Sync", exc, **fields)
        finally:
            reader.cancel()
            session.close()

    async def _read(self, request_iterator: AsyncIterator[shard_pb2.Push], session: SyncSession,
                    inbox: asyncio.Queue[PushChunk | BaseException | None]) -> None:
        """Decode pushes as they arrive, ahead of the one being applied."""
        try:
            async for msg in request_iterator:
                try:
                    chunk = push_chunk(msg)
                except wire.WireError as exc:
                    self.core.store.record_refusal("wire_error", msg.run_id, msg.rank,
                                                   msg.table)
                    await inbox.put(exc)
                    return
                session.received(chunk)
                await inbox.put(chunk)
            await inbox.put(None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the stream broke; the handler ends with it
            await inbox.put(exc)

    async def Flush(self, request: shard_pb2.FlushRequest,
                    context: grpc.aio.ServicerContext) -> shard_pb2.FlushResponse:
        timeout = request.timeout_s
        remaining = context.time_remaining()
        if remaining is not None and (timeout == 0 or remaining < timeout):
            # Answer with our own message shortly before the client's deadline hits.
            timeout = max(remaining * 0.95, 1e-3)
        try:
            applied = await self.core.flush(request.run_id, request.rank, request.step,
                                            timeout)
        except Exception as exc:
            await abort_with(context, "Flush", exc, run=request.run_id, rank=request.rank,
                             step=request.step)
            raise
        response = shard_pb2.FlushResponse()
        for r in applied:
            response.applied.add(rank=r.rank, table=r.table, last_step=r.last_step)
        return response


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    def __init__(self, core: ShardCore) -> None:
        self.core = core

    async def GetShardStats(self, request: admin_pb2.ShardStatsRequest,
                            context: grpc.aio.ServicerContext) -> admin_pb2.ShardStats:
        try:
            return stats_message(self.core.stats(request.run_id))
        except Exception as exc:
            await abort_with(context, "GetShardStats", exc, run=request.run_id)
            raise
