"""gRPC servicers: messages <-> ShardCore calls, and the one exception -> status mapping.

No logic lives here beyond conversion: validation, exactly-once and the update
math are in the transport-free core (ps/store.py, ps/partition.py, ps/core.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from hybridps import wire
from hybridps.errors import (
    AnswerEvicted,
    BadShmReference,
    Conflict,
    FlushTimeout,
    InvalidArgument,
    NotFound,
    NotRegistered,
    OutOfOrder,
    ResourceExhausted,
    ShardError,
    StaleIncarnation,
    StaleShmEpoch,
)
from hybridps.v1 import admin_pb2, admin_pb2_grpc, shard_pb2, shard_pb2_grpc
from ps.core import ShardCore
from ps.lifecycle import RunTracker, check_finish
from ps.partition import Answer, PushChunk, TableSpec
from ps.shm import ArenaRegistry, ShmPush, ShmRef, resolve
from ps.store import ServerStats, Store, kv

log = logging.getLogger("ps.service")

# Pushes (chunks) decoded ahead of the one being applied on one stream; beyond this the
# stream is not read, so HTTP/2 flow control pushes back on the client. Bounds the
# memory of one stream to about (SYNC_READ_AHEAD + 2) * max_message_bytes.
SYNC_READ_AHEAD = 4
MIN_ANSWER_MESSAGE_BYTES = 1 << 20
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
    elif isinstance(exc, StaleShmEpoch):
        code = grpc.StatusCode.ABORTED
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
    return [TableSpec(t.name, t.num_rows, t.dim, t.row_start, t.row_end) for t in msg.tables]


# What the Sync stream's deserializer gives (wire.Framed); a generated Push is accepted too.
SyncRequest = wire.Framed[shard_pb2.Push] | shard_pb2.Push


@dataclass
class WirePushChunk(PushChunk):
    """A PushChunk plus what only the transport needs: the dtype of the answer's delta and
    the size of the message it came in."""

    update_dtype: torch.dtype = torch.float32
    message_bytes: int = 0
    # Entry batch_index of a batch push of batch_size entries (0: a push of its own).
    batch_index: int = 0
    batch_size: int = 0


# --wire-dtype: the dtypes gradients and deltas may travel in (math is always float32).
WIRE_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def push_header(msg: SyncRequest) -> shard_pb2.Push:
    return msg.message if isinstance(msg, wire.Framed) else msg


def shm_ref(name: str, msg: shard_pb2.ShmTensor) -> ShmRef:
    return ShmRef(name, wire.torch_dtype(msg.dtype), wire.dtype_name(msg.dtype),
                  tuple(msg.shape), int(msg.offset), int(msg.length))


def is_shm_push(head: shard_pb2.Push) -> bool:
    return (head.HasField("shm_ids") or head.HasField("shm_grads")
            or head.HasField("shm_answer"))


def _shm_push(msg: SyncRequest, head_msg: shard_pb2.Push, head: str,
              arenas: ArenaRegistry | None, store: Store | None,
              update_dtype: torch.dtype) -> ShmPush:
    """Resolve a push's shared-memory references (BadShmReference names a bad one)."""
    inline = (bool(msg.tensors) if isinstance(msg, wire.Framed)
              else head_msg.HasField("ids") or head_msg.HasField("grads"))
    if inline:
        raise BadShmReference(f"{head}: carries both inline tensors and shm references")
    missing = [f for f in ("shm_ids", "shm_grads", "shm_answer") if not head_msg.HasField(f)]
    if missing:
        raise BadShmReference(f"{head}: shm push without {', '.join(missing)}")
    if head_msg.chunk != 0 or head_msg.num_chunks not in (0, 1):
        raise BadShmReference(f"{head}: a shm push is one chunk (got chunk {head_msg.chunk} "
                              f"of {head_msg.num_chunks})")
    part = store.partition(head_msg.run_id, head_msg.rank) if store is not None else None
    answer_dtype = (None if part is None else
                    part.row_dtype if part.row_dtype != torch.float32 else update_dtype)
    no_arena = ("this server runs with --shm false" if arenas is None else
                f"run {head_msg.run_id!r} rank {head_msg.rank} has no shared-memory arena "
                "accepted on this server (Register with one first)")
    arena = arenas.get(head_msg.run_id, head_msg.rank) if arenas is not None else None
    return resolve(arena, int(head_msg.shm_epoch),
                   (shm_ref("ids", head_msg.shm_ids), shm_ref("grads", head_msg.shm_grads),
                    shm_ref("answer", head_msg.shm_answer)), answer_dtype, head, no_arena)


