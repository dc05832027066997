"""gRPC servicers: messages <-> ShardCore calls, and the one exception -> status mapping.

No logic lives here beyond conversion: validation, exactly-once and the update
math are in the transport-free core (ps/store.py, ps/partition.py, ps/core.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterator
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
from ps.lifecycle import RunTracker, check_finish
from ps.partition import Answer, PushChunk, TableSpec
from ps.store import ServerStats, SyncSession, kv

log = logging.getLogger("ps.service")

# Pushes (chunks) decoded ahead of the one being applied on one stream; beyond this the
# stream is not read, so HTTP/2 flow control pushes back on the client. Bounds the
# memory of one stream to about (SYNC_READ_AHEAD + 2) * max_message_bytes.
SYNC_READ_AHEAD = 4
SHUTTING_DOWN = ("server shutting down: pushes received so far are answered; reconnect to a "
                 "restarted server")


class _Stop:
    """Marker: the server is stopping and this stream has nothing queued any more."""


_STOP = _Stop()


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

def wait_timeout(requested_s: float, context: grpc.aio.ServicerContext) -> float:
    """The request's timeout (0: server default), cut to end shortly before the
    client's deadline, so the client gets our message rather than DEADLINE_EXCEEDED."""
    remaining = context.time_remaining()
    if remaining is not None and (requested_s == 0 or remaining < requested_s):
        return max(remaining * 0.95, 1e-3)
    return requested_s


