"""The shard server as an update source (`ShardClient`, worker/updates.py's interface).

Register once, then one bidirectional Sync stream (with --row-dtype bf16, SeedRows in
between to upload the fp32 initial rows into the server's master copy); a rank whose
arena the server accepted sends the Sync messages over the server's Sync socket
instead (worker/direct.py), on the training thread.

Why a dedicated thread with its own asyncio event loop (uvloop when
available) and a grpc.aio channel, rather than the sync grpc API with a
request-iterator thread: one thread owns every piece of connection state
(the stream, unanswered pushes, partial chunked updates, reconnect/backoff),
so reconnecting and re-sending is a plain sequential coroutine without locks
around the stream; the training thread only hands over pushes with
`loop.call_soon_threadsafe` (never blocks on the network) and takes
complete updates from a condition-guarded buffer with a deadline. Encoding
the protobuf messages also happens on that thread, off the training loop.
No fork is ever made after the channel exists (batches are generated
in-process, no DataLoader workers), so the gRPC core is fork-safe here.

Failure handling: every wait has a deadline (`--ps-timeout`): registering,
waiting for an update, and a broken stream, which is retried with
exponential backoff (re-Register, then re-send every unanswered push; the
server dedupes by (run, rank, incarnation, step) and answers duplicates from
its cache). If the server stays down past the deadline, or refuses a push,
the error is raised on the training thread naming the server and the step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import grpc
import torch

from hybridps import wire
from hybridps.channel_options import channel_options
from hybridps.logs import kv
from hybridps.optim import OptimizerSpec
from hybridps.security import ClientSecurity, open_aio_channel, open_channel
from hybridps.v1 import shard_pb2, shard_pb2_grpc
from worker.config import SHM_MODES, SHM_SOCKET_MODES
from worker.direct import DirectChannel
from worker.embedding import TableConfig
from worker.shm import (
    ClientArena,
    Region,
    ShmPush,
    batch_message,
    create_arena,
    log_fallback,
    place,
)
from worker.updates import (  # re-exported: the errors and types of every source
    Grads,
    RowUpdate,
    ServerRefused,
    ServerTimeout,
    ServerUnavailable,
    SyncError,
    UpdateSource,
)

log = logging.getLogger("worker.sync")

# gRPC codes after which a broken stream is worth re-registering and re-sending.
RETRYABLE = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
    grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
})
BACKOFF_START_S = 0.05
BACKOFF_MAX_S = 2.0
OPTIMIZER_KIND = {"adam": shard_pb2.OptimizerConfig.ADAM,
                  "adamw": shard_pb2.OptimizerConfig.ADAMW,
                  "sgd": shard_pb2.OptimizerConfig.SGD}

# table -> the owned rows as initialised, fp32 blocks (global start, rows): seeds a master
InitialRows = Callable[[str], Iterator[tuple[int, torch.Tensor]]]


def make_incarnation() -> int:
    """Grows across restarts: wall-clock milliseconds, then torchelastic's restart count."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    return int(time.time() * 1000) * 1000 + min(restarts, 999)


def optimizer_message(spec: OptimizerSpec) -> shard_pb2.OptimizerConfig:
    return shard_pb2.OptimizerConfig(kind=OPTIMIZER_KIND[spec.kind], lr=spec.lr,
                                     beta1=spec.beta1, beta2=spec.beta2, eps=spec.eps,
                                     weight_decay=spec.weight_decay)