def push_chunk(msg: SyncRequest, arenas: ArenaRegistry | None = None,
               store: Store | None = None) -> WirePushChunk:
    """Decode a Push (tensors view the message bytes); WireError names the bad tensor.

    `msg` is what the Sync stream's deserializer gives (wire.Framed: decoded without
    copies) or a generated Push message. A shared-memory push's tensors view the rank's
    arena in `arenas` (BadShmReference / StaleShmEpoch when they cannot)."""
    head_msg = push_header(msg)
    head = (f"push run={head_msg.run_id!r} rank={head_msg.rank} step={head_msg.step} "
            f"table={head_msg.table!r} chunk {head_msg.chunk}")
    update_dtype = _update_dtype(head_msg, head)
    shm: ShmPush | None = None
    if is_shm_push(head_msg):
        shm = _shm_push(msg, head_msg, head, arenas, store, update_dtype)
        ids, grads = shm.ids, shm.grads
    elif isinstance(msg, wire.Framed):
        # The grads stay a view of the message (read once, by the update). The ids are
        # copied (8 bytes a row): the answer cache keeps them, and a view would keep the
        # whole received message, gradients included, alive with it.
        ids, grads = msg.tensor("ids", head).clone(), msg.tensor("grads", head)
    else:
        ids = wire.decode(msg.ids, f"{head}: ids")
        grads = wire.decode(msg.grads, f"{head}: grads")
    return WirePushChunk(
        run_id=head_msg.run_id, rank=head_msg.rank, incarnation=head_msg.incarnation,
        step=head_msg.step, table=head_msg.table, ids=ids, grads=grads, chunk=head_msg.chunk,
        num_chunks=head_msg.num_chunks, update_dtype=update_dtype,
        lr=head_msg.lr if head_msg.HasField("lr") else None,
        message_bytes=msg.nbytes if isinstance(msg, wire.Framed) else 0,
        sink=shm,  # a shared-memory push: the core writes the answer into the arena
    )


def push_chunks(msg: SyncRequest, arenas: ArenaRegistry | None = None,
                store: Store | None = None) -> list[WirePushChunk]:
    """The chunks one Sync message carries: itself, or the entries of a batch push.

    A batch is checked whole before any entry is handed on, so a bad entry refuses the
    message and applies none of it."""
    head_msg = push_header(msg)
    if not head_msg.batch:
        return [push_chunk(msg, arenas, store)]
    head = f"batch push run={head_msg.run_id!r} rank={head_msg.rank}"
    if (isinstance(msg, wire.Framed) and msg.tensors) or head_msg.HasField("ids") \
            or head_msg.HasField("grads") or is_shm_push(head_msg):
        raise wire.WireError(f"{head}: a batch message carries its pushes in `batch` only")
    chunks = []
    size = len(head_msg.batch)
    for i, entry in enumerate(head_msg.batch):
        what = f"{head}: entry {i} (step={entry.step} table={entry.table!r})"
        if entry.batch:
            raise wire.WireError(f"{what} is itself a batch")
        if not is_shm_push(entry):
            raise wire.WireError(f"{what} is not a shared-memory push (a batch carries "
                                 "shared-memory pushes only)")
        if (entry.run_id, entry.rank) != (head_msg.run_id, head_msg.rank):
            raise wire.WireError(f"{what} is of run={entry.run_id!r} rank={entry.rank}, not "
                                 "the batch's")
        chunk = push_chunk(entry, arenas, store)
        chunk.batch_index, chunk.batch_size = i, size
        chunks.append(chunk)
    return chunks