class ShardServicer(shard_pb2_grpc.ShardServiceServicer):
    def __init__(self, core: ShardCore, max_message_bytes: int, *,
                 tracker: RunTracker | None = None, stop_when_run_over: bool = False,
                 run_idle_timeout_s: float = 0.0) -> None:
        self.core = core
        self.max_message_bytes = max_message_bytes
        self.tracker = tracker or RunTracker()
        self.stop_when_run_over = stop_when_run_over
        self.run_idle_timeout_s = run_idle_timeout_s
        self.stopping = asyncio.Event()

    def begin_drain(self) -> None:
        """Graceful stop: every Sync stream answers what it already received, then ends."""
        self.stopping.set()

    async def _next_item(self, inbox: asyncio.Queue[PushChunk | BaseException | None],
                         stop_wait: asyncio.Future[Any], reader: asyncio.Task[None]
                         ) -> PushChunk | BaseException | _Stop | None:
        """The next queued item; once the server stops, the rest of the queue, then _STOP."""
        if not stop_wait.done():
            if not inbox.empty():  # the common case while pushes stream in: no task
                return inbox.get_nowait()
            get = asyncio.ensure_future(inbox.get())
            try:
                await asyncio.wait({get, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                get.cancel()
                raise
            if not get.cancel():  # it completed: use the item
                return get.result()
        reader.cancel()  # read nothing more off the wire; what is queued is answered
        return _STOP if inbox.empty() else inbox.get_nowait()

    def _stream_closed(self, run_id: str, rank: int) -> None:
        self.tracker.stream_closed(run_id, rank)
        status = self.tracker.status(run_id)
        if self.stop_when_run_over and status is not None and not status.over:
            asyncio.get_running_loop().call_later(
                self.tracker.abort_grace_s + 0.05, self.tracker.recheck, run_id)
        if (self.stop_when_run_over and self.run_idle_timeout_s > 0 and status is not None
                and status.open_streams == 0 and not status.over):
            asyncio.get_running_loop().call_later(
                self.run_idle_timeout_s + 0.05, self.tracker.check_idle, self.run_idle_timeout_s)

    async def Register(self, request: shard_pb2.RegisterRequest,
                       context: grpc.aio.ServicerContext) -> shard_pb2.RegisterResponse:
        try:
            restore = ((request.restore.directory, request.restore.step)
                       if request.HasField("restore") else None)
            tables = await self.core.register(
                request.run_id, request.rank, request.world_size, request.incarnation,
                table_specs(request), optimizer_args(request.optimizer), restore)
        except Exception as exc:
            await abort_with(context, "Register", exc, run=request.run_id, rank=request.rank)
            raise  # unreachable: abort raises
        self.tracker.registered(request.run_id, request.rank)
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
        stop_wait = asyncio.ensure_future(self.stopping.wait())
        current: PushChunk | None = None
        stream_of: tuple[str, int] | None = None  # (run, rank), once a push was accepted
        try:
            while True:
                item = await self._next_item(inbox, stop_wait, reader)
                if item is None:
                    return
                if isinstance(item, _Stop):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, PushChunk)
                current = item
                answer = await self.core.feed(session, item)
                if stream_of is None:
                    stream_of = (item.run_id, item.rank)
                    self.tracker.stream_opened(*stream_of)
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
            stop_wait.cancel()
            reader.cancel()
            session.close()
            if stream_of is not None:
                self._stream_closed(*stream_of)

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
        timeout = wait_timeout(request.timeout_s, context)
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


    async def Checkpoint(self, request: shard_pb2.CheckpointRequest,
                         context: grpc.aio.ServicerContext) -> shard_pb2.CheckpointResponse:
        timeout = wait_timeout(request.timeout_s, context)
        try:
            saved = await self.core.checkpoint(request.run_id, list(request.ranks),
                                               request.step, request.directory, timeout)
        except Exception as exc:
            await abort_with(context, "Checkpoint", exc, run=request.run_id,
                             step=request.step, directory=request.directory)
            raise
        response = shard_pb2.CheckpointResponse()
        for rank, info in saved:
            response.files.add(rank=rank, table=info.table, row_start=info.row_start,
                               row_end=info.row_end, file=info.file, bytes=info.bytes,
                               crc32=info.crc32)
        return response


    async def Finish(self, request: shard_pb2.FinishRequest,
                     context: grpc.aio.ServicerContext) -> shard_pb2.FinishResponse:
        fields = {"run": request.run_id, "rank": request.rank, "last_step": request.last_step}
        try:
            check_finish(self.core.store, request.run_id, request.rank, request.incarnation,
                         request.last_step, request.aborted)
        except Exception as exc:
            await abort_with(context, "Finish", exc, **fields)
            raise
        registered, finished, over = self.tracker.finish(
            request.run_id, request.rank, request.last_step, request.aborted, request.reason)
        log.info(kv("finish", **fields, aborted=request.aborted, reason=request.reason or "-",
                    ranks_finished=f"{finished}/{registered}", run_over=over))
        if request.aborted and not over and self.stop_when_run_over:
            asyncio.get_running_loop().call_later(
                self.tracker.abort_grace_s + 0.05, self.tracker.recheck, request.run_id)
        return shard_pb2.FinishResponse(ranks_registered=registered, ranks_finished=finished,
                                        server_stopping=over and self.stop_when_run_over)


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    def __init__(self, core: ShardCore,
                 request_stop: Callable[[str, float], None] | None = None) -> None:
        self.core = core
        self.request_stop = request_stop

    async def Shutdown(self, request: admin_pb2.ShutdownRequest,
                       context: grpc.aio.ServicerContext) -> admin_pb2.ShutdownResponse:
        """Reached only with the admin token (ps/auth.py); the stop begins after the answer."""
        if self.request_stop is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this server cannot be stopped "
                                "remotely")
        if not request.grace_s >= 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"grace_s={request.grace_s} must be >= 0")
        assert self.request_stop is not None
        reason = f"admin Shutdown from {context.peer()}" + (
            f": {request.reason}" if request.reason else "")
        asyncio.get_running_loop().call_soon(self.request_stop, reason, request.grace_s)
        return admin_pb2.ShutdownResponse(server_id=self.core.store.server_id)

    async def GetShardStats(self, request: admin_pb2.ShardStatsRequest,
                            context: grpc.aio.ServicerContext) -> admin_pb2.ShardStats:
        try:
            return stats_message(self.core.stats(request.run_id))
        except Exception as exc:
            await abort_with(context, "GetShardStats", exc, run=request.run_id)
            raise