class ShardClient(UpdateSource):
    """Register + one Sync stream to the node's shard server, from a background thread."""

    def __init__(self, address: str, *, run_id: str, rank: int, world_size: int,
                 tables: Sequence[TableConfig], ranges: dict[str, tuple[int, int]],
                 optimizer: OptimizerSpec, timeout_s: float, max_chunk_bytes: int,
                 incarnation: int | None = None,
                 restore: tuple[str, int] | None = None,
                 security: ClientSecurity | None = None,
                 row_dtype: torch.dtype = torch.float32,
                 initial_rows: InitialRows | None = None,
                 wire_dtype: torch.dtype = torch.float32,
                 shm: str = "off", shm_bytes: int = 64 << 20,
                 shm_socket: str = "auto") -> None:
        super().__init__([t.name for t in tables], timeout_s)
        # --shm auto|on|off, --shm-mb: the same-node data plane (worker/shm.py).
        if shm not in SHM_MODES:
            raise ValueError(f"shm={shm!r} is not one of {', '.join(SHM_MODES)}")
        self.shm_mode, self.shm_bytes = shm, shm_bytes
        # --shm-socket auto|off: with an accepted arena, the Sync messages go over the
        # server's Unix socket, sent and read on the training thread (worker/direct.py).
        if shm_socket not in SHM_SOCKET_MODES:
            raise ValueError(f"shm_socket={shm_socket!r} is not one of "
                             f"{', '.join(SHM_SOCKET_MODES)}")
        self.shm_socket_mode = shm_socket
        self._direct_path = ""  # the socket the server offered at the latest Register
        # While set, the training thread owns the data plane: _unanswered, _partial, the
        # arena's ring and the buffer's filling; the loop thread only runs control calls.
        self._direct: DirectChannel | None = None
        self._leave_direct: asyncio.Event | None = None  # set: stream over gRPC, or closing
        self._broken_since: float | None = None  # broke, with no answer since (_broken)
        self._arena: ClientArena | None = None
        self._shm_epoch = 0  # > 0 while the server accepts the arena
        self._shm_lock = threading.Lock()
        self._shm_answered: dict[tuple[int, str], Region] = {}  # regions of arrived updates
        self._shm_taken: list[Region] = []  # freed at the next take()
        if wire_dtype not in WIRE_DTYPES.values():
            raise ValueError(f"wire dtype {wire_dtype} is not one of "
                             f"{', '.join(map(str, WIRE_DTYPES.values()))}")
        # --wire-dtype: gradients go, and deltas come back, in this dtype (math is fp32).
        self.wire_dtype = wire_dtype
        # bf16 rows: the server keeps an fp32 master, seeded from `initial_rows` right
        # after the Register that creates the partition (a restore loads it instead).
        if row_dtype != torch.float32 and initial_rows is None:
            raise ValueError(f"row dtype {row_dtype} needs initial_rows to seed the master")
        self.row_dtype = row_dtype
        self.initial_rows = initial_rows
        self.security = security or ClientSecurity()
        # (checkpoint directory, step): the first Register loads the server state from it.
        self.restore = restore
        self.address, self.run_id, self.rank, self.world_size = address, run_id, rank, world_size
        self.incarnation = make_incarnation() if incarnation is None else incarnation
        self.table_specs = [shard_pb2.TableSpec(name=t.name, num_rows=t.num_rows, dim=t.dim,
                                                row_start=ranges[t.name][0],
                                                row_end=ranges[t.name][1]) for t in tables]
        self.dims = {t.name: t.dim for t in tables}
        self.table_index = {t.name: i for i, t in enumerate(tables)}
        self.optimizer = optimizer
        self.max_chunk_bytes = max_chunk_bytes
        self.server_id = ""
        self.state = "starting"
        self.last_error = ""
        self.newest_pushed = -1
        # Owned by the event-loop thread:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stub: shard_pb2_grpc.ShardServiceStub | None = None
        self._sync: Any = None  # the Sync method with the copy-free codec (hybridps/wire.py)
        # Pushes are kept encoded: a re-sent push is the same bytes, not encoded again
        # (a push by shared memory: its header, stamped with the epoch when sent).
        self._unanswered: dict[tuple[int, int], list[bytes] | ShmPush] = {}
        self._push_lr: dict[int, float] = {}  # step -> Push.lr, until the step is taken
        self._partial: dict[tuple[int, int], list[wire.Framed[shard_pb2.Update]]] = {}
        self._outq: asyncio.Queue[bytes | None] | None = None
        self._call: Any = None
        self._closing = False
        self._finishing: asyncio.Task[Any] | None = None  # end_run's Finish call, in flight
        self._progress = False
        self._enqueued_through = -1  # newest step whose pushes the loop thread holds
        if restore is not None:
            self._enqueued_through = self.newest_pushed = restore[1]
            self.buffer.start_at(restore[1])
        self._registered = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, name="hybridps-sync",
                                        daemon=True)

    # -- training-thread API ------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        if not self._registered.wait(self.timeout_s + 5.0):
            raise ServerTimeout(f"rank {self.rank}: could not register with shard server "
                                f"{self.address} within {self.timeout_s:g}s")
        if self.buffer.fatal is not None:
            raise self.buffer.fatal

    def push(self, step: int, grads: Grads, lr: float | None = None) -> None:
        if lr is not None:  # Push.lr of this step's pushes (and of their re-sends)
            self._push_lr[step] = lr
        if self.buffer.fatal is not None:
            raise self.buffer.fatal
        loop = self._loop
        if loop is None or loop.is_closed():
            raise SyncError(f"rank {self.rank}: sync thread for shard server {self.address} "
                            "is not running")
        payload = [(name, grads[name][0].detach().cpu(), grads[name][1].detach().cpu())
                   for name in self.buffer.tables]
        self.newest_pushed = step
        if self._direct is not None:
            self._send_direct(self._enqueue(step, payload))
            return
        loop.call_soon_threadsafe(self._enqueue, step, payload)

    def take(self, through_step: int) -> tuple[list[RowUpdate], bool]:
        """UpdateSource.take. Updates answered by shared memory view their regions of the
        arena (ids and delta, no copy): valid until the next take, which frees them."""
        waited = self._pump_direct(through_step)
        arena = self._arena
        if arena is None:
            updates, blocked = super().take(through_step)
            for step in [s for s in self._push_lr if s <= through_step]:
                del self._push_lr[step]  # answered: never re-sent
            return updates, blocked or waited
        with self._shm_lock:
            taken, self._shm_taken = self._shm_taken, []
        for region in taken:
            arena.ring.free(region)
        updates, blocked = super().take(through_step)
        for step in [s for s in self._push_lr if s <= through_step]:
            del self._push_lr[step]  # answered: never re-sent
        with self._shm_lock:
            for u in updates:
                if (u.step, u.table) in self._shm_answered:
                    self._shm_taken.append(self._shm_answered.pop((u.step, u.table)))
        return updates, blocked or waited

    def peek(self, through_step: int) -> list[RowUpdate]:
        self._pump_direct(through_step)
        return super().peek(through_step)

    def describe_wait(self, step: int, timeout_s: float) -> str:
        missing = ", ".join(self.buffer.missing(step)) or "?"
        text = (f"rank {self.rank}: no update from shard server {self.address} for step {step} "
                f"(tables {missing}) after {timeout_s:g}s; newest step pushed "
                f"{self.newest_pushed}, newest fully answered {self.buffer.arrived_through}, "
                f"connection {self.state}")
        if self.last_error:
            text += f", last error: {self.last_error}"
        return text

    def finish(self, last_step: int) -> None:
        """Flush: the server confirms it applied every push through `last_step`."""
        loop = self._loop
        if last_step < 0 or loop is None or loop.is_closed() or self._stub is None:
            return
        request = shard_pb2.FlushRequest(run_id=self.run_id, rank=self.rank, step=last_step,
                                         timeout_s=self.timeout_s)
        stub = self._stub

        async def flush() -> Any:
            return await stub.Flush(request, timeout=self.timeout_s + 5.0,
                                    metadata=self.security.metadata)

        future = asyncio.run_coroutine_threadsafe(flush(), loop)
        try:
            future.result(self.timeout_s + 10.0)
        except grpc.RpcError as exc:
            raise SyncError(f"rank {self.rank}: Flush through step {last_step} on shard server "
                            f"{self.address} failed: {_rpc_text(exc)}") from None
        except TimeoutError:
            future.cancel()
            raise ServerTimeout(f"rank {self.rank}: Flush through step {last_step} on shard "
                                f"server {self.address} timed out") from None

    def checkpoint(self, step: int, directory: str) -> list[Any]:
        """The server saves this rank's optimizer state once it applied every push <= step."""
        loop, stub = self._loop, self._stub
        if loop is None or loop.is_closed() or stub is None:
            raise SyncError(f"rank {self.rank}: sync thread for shard server {self.address} "
                            "is not running")
        request = shard_pb2.CheckpointRequest(run_id=self.run_id, step=step,
                                              directory=directory, ranks=[self.rank],
                                              timeout_s=self.timeout_s)

        async def call() -> Any:
            return await stub.Checkpoint(request, timeout=self.timeout_s + 60.0,
                                         metadata=self.security.metadata)

        future = asyncio.run_coroutine_threadsafe(call(), loop)
        try:
            response = future.result(self.timeout_s + 70.0)
        except grpc.RpcError as exc:
            raise SyncError(f"rank {self.rank}: Checkpoint of step {step} on shard server "
                            f"{self.address} failed: {_rpc_text(exc)}") from None
        except TimeoutError:
            future.cancel()
            raise ServerTimeout(f"rank {self.rank}: Checkpoint of step {step} on shard server "
                                f"{self.address} timed out") from None
        return list(response.files)

    def end_run(self, last_step: int, aborted: bool = False, reason: str = "") -> bool:
        """Finish: this rank is done (after its last Flush, or stopping early).

        A server with --exit-after-run stops once every rank of the run finished. The
        Sync stream is then ended by the server, so the sync thread stops instead of
        reconnecting. Never raises: returns False (and logs) when the server was not told.
        """
        request = shard_pb2.FinishRequest(run_id=self.run_id, rank=self.rank,
                                          incarnation=self.incarnation, last_step=last_step,
                                          aborted=aborted, reason=reason)
        timeout = min(self.timeout_s, 10.0)
        loop, stub = self._loop, self._stub

        def direct() -> Any:
            # The sync thread is gone or its loop ended under the call: a short call of our own.
            log.info(kv("finish_direct", server=self.address, last_error=self.last_error or "-"))
            with open_channel(self.address, channel_options(), self.security) as channel:
                return shard_pb2_grpc.ShardServiceStub(channel).Finish(
                    request, timeout=timeout, metadata=self.security.metadata)

        try:
            if loop is None or loop.is_closed() or stub is None or not self._thread.is_alive():
                response = direct()
            else:
                async def call() -> Any:
                    self._closing = True  # the stream ending from here on is expected
                    self._finishing = asyncio.current_task()  # _main waits for it
                    return await stub.Finish(request, timeout=timeout,
                                             metadata=self.security.metadata)

                future = asyncio.run_coroutine_threadsafe(call(), loop)
                try:
                    response = future.result(timeout + 5.0)
                except (asyncio.CancelledError, concurrent.futures.CancelledError, RuntimeError):
                    # The stream ended meanwhile and the sync loop shut down with our call
                    # still pending: the Finish was never sent to completion, send it again.
                    response = direct()
        except Exception as exc:  # best effort: the run's outcome does not depend on it
            text = _rpc_text(exc) if isinstance(exc, grpc.RpcError) else repr(exc)
            log.warning(kv("finish_failed", server=self.address, last_step=last_step,
                           aborted=aborted, error=text))
            return False
        log.info(kv("finished", server=self.address, last_step=last_step, aborted=aborted,
                    reason=reason or "-",
                    ranks_finished=f"{response.ranks_finished}/{response.ranks_registered}",
                    server_stopping=response.server_stopping))
        return True

    def close(self) -> None:
        direct, self._direct = self._direct, None
        if direct is not None:
            direct.close()
        loop = self._loop
        if loop is not None and not loop.is_closed() and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop may close meanwhile
                loop.call_soon_threadsafe(self._begin_close)
            self._thread.join(min(self.timeout_s, 10.0))
            if self._thread.is_alive() and not loop.is_closed():
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(self._cancel_call)
                self._thread.join(5.0)
        if self._arena is not None and not self._thread.is_alive():
            self._arena.close()  # unmapped once the last RowUpdate viewing it is gone

    # -- event-loop thread --------------------------------------------------------------
    def _thread_main(self) -> None:
        try:
            import uvloop

            loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
            loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        except SyncError as exc:
            self.buffer.fail(exc)
        except BaseException as exc:  # surfaced on the training thread, never swallowed
            self.buffer.fail(SyncError(f"rank {self.rank}: sync thread for shard server "
                                       f"{self.address} died: {type(exc).__name__}: {exc}"))
        finally:
            self.state = "closed"
            self._registered.set()
            try:
                # Like asyncio.run: end what is left (e.g. the request pump of a stream the
                # server ended while we were closing), then the async generators.
                pending = asyncio.all_tasks(loop)
                for task in pending:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()

    async def _main(self) -> None:
        options = channel_options(self._max_receive_bytes)
        async with open_aio_channel(self.address, options, self.security) as channel:
            try:
                await self._run(channel)
            finally:
                await self._settle_finish()

    async def _settle_finish(self) -> None:
        """Before the channel closes: let a Finish in flight get its answer.

        The server that stops once every rank finished ends this stream while answering
        the last Finish; ending the loop then would cancel that call on the channel.
        """
        task = self._finishing
        if task is not None and not task.done():
            await asyncio.wait({task}, timeout=min(self.timeout_s, 10.0) + 1.0)

    async def _run(self, channel: grpc.aio.Channel) -> None:
        """Register, then stream until done, reconnecting on retryable errors."""
        self._stub = shard_pb2_grpc.ShardServiceStub(channel)
        self._sync = channel.stream_stream(SYNC_METHOD, request_serializer=_as_bytes,
                                           response_deserializer=_decode_update)
        await self._register(first=True)
        self._leave_direct = asyncio.Event()
        self._open_direct()
        self._registered.set()
        if self._direct is not None:
            await self._leave_direct.wait()
            if self._direct is not None or self._closing:
                return  # closing while the socket carried the data plane
        while True:
            try:
                self.state = "streaming"
                if await self._stream():
                    return
                self.last_error = "server ended the Sync stream"
            except grpc.aio.AioRpcError as exc:
                self._check_retryable(exc)
            if self._closing:
                return
            await self._reconnect(self._broken("stream"))
            if self._closing:
                return

    async def _reconnect(self, broken_since: float) -> None:
        """Backoff + re-Register until it works, or ServerUnavailable past the deadline."""
        self.state = "reconnecting"
        delay = BACKOFF_START_S
        while not self._closing:
            left = broken_since + self.timeout_s - time.monotonic()
            if left <= 0:
                first = min(self._unanswered)[0] if self._unanswered else None
                raise ServerUnavailable(
                    f"rank {self.rank}: shard server {self.address} unreachable for "
                    f"{self.timeout_s:g}s (last error: {self.last_error}); "
                    f"{len(self._unanswered)} pushes unanswered"
                    + (f" from step {first}" if first is not None else ""))
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, BACKOFF_MAX_S)
            try:
                await self._register(first=False, timeout=max(min(left, 10.0), 0.1))
                return
            except grpc.aio.AioRpcError as exc:
                self._check_retryable(exc)

    def _check_retryable(self, exc: grpc.aio.AioRpcError) -> None:
        """Note the error; a refusal (not worth a retry) is raised naming the server."""
        self.last_error = _rpc_text(exc)
        if exc.code() not in RETRYABLE:
            raise ServerRefused(self._refusal_text(exc)) from None

    def _broken(self, transport: str) -> float:
        """Count and log a broken connection; returns when it broke: the re-Register
        deadline runs from the last answer, not from each of several breaks in a row."""
        if self._progress or self._broken_since is None:
            self._broken_since = time.monotonic()
        self._progress = False
        self.stats.reconnects += 1
        log.warning(kv("reconnect", server=self.address, error=self.last_error,
                       unanswered=len(self._unanswered), transport=transport))
        return self._broken_since

    async def _register(self, *, first: bool, timeout: float | None = None) -> None:
        assert self._stub is not None
        request = shard_pb2.RegisterRequest(
            run_id=self.run_id, rank=self.rank, world_size=self.world_size,
            incarnation=self.incarnation, tables=self.table_specs,
            optimizer=optimizer_message(self.optimizer))
        if self.row_dtype != torch.float32:  # unset for fp32: what older servers expect
            request.row_dtype = wire.wire_dtype(self.row_dtype)  # type: ignore[assignment]
        if first and self.restore is not None:
            request.restore.directory, request.restore.step = self.restore
        if first and self.shm_mode != "off" and self._arena is None:
            self._create_arena()
        # The arena is offered first, then on every re-Register while the server uses it.
        offer = self._arena is not None and (first or self._shm_epoch > 0)
        if offer and self._arena is not None:
            request.shm.CopyFrom(self._arena.offer())
        try:
            response = await self._stub.Register(
                request, timeout=timeout or self.timeout_s, wait_for_ready=first,
                metadata=self.security.metadata)
        except grpc.aio.AioRpcError as exc:
            if not first:
                raise
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise ServerTimeout(f"rank {self.rank}: could not register with shard server "
                                    f"{self.address} within {self.timeout_s:g}s "
                                    f"({_rpc_text(exc)})") from None
            raise ServerRefused(self._refusal_text(exc)) from None
        self.stats.registers += 1
        self.server_id = response.server_id
        if response.max_message_bytes > 0:
            self.max_chunk_bytes = min(self.max_chunk_bytes, int(response.max_message_bytes))
        self._check_registered_state(response, first)
        if offer:
            self._on_shm_status(response.shm, first)
        if self.row_dtype != torch.float32:
            await self._seed_master(response, first)

    # -- shared memory (worker/shm.py) ------------------------------------------------
    def _create_arena(self) -> None:
        try:
            self._arena, why = create_arena(self.shm_mode, self.shm_bytes, self.rank)
        except OSError as exc:  # ShmUnavailable, with --shm on
            raise ServerRefused(f"rank {self.rank}: --shm on: {exc}") from None
        if self._arena is None:
            self.stats.shm = f"inline: {why}"
            log_fallback(self.address, why)

    def _on_shm_status(self, status: shard_pb2.SharedMemoryStatus, first: bool) -> None:
        """The server's answer to the arena offered at Register."""
        arena = self._arena
        assert arena is not None
        if first:
            arena.unlink()  # the server mapped it by now, or never will: no file left behind
        self._direct_path = status.sync_socket if self.shm_socket_mode != "off" else ""
        if status.accepted:
            if first:
                log.info(kv("shm", server=self.address, path=arena.path, bytes=arena.size,
                            epoch=status.epoch))
            self._shm_epoch = int(status.epoch)
            self.stats.shm = "on"
            return
        reason = status.reason or "the server does not offer shared memory (an older server)"
        if self.shm_mode == "on":
            raise ServerRefused(
                f"rank {self.rank}: --shm on, but shard server {self.address} did not accept "
                f"the shared-memory arena {arena.path}: {reason} (--shm auto falls back to "
                "inline tensors)")
        self._shm_epoch = 0
        self.stats.shm = f"inline: {reason}"
        log_fallback(self.address, reason)
        if first:
            arena.close()
            self._arena = None
            return
        # The server no longer holds the arena (it was restarted?): re-send inline.
        for key, pending in self._unanswered.items():
            if isinstance(pending, ShmPush):
                self._unanswered[key] = self._encode(key[0], self.buffer.tables[key[1]],
                                                     pending.slot.ids, pending.slot.grads)

    def _place(self, step: int, name: str, ids_U: torch.Tensor,
               grads_UD: torch.Tensor) -> ShmPush | None:
        """The push by reference into the arena; None: inline (no arena, or no room)."""
        arena = self._arena
        if arena is None or not self._shm_epoch:
            return None
        answer_dtype = self.row_dtype if self.row_dtype != torch.float32 else self.wire_dtype
        slot = place(arena, ids_U, grads_UD, self.wire_dtype, answer_dtype)
        if slot is None:
            self.stats.shm_inline_pushes += 1
            if self.stats.shm_inline_pushes == 1:
                log.warning(kv("shm_full", step=step, table=name, rows=int(ids_U.shape[0]),
                               arena_bytes=arena.size, used=arena.ring.used,
                               hint="this push (and others that do not fit) goes inline; "
                                    "raise --shm-mb"))
            return None
        head = shard_pb2.Push(run_id=self.run_id, rank=self.rank, incarnation=self.incarnation,
                              step=step, table=name, chunk=0, num_chunks=1,
                              update_dtype=self._update_dtype(),  # type: ignore[arg-type]
                              shm_ids=slot.refs[0], shm_grads=slot.refs[1],
                              shm_answer=slot.refs[2], lr=self._push_lr.get(step))
        self.stats.shm_pushes += 1
        self.stats.shm_bytes += slot.tensor_bytes
        return ShmPush(head, slot)

    def _update_dtype(self) -> int:
        return (shard_pb2.DTYPE_UNSPECIFIED if self.wire_dtype == torch.float32
                else wire.wire_dtype(self.wire_dtype))

    def _on_shm_update(self, key: tuple[int, int], pending: list[bytes] | ShmPush,
                       update: shard_pb2.Update) -> None:
        what = f"update step {update.step} table {update.table!r}"
        if not (isinstance(pending, ShmPush) and update.shm and update.chunk == 0
                and update.num_chunks in (0, 1)):
            sent = "by shared memory" if isinstance(pending, ShmPush) else "inline"
            got = "by shared memory" if update.shm else "inline"
            raise ServerRefused(f"rank {self.rank}: {what}: a push sent {sent} was answered "
                                f"{got} (chunk {update.chunk} of {update.num_chunks})")
        if update.rows != (self.row_dtype != torch.float32):
            raise ServerRefused(f"rank {self.rank}: {what}: the server answered "
                                f"{'rows' if update.rows else 'a delta'} but this rank keeps "
                                f"{self.row_dtype} rows")
        slot = pending.slot
        delta_UD = slot.answer
        if not update.rows and delta_UD.dtype in (torch.bfloat16, torch.float16):
            delta_UD = delta_UD.float()  # --wire-dtype: here, not on the training thread
        del self._unanswered[key]
        self._progress = True
        self.stats.updates += 1
        self.stats.update_chunks += 1
        self.stats.duplicates += int(update.duplicate)
        with self._shm_lock:
            self._shm_answered[(update.step, update.table)] = slot.region
        self.buffer.put(RowUpdate(update.step, update.table, slot.ids, delta_UD,
                                  float(update.decay), update.duplicate, update.rows))

    @property
    def _max_receive_bytes(self) -> int:
        """The largest answer message taken (the channel's and the socket's limit)."""
        return max(self.max_chunk_bytes * 2, 64 * 1024 * 1024)

    # -- the Sync socket (worker/direct.py), on the training thread ---------------------
    def _open_direct(self) -> None:
        """Connect to the Sync socket the server offered, if any; else keep the stream."""
        if not self._direct_path or not self._shm_epoch:
            return
        try:
            self._direct = DirectChannel(self._direct_path, self.security.token,
                                         self.timeout_s, self._max_receive_bytes)
        except grpc.aio.AioRpcError as exc:
            log.info(kv("sync_socket_fallback", server=self.address, path=self._direct_path,
                        error=_rpc_text(exc), hint="Sync messages travel over gRPC"))
            self.stats.transport = "stream"
            return
        if self.stats.transport != "socket":
            log.info(kv("sync_socket", server=self.address, path=self._direct_path))
        self.stats.transport = "socket"
        self.state = "socket"

    def _send_direct(self, msgs: list[bytes]) -> None:
        direct = self._direct
        assert direct is not None
        try:
            for msg in msgs:
                direct.send(msg)
        except grpc.aio.AioRpcError as exc:
            self._recover_direct(exc)  # re-sends every unanswered push, these included

    def _pump_direct(self, through_step: int) -> bool:
        """Read the socket until every update through `through_step` arrived; True if it
        had to wait for one (what already arrived is read without waiting first, so the
        staleness stats count real waits, not reads)."""
        deadline: float | None = None
        waited = False
        while self._direct is not None and self.buffer.arrived_through < through_step:
            now = time.monotonic()
            if deadline is None:
                deadline, wait_s = now + self.timeout_s, 0.0
            elif now >= deadline:
                raise ServerTimeout(self.describe_wait(self.buffer.arrived_through + 1,
                                                       self.timeout_s))
            else:
                waited, wait_s = True, deadline - now
            try:
                for data in self._direct.receive(wait_s):
                    self._on_update(_decode_update(data))
            except grpc.aio.AioRpcError as exc:
                self._recover_direct(exc)
        return waited

    def _recover_direct(self, exc: grpc.aio.AioRpcError) -> None:
        """The socket broke or the server ended it: re-Register (backoff, up to
        --ps-timeout), reconnect, re-send every unanswered push; the stream when the
        server no longer offers the socket. Refusals are raised naming the server."""
        loop = self._loop
        while True:
            self._check_retryable(exc)
            broken, self._direct = self._direct, None
            if broken is not None:
                broken.close()
            since = self._broken("socket")
            if loop is None or loop.is_closed():
                raise SyncError(f"rank {self.rank}: sync thread for shard server "
                                f"{self.address} is not running")
            future = asyncio.run_coroutine_threadsafe(self._reconnect(since), loop)
            try:
                future.result(self.timeout_s + 15.0)
            except concurrent.futures.TimeoutError:
                future.cancel()
                raise ServerUnavailable(f"rank {self.rank}: shard server {self.address}: "
                                        "re-registering did not finish") from None
            self._open_direct()
            if self._direct is None:  # no socket now: hand the data plane to the stream
                self.state = "streaming"
                loop.call_soon_threadsafe(self._leave_direct_now)
                return
            self._partial.clear()
            try:
                for msg in self._unanswered_messages():
                    self._direct.send(msg)
                return
            except grpc.aio.AioRpcError as again:
                exc = again

    def _unanswered_messages(self) -> Iterator[bytes]:
        """Every unanswered push's messages, in (step, table) order, to re-send after a
        reconnect (by reference: stamped with the epoch of the latest Register)."""
        for key in sorted(self._unanswered):
            pending = self._unanswered[key]
            if isinstance(pending, ShmPush):
                yield pending.message(self._shm_epoch)
            else:
                yield from pending

    def _leave_direct_now(self) -> None:
        if self._leave_direct is not None:
            self._leave_direct.set()

    async def _seed_master(self, response: shard_pb2.RegisterResponse, first: bool) -> None:
        """Upload the fp32 initial rows into the server's master copy of a new partition.

        Only a partition this Register created needs it, and not one restored from a
        checkpoint (the server loaded its master). _check_registered_state already refused
        a re-Register that found the state lost after pushes, so a created partition here
        has seen no push and the initial rows are still the rows' master.
        """
        assert self._stub is not None and self.initial_rows is not None
        if wire.torch_dtype(response.row_dtype) != self.row_dtype:
            raise ServerRefused(
                f"rank {self.rank}: shard server {self.address} registered row dtype "
                f"{wire.dtype_name(response.row_dtype)}, not {self.row_dtype}: it keeps no fp32 "
                "master rows (upgrade the server or use --row-dtype fp32)")
        if first and self.restore is not None:
            return
        for table in response.tables:
            if not table.created:
                continue
            per_chunk = wire.rows_per_chunk(self.dims[table.name], self.max_chunk_bytes)
            seeded = 0
            for start, block_RD in self.initial_rows(table.name):
                for lo, hi in wire.chunk_bounds(int(block_RD.shape[0]), per_chunk):
                    request = shard_pb2.SeedRowsRequest(
                        run_id=self.run_id, rank=self.rank, incarnation=self.incarnation,
                        table=table.name, row_start=start + lo)
                    wire.encode(block_RD[lo:hi], request.rows)
                    try:
                        reply = await self._stub.SeedRows(request, timeout=self.timeout_s,
                                                          metadata=self.security.metadata)
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() in RETRYABLE and not first:
                            raise  # the reconnect loop registers (and seeds) again
                        raise ServerRefused(f"rank {self.rank}: seeding the master rows of "
                                            f"table {table.name!r} on shard server "
                                            f"{self.address} failed: {_rpc_text(exc)}") from None
                    seeded = int(reply.rows_seeded)
            if seeded != table.rows_held:
                raise ServerRefused(f"rank {self.rank}: shard server {self.address} seeded "
                                    f"{seeded} of the {table.rows_held} master rows of table "
                                    f"{table.name!r}")
        log.info(kv("master_seeded", server=self.address,
                    tables=",".join(t.name for t in response.tables if t.created)))

    def _check_registered_state(self, response: shard_pb2.RegisterResponse, first: bool) -> None:
        """The server's optimizer state must be where this process left it."""
        for table in response.tables:
            resumed = -1 if self.restore is None else self.restore[1]
            if first and table.last_step != resumed:
                raise ServerRefused(
                    f"rank {self.rank}: shard server {self.address} already holds optimizer "
                    f"state of run {self.run_id!r} (table {table.name!r} applied through step "
                    f"{table.last_step}); this worker starts at step 0 and cannot resume: use a "
                    "fresh --run-id")
            if not first:
                pending = [s for (s, i) in self._unanswered
                           if self.buffer.tables[i] == table.name]
                oldest = min(pending) if pending else self._enqueued_through + 1
                if ((table.created and self._enqueued_through >= 0)
                        or table.last_step < oldest - 1):
                    raise ServerRefused(
                        f"rank {self.rank}: shard server {self.address} lost the optimizer "
                        f"state of run {self.run_id!r} table {table.name!r} (server says last "
                        f"step {table.last_step}, created={table.created}; this worker has "
                        f"answers through step {oldest - 1}): was it restarted?")

    async def _stream(self) -> bool:
        """One Sync stream; True when it ended because we closed it with nothing pending."""
        assert self._sync is not None
        outq: asyncio.Queue[bytes | None] = asyncio.Queue()
        for msg in self._unanswered_messages():
            outq.put_nowait(msg)
        if self._closing:
            outq.put_nowait(None)
        self._partial.clear()
        self._outq = outq
        self._call = self._sync(_drain(outq), metadata=self.security.metadata)
        try:
            async for update in self._call:
                self._on_update(update)
        finally:
            self._outq = None
            self._call = None
        return self._closing and not self._unanswered

    def _enqueue(self, step: int, payload: list[tuple[str, torch.Tensor, torch.Tensor]]
                 ) -> list[bytes]:
        """Record the step's pushes as unanswered and encode them; queued for the stream
        when one runs (the caller sends them over the Sync socket otherwise)."""
        self._enqueued_through = max(self._enqueued_through, step)
        msgs: list[bytes] = []
        by_reference: list[ShmPush] = []
        for name, ids_U, grads_UD in payload:
            placed = self._place(step, name, ids_U, grads_UD)
            if placed is not None:
                by_reference.append(placed)
                self._unanswered[(step, self.table_index[name])] = placed
            else:
                inline = self._encode(step, name, ids_U, grads_UD)
                self._unanswered[(step, self.table_index[name])] = inline
                msgs += inline
            self.stats.pushes += 1
            self.stats.push_rows += int(ids_U.numel())
        if len(by_reference) > 1:  # one message for the step's tables, not one per table
            msgs.append(batch_message(by_reference, self._shm_epoch, self.run_id, self.rank))
            self.stats.shm_batches += 1
        elif by_reference:
            msgs.append(by_reference[0].message(self._shm_epoch))
        self.stats.push_chunks += len(msgs)
        self.stats.push_bytes += sum(len(m) for m in msgs)
        if self._outq is not None:
            for msg in msgs:
                self._outq.put_nowait(msg)
        return msgs

    def _encode(self, step: int, name: str, ids_U: torch.Tensor,
                grads_UD: torch.Tensor) -> list[bytes]:
        grads = grads_UD.to(self.wire_dtype)
        per_chunk = wire.rows_per_chunk(self.dims[name], self.max_chunk_bytes,
                                        grads.element_size())
        bounds = list(wire.chunk_bounds(int(ids_U.shape[0]), per_chunk))
        update_dtype = self._update_dtype()
        msgs = []
        for chunk, (lo, hi) in enumerate(bounds):
            head = shard_pb2.Push(run_id=self.run_id, rank=self.rank,
                                  incarnation=self.incarnation, step=step, table=name,
                                  chunk=chunk, num_chunks=len(bounds),
                                  update_dtype=update_dtype,  # type: ignore[arg-type]
                                  lr=self._push_lr.get(step))
            msgs.append(wire.encode_framed(head, [("ids", ids_U[lo:hi]),
                                                  ("grads", grads[lo:hi])]))
        return msgs

    def _on_update(self, framed: wire.Framed[shard_pb2.Update]) -> None:
        if framed.error is not None:
            raise ServerRefused(f"rank {self.rank}: shard server {self.address} sent an "
                                f"update that does not decode: {framed.error}")
        update = framed.message
        if update.batch:  # the answers to a batch push: shared-memory answers, in order
            for entry in update.batch:
                key = self._answered_key(entry)
                if key is not None:
                    self._on_shm_update(key, self._unanswered[key], entry)
            return
        key = self._answered_key(update)
        if key is None:
            return
        pending = self._unanswered[key]
        if update.shm or isinstance(pending, ShmPush):
            self._on_shm_update(key, pending, update)
            return
        parts = self._partial.setdefault(key, [])
        if update.chunk != len(parts):
            raise ServerRefused(f"rank {self.rank}: update step {update.step} table "
                                f"{update.table!r}: chunk {update.chunk} arrived, expected "
                                f"{len(parts)}")
        parts.append(framed)
        self.stats.update_chunks += 1
        if len(parts) < max(update.num_chunks, 1):
            return
        del self._partial[key]
        what = f"update step {update.step} table {update.table!r}"
        ids = [p.tensor("ids", what) for p in parts]
        deltas = [p.tensor("delta", what) for p in parts]
        # One chunk: the tensors view the received bytes (read-only, kept alive by the
        # views); every consumer of a RowUpdate only reads them, so no copy is made.
        ids_U = torch.cat(ids) if len(ids) > 1 else ids[0]
        delta_UD = torch.cat(deltas) if len(deltas) > 1 else deltas[0]
        if not update.rows and delta_UD.dtype in (torch.bfloat16, torch.float16):
            delta_UD = delta_UD.float()  # --wire-dtype: here, not on the training thread
        dim = self.dims[update.table]
        if ids_U.dim() != 1 or delta_UD.shape != (ids_U.shape[0], dim):
            raise ServerRefused(f"rank {self.rank}: {what}: ids {list(ids_U.shape)} and delta "
                                f"{list(delta_UD.shape)} do not fit a table of dim {dim}")
        del self._unanswered[key]
        self._progress = True
        self.stats.updates += 1
        self.stats.duplicates += int(update.duplicate)
        if update.rows != (self.row_dtype != torch.float32):
            raise ServerRefused(f"rank {self.rank}: {what}: the server answered "
                                f"{'rows' if update.rows else 'a delta'} but this rank keeps "
                                f"{self.row_dtype} rows")
        self.buffer.put(RowUpdate(update.step, update.table, ids_U, delta_UD,
                                  float(update.decay), update.duplicate, update.rows))

    def _answered_key(self, update: shard_pb2.Update) -> tuple[int, int] | None:
        """(step, table index) of the unanswered push `update` answers; None: one we
        already have the answer of (a re-sent push)."""
        index = self.table_index.get(update.table)
        if index is None:
            raise ServerRefused(f"rank {self.rank}: shard server {self.address} sent an update "
                                f"for unknown table {update.table!r} (step {update.step})")
        key = (update.step, index)
        if key not in self._unanswered:
            self.stats.ignored_updates += 1
            return None
        return key

    def _begin_close(self) -> None:
        self._closing = True
        if self._leave_direct is not None:
            self._leave_direct.set()
        if self._outq is not None:
            self._outq.put_nowait(None)

    def _cancel_call(self) -> None:
        if self._call is not None:
            self._call.cancel()

    def _refusal_text(self, exc: grpc.aio.AioRpcError) -> str:
        step = min(self._unanswered)[0] if self._unanswered else self.newest_pushed
        text = (f"rank {self.rank}: shard server {self.address} refused run {self.run_id!r} "
                f"(around step {step}): {_rpc_text(exc)}")
        if self.wire_dtype == torch.float16 and "non-finite" in text:
            text += (" (--wire-dtype fp16: gradients beyond +-65504 become inf on the wire; "
                     "use bf16 or fp32)")
        return text


SYNC_METHOD = "/hybridps.v1.ShardService/Sync"
# --wire-dtype values (worker/config.py validates the flag against these names).
WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _as_bytes(msg: bytes) -> bytes:
    return msg  # pushes are encoded by ShardClient._encode (wire.encode_framed)


def _decode_update(data: bytes) -> wire.Framed[shard_pb2.Update]:
    return wire.decode_framed(shard_pb2.Update, data, ("ids", "delta"), "update")


async def _drain(outq: asyncio.Queue[bytes | None]) -> AsyncIterator[bytes]:
    """The request stream: messages from the queue until the None sentinel (half-close)."""
    while True:
        msg = await outq.get()
        if msg is None:
            return
        yield msg


def _rpc_text(exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    name = code.name if code is not None else "ERROR"
    return f"{name}: {details}"