def _update_dtype(head_msg: shard_pb2.Push, head: str) -> torch.dtype:
    if head_msg.update_dtype == shard_pb2.DTYPE_UNSPECIFIED:
        return torch.float32
    asked = wire.torch_dtype(head_msg.update_dtype)
    if asked not in WIRE_FLOAT_DTYPES:
        raise wire.WireError(f"{head}: update_dtype {wire.dtype_name(head_msg.update_dtype)}"
                             f" is not one of FLOAT32, BFLOAT16, FLOAT16")
    return asked


def answer_in_shm(push: ShmPush, answer: Answer) -> shard_pb2.Update:
    """The header-only Update of a push whose answer the core wrote into its region."""
    push.arena.pushes += 1
    push.arena.bytes += push.tensor_bytes
    return shard_pb2.Update(step=answer.step, table=answer.table, decay=answer.decay,
                            rows=answer.rows, chunk=0, num_chunks=1,
                            duplicate=answer.duplicate, shm=True)


def answer_updates(answer: Answer, max_message_bytes: int,
                   delta_dtype: torch.dtype = torch.float32) -> Iterator[bytes]:
    """The answer as encoded Update messages, split by rows so each fits in
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
                                  rows=answer.rows,
                                  chunk=i, num_chunks=len(bounds),
                                  duplicate=answer.duplicate)
        yield wire.encode_framed(update, [("ids", answer.ids[start:end]),
                                          ("delta", delta[start:end])])


def encode_answer(answer: Answer, max_message_bytes: int,
                  delta_dtype: torch.dtype = torch.float32) -> list[bytes]:
    return list(answer_updates(answer, max_message_bytes, delta_dtype))


def decode_push(data: bytes) -> wire.Framed[shard_pb2.Push]:
    return wire.decode_framed(shard_pb2.Push, data, ("ids", "grads"), "push")


def _encode_update(update: bytes | shard_pb2.Update) -> bytes:
    return update if isinstance(update, bytes) else update.SerializeToString()


class _SyncCodecServer:
    """Stands in for the server while the generated code registers ShardService, so that
    Sync gets the copy-free codec of hybridps/wire.py and every other RPC (present or
    added to the proto later) the generated one."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server
        self.registered = False

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        """Ignored: add_registered_method_handlers below registers both kinds."""

    def add_registered_method_handlers(self, service: str,
                                       handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        handlers = dict(handlers)
        sync = handlers["Sync"].stream_stream
        if sync is None:
            raise TypeError("ShardService.Sync is no longer a bidi-streaming method")
        handlers["Sync"] = grpc.stream_stream_rpc_method_handler(
            sync, request_deserializer=decode_push,
            response_serializer=_encode_update)
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, handlers),))
        # grpcio >= 1.63 (missing from its type stubs).
        self._server.add_registered_method_handlers(  # type: ignore[attr-defined]
            service, handlers)
        self.registered = True


def add_shard_service(servicer: ShardServicer, server: grpc.aio.Server) -> None:
    """shard_pb2_grpc.add_ShardServiceServicer_to_server, with Sync's codec swapped."""
    proxy = _SyncCodecServer(server)
    shard_pb2_grpc.add_ShardServiceServicer_to_server(servicer, proxy)
    if not proxy.registered:  # generated by a grpcio-tools that registers differently
        raise RuntimeError("shard_pb2_grpc did not call add_registered_method_handlers: "
                           "adapt ps/service.py add_shard_service to the generated code")


def stats_message(stats: ServerStats) -> admin_pb2.ShardStats:
    msg = admin_pb2.ShardStats(
        server_id=stats.server_id, uptime_s=stats.uptime_s,
        state_bytes_total=stats.state_bytes_total,
        pushes_applied_total=stats.pushes_applied_total,
        rows_updated_total=stats.rows_updated_total,
        master_bytes_total=stats.master_bytes_total,
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


class SyncStream:
    """One Sync stream, whatever carries it (the gRPC stream, ps/direct.py's socket).

    `decode` each message as it arrives (a refused one is recorded and raises), then
    `answer` its chunks in order: the encoded Update messages to send back. `close` once,
    at the end. On an error, `fields()` names the push it happened in, for the log.
    """

    def __init__(self, servicer: ShardServicer) -> None:
        self._servicer = servicer
        self._core = servicer.core
        self.session = self._core.open_session()
        self._current: PushChunk | None = None
        self._push_message_bytes = 0  # the largest message of the push being received
        self._batch_answers: list[shard_pb2.Update] = []  # of the batch push being taken
        self._stream_of: tuple[str, int] | None = None  # (run, rank), once a push was accepted

    def decode(self, msg: SyncRequest) -> list[WirePushChunk]:
        store = self._core.store
        try:
            chunks = push_chunks(msg, self._servicer.shm_arenas, store)
        except (wire.WireError, BadShmReference, StaleShmEpoch) as exc:
            head = push_header(msg)
            store.record_refusal(_reason(exc), head.run_id, head.rank, head.table)
            raise
        for chunk in chunks:
            self.session.received(chunk)
        return chunks

    async def answer(self, chunk: PushChunk) -> list[bytes]:
        self._current = chunk
        if isinstance(chunk, WirePushChunk):
            self._push_message_bytes = max(self._push_message_bytes, chunk.message_bytes)
        answer = await self._core.feed(self.session, chunk)
        if self._stream_of is None:
            self._stream_of = (chunk.run_id, chunk.rank)
            self._servicer.tracker.stream_opened(*self._stream_of)
        if answer is not None and log.isEnabledFor(logging.DEBUG):
            log.debug(kv("answered", run=chunk.run_id, rank=chunk.rank, step=answer.step,
                         table=answer.table, rows=int(answer.ids.shape[0]),
                         duplicate=answer.duplicate))
        in_shm = (answer_in_shm(chunk.sink, answer)
                  if answer is not None and isinstance(chunk.sink, ShmPush) else None)
        if isinstance(chunk, WirePushChunk) and chunk.batch_size:
            if in_shm is not None:
                self._batch_answers.append(in_shm)
            if chunk.batch_index == chunk.batch_size - 1 and self._batch_answers:
                batch, self._batch_answers = self._batch_answers, []
                return [shard_pb2.Update(batch=batch).SerializeToString()]
            return []
        if answer is None:
            return []
        if in_shm is not None:
            return [in_shm.SerializeToString()]
        delta_dtype = chunk.update_dtype if isinstance(chunk, WirePushChunk) else torch.float32
        # Encoding copies the answer (and converts a bf16/fp16 delta): in the update pool,
        # where the copy runs without the GIL, not on the event loop. Answer in messages
        # as large as the push's (the client's --max-chunk-bytes: gRPC moves 1-4 MiB
        # messages fastest, and an answer of one 30+ MiB message is a fresh mmap, page
        # faults included, every time). (+1 KiB: rows_per_chunk leaves that much for the
        # header fields; a push from the generated code, of unknown size, gets the
        # server's limit.)
        limit_bytes = self._servicer.max_message_bytes
        if self._push_message_bytes:
            limit_bytes = min(limit_bytes, max(self._push_message_bytes + 1024,
                                               MIN_ANSWER_MESSAGE_BYTES))
        self._push_message_bytes = 0
        return await self._core.offload(encode_answer, answer, limit_bytes, delta_dtype)

    def fields(self) -> dict[str, Any]:
        chunk = self._current
        if chunk is None:
            return {}
        return {"run": chunk.run_id, "rank": chunk.rank, "step": chunk.step,
                "table": chunk.table}

    def close(self) -> None:
        self.session.close()
        if self._stream_of is not None:
            self._servicer.stream_closed(*self._stream_of)


class ShardServicer(shard_pb2_grpc.ShardServiceServicer):
    def __init__(self, core: ShardCore, max_message_bytes: int, *,
                 tracker: RunTracker | None = None, stop_when_run_over: bool = False,
                 run_idle_timeout_s: float = 0.0,
                 shm_arenas: ArenaRegistry | None = None) -> None:
        self.core = core
        # Arenas of same-node ranks (ps/shm.py); None: --shm false, none is accepted.
        self.shm_arenas = shm_arenas
        self.max_message_bytes = max_message_bytes
        self.tracker = tracker or RunTracker()
        self.stop_when_run_over = stop_when_run_over
        self.run_idle_timeout_s = run_idle_timeout_s
        self.stopping = asyncio.Event()
        # ps/direct.py's socket, told to ranks whose arena is accepted ("": none).
        self.sync_socket = ""

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

    def stream_closed(self, run_id: str, rank: int) -> None:
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
            row_dtype = row_dtype_arg(request)
            tables = await self.core.register(
                request.run_id, request.rank, request.world_size, request.incarnation,
                table_specs(request), optimizer_args(request.optimizer), restore, row_dtype)
        except Exception as exc:
            await abort_with(context, "Register", exc, run=request.run_id, rank=request.rank)
            raise  # unreachable: abort raises
        self.tracker.registered(request.run_id, request.rank)
        response = shard_pb2.RegisterResponse(server_id=self.core.store.server_id,
                                              max_message_bytes=self.max_message_bytes)
        response.row_dtype = wire.wire_dtype(row_dtype)  # type: ignore[assignment]
        for t in tables:
            response.tables.add(name=t.name, rows_held=t.rows_held, last_step=t.last_step,
                                created=t.created)
        if request.HasField("shm"):
            if self.shm_arenas is None:
                accepted, reason, epoch = False, "this server runs with --shm false", 0
            else:
                offer = request.shm
                accepted, reason, epoch = await self.core.offload(
                    self.shm_arenas.attach, request.run_id, request.rank, offer.path,
                    offer.size, offer.nonce)
            response.shm.accepted, response.shm.reason = accepted, reason
            response.shm.epoch = epoch
            if accepted:
                response.shm.sync_socket = self.sync_socket
        return response

    async def Sync(self, request_iterator: AsyncIterator[SyncRequest],
                   context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """Yields encoded Update messages (answer_updates; the codec passes bytes on)."""
        stream = SyncStream(self)
        inbox: asyncio.Queue[PushChunk | BaseException | None] = asyncio.Queue(SYNC_READ_AHEAD)
        reader = asyncio.create_task(self._read(request_iterator, stream, inbox))
        stop_wait = asyncio.ensure_future(self.stopping.wait())
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
                for update in await stream.answer(item):
                    yield update
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_with(context, "Sync", exc, **stream.fields())
        finally:
            stop_wait.cancel()
            reader.cancel()
            stream.close()

    async def _read(self, request_iterator: AsyncIterator[SyncRequest], stream: SyncStream,
                    inbox: asyncio.Queue[PushChunk | BaseException | None]) -> None:
        """Decode pushes as they arrive, ahead of the one being applied."""
        try:
            async for msg in request_iterator:
                for chunk in stream.decode(msg):
                    await inbox.put(chunk)
            await inbox.put(None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a refused message, or the stream broke: the handler ends
            await inbox.put(exc)

    async def SeedRows(self, request: shard_pb2.SeedRowsRequest,
                       context: grpc.aio.ServicerContext) -> shard_pb2.SeedRowsResponse:
        what = (f"seed run={request.run_id!r} rank={request.rank} table={request.table!r} "
                f"rows from {request.row_start}")
        try:
            rows_ND = wire.decode(request.rows, f"{what}: rows")
            seeded, held = await self.core.seed_rows(request.run_id, request.rank,
                                                     request.incarnation, request.table,
                                                     request.row_start, rows_ND)
        except Exception as exc:
            await abort_with(context, "SeedRows", exc, run=request.run_id, rank=request.rank,
                             table=request.table)
            raise
        return shard_pb2.SeedRowsResponse(rows_seeded=seeded, rows_held=held)

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
        if self.shm_arenas is not None:
            self.shm_arenas.release(request.run_id, request.rank, "finish")
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
