"""A rank's gRPC connection to its shard server: every call, and the Sync stream transport.

`ShardRpc` owns one grpc.aio channel on an event loop (uvloop when available) in a
thread of its own, for the life of the client. Every call goes through it: the unary
calls (Register, SeedRows, Flush, Checkpoint, Finish) by `call`, which the calling
thread waits on with a deadline, and the Sync stream by `open_stream`. `metadata` is
the one place a call's credentials are attached: the auth token, and, once a Register
answered it, the partition's secret (hybridps/partition_secret.py). Errors are
TransportErrors (worker/sync/transport.py), never grpc's. Once the server said it is shutting
down (its Sync stream ended so, or a call did), a later call that fails to reach it fails
as that TransportShutdown: the Sync stream learns it first, but a rank may be in a unary
call (a dynamic table's Page) when the server goes, and the refused connections that
follow would otherwise be retried for the whole --ps-timeout.

Why a thread with its own loop: grpc.aio needs a running loop, and the training thread
must never run one (it would have to stop in the middle of a step to let it run). No
fork is ever made after the channel exists (batches are generated in-process, no
DataLoader workers), so the gRPC core is fork-safe here.

`GrpcStreamTransport` is the Sync stream as a SyncTransport: `send` hands the messages
to the loop (never blocks on the network), the loop thread serializes inline pushes
(their gradients copied there, off the training step), writes them and decodes each
response as it arrives (the copy-free codec of hybridps/wire.py), `receive` takes
the decoded responses from a condition-guarded queue with a deadline.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc

from hybridps.channel_options import channel_options
from hybridps.logs import kv
from hybridps.partition_secret import partition_metadata, run_secret_metadata
from hybridps.security import ClientSecurity, open_aio_channel, open_channel
from hybridps.v1 import shard_pb2_grpc
from worker.sync.messages import InlinePush, Outgoing
from worker.sync.transport import (
    Response,
    SyncTransport,
    TransportError,
    TransportRetryable,
    TransportShutdown,
    decode_response,
    transport_error,
)

log = logging.getLogger("worker.grpc")

SYNC_METHOD = "/hybridps.v1.ShardService/Sync"
# How long the calling thread waits beyond a call's own deadline before it gives up on
# the loop (which should have ended the call by then).
LOOP_SLACK_S = 5.0
T = TypeVar("T")


def rpc_error(exc: grpc.RpcError) -> TransportError:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return transport_error(code.name if code is not None else "UNKNOWN", details or "")


def _identity(message: bytes) -> bytes:
    return message  # requests are serialized by the caller (worker/sync/messages.py)


class ShardRpc:
    """The loop thread and its channel; `call` runs a unary RPC with a deadline."""

    def __init__(self, address: str, security: ClientSecurity,
                 max_receive_bytes: int) -> None:
        self.address = address
        self.security = security
        self.max_receive_bytes = max_receive_bytes
        self._loop: asyncio.AbstractEventLoop | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: shard_pb2_grpc.ShardServiceStub | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._thread_main, name="hybridps-rpc",
                                        daemon=True)
        # (run_id, rank, secret) of the partition, from the latest Register's answer
        self._partition: tuple[str, int, str] | None = None
        # Register's proof of the job (hybridps/run_secret.py): run and restore secrets
        self._run_proof: tuple[tuple[str, str], ...] = ()
        # What the server said when it said it is shutting down (set from either thread)
        self.server_stopping: TransportShutdown | None = None

    def stopping_seen(self, exc: TransportError) -> TransportError:
        """`exc`, remembered when it says the server is shutting down; a retryable failure
        after that is the shutdown it follows (the server is gone, not restarting)."""
        if isinstance(exc, TransportShutdown):
            self.server_stopping = exc
            return exc
        said = self.server_stopping
        if said is not None and isinstance(exc, TransportRetryable):
            return TransportShutdown(said.code, f"{said.details} (then {exc.text})")
        return exc

    def bind_partition(self, run_id: str, rank: int, secret: str) -> None:
        """Every later call carries this partition's secret (Register answered it)."""
        self._partition = (run_id, rank, secret)

    def set_run_secret(self, run_secret: str, restore_secret: str = "") -> None:
        """Every Register carries the run secret (and the restore's, when another)."""
        self._run_proof = run_secret_metadata(run_secret, restore_secret)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The credentials every call and stream carries: the auth token, the partition's
        secret (and the partition it belongs to, which binds a Sync stream)."""
        own = partition_metadata(*self._partition) if self._partition is not None else ()
        return tuple(self.security.metadata) + own

    def metadata_for(self, method: str) -> tuple[tuple[str, str], ...]:
        """`metadata`, and for a Register the run's proof too."""
        return self.metadata + (self._run_proof if method == "Register" else ())

    @property
    def running(self) -> bool:
        loop = self._loop
        return loop is not None and not loop.is_closed() and self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise TransportRetryable("UNAVAILABLE", f"gRPC channel to {self.address}: "
                                     f"{type(self._failure).__name__}: {self._failure}")

    def call(self, method: str, request: Any, timeout_s: float,
             wait_for_ready: bool = False) -> Any:
        """ShardService.`method`(request) on the loop; TransportError when it fails, the
        deadline (DEADLINE_EXCEEDED) included."""
        stub = self._stub

        async def invoke() -> Any:
            assert stub is not None
            return await getattr(stub, method)(request, timeout=timeout_s,
                                               wait_for_ready=wait_for_ready,
                                               metadata=self.metadata_for(method))

        return self.run(invoke, timeout_s + LOOP_SLACK_S, f"{method} on {self.address}")

    def call_any(self, method: str, request: Any, timeout_s: float) -> Any:
        """`call`, or, when the loop is not running (never started, or closed), the same
        call on a short-lived channel of its own."""
        if self.running:
            return self.call(method, request, timeout_s)
        log.info(kv("call_on_own_channel", method=method, server=self.address))
        try:
            with open_channel(self.address, channel_options(), self.security) as channel:
                stub = shard_pb2_grpc.ShardServiceStub(channel)
                return getattr(stub, method)(request, timeout=timeout_s,
                                             metadata=self.metadata_for(method))
        except grpc.RpcError as exc:
            raise self.stopping_seen(rpc_error(exc)) from None

    def run(self, make: Callable[[], Awaitable[T]], timeout_s: float, what: str) -> T:
        """Run a coroutine on the loop and wait for its result (the one way the calling
        thread waits on the loop)."""
        try:
            return self._run(make, timeout_s, what)
        except TransportError as exc:
            raise self.stopping_seen(exc) from None

    def _run(self, make: Callable[[], Awaitable[T]], timeout_s: float, what: str) -> T:
        loop = self._loop
        if not self.running or loop is None:
            raise TransportRetryable("UNAVAILABLE", f"{what}: the gRPC loop is not running")

        async def wrapped() -> T:
            return await make()

        future = asyncio.run_coroutine_threadsafe(wrapped(), loop)
        try:
            return future.result(timeout_s)
        except grpc.RpcError as exc:
            raise rpc_error(exc) from None
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TransportRetryable("DEADLINE_EXCEEDED",
                                     f"{what}: no answer within {timeout_s:g}s") from None
        except (concurrent.futures.CancelledError, RuntimeError) as exc:
            raise TransportRetryable("CANCELLED", f"{what}: the gRPC loop ended the call "
                                     f"({type(exc).__name__})") from None

    def open_stream(self) -> GrpcStreamTransport:
        loop = self._loop
        if not self.running or loop is None or self._channel is None:
            raise TransportRetryable("UNAVAILABLE", "the gRPC loop is not running")
        return GrpcStreamTransport(self, loop, self._channel)

    def close(self, timeout_s: float = 10.0) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop may close meanwhile
                loop.call_soon_threadsafe(stop.set)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # -- the loop thread ------------------------------------------------------------------
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
        except BaseException as exc:  # reported to start(), or ends calls as UNAVAILABLE
            self._failure = exc
        finally:
            self._ready.set()
            try:
                # Like asyncio.run: end what is left (a stream's reader), then the generators.
                pending = asyncio.all_tasks(loop)
                for task in pending:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        options = channel_options(self.max_receive_bytes)
        async with open_aio_channel(self.address, options, self.security) as channel:
            self._channel = channel
            self._stub = shard_pb2_grpc.ShardServiceStub(channel)
            self._ready.set()
            await self._stop.wait()


class GrpcStreamTransport(SyncTransport):
    """One Sync stream call: requests from `send` in order, responses for `receive`."""

    name = "stream"

    def __init__(self, rpc: ShardRpc, loop: asyncio.AbstractEventLoop,
                 channel: grpc.aio.Channel) -> None:
        self._rpc = rpc
        self._loop = loop
        self._cond = threading.Condition()
        self._arrived: collections.deque[Response] = collections.deque()
        self._error: TransportError | None = None
        self._ended = threading.Event()
        self._outq: asyncio.Queue[bytes | None] | None = None
        self._call: Any = None
        method = channel.stream_stream(SYNC_METHOD, request_serializer=_identity,
                                       response_deserializer=decode_response)

        async def begin() -> None:
            self._outq = asyncio.Queue()
            self._call = method(_drain(self._outq), metadata=rpc.metadata)
            asyncio.get_running_loop().create_task(self._read(self._call))

        rpc.run(begin, 30.0, "opening the Sync stream")

    def send(self, messages: Sequence[Outgoing]) -> None:
        """Queued for the loop thread, which serializes inline pushes (the copy of their
        gradients) and writes them."""
        if self._error is not None and not self._arrived:
            raise self._error
        if messages:
            try:
                batch: list[Outgoing | None] = list(messages)
                self._loop.call_soon_threadsafe(self._put, batch)
            except RuntimeError:  # the loop closed
                raise TransportRetryable("UNAVAILABLE", "the gRPC loop is gone") from None

    def receive(self, wait_s: float) -> list[Response]:
        deadline = time.monotonic() + wait_s
        with self._cond:
            while not self._arrived and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._cond.wait(left)
            if self._arrived:
                out = list(self._arrived)
                self._arrived.clear()
                return out
            assert self._error is not None
            raise self._error

    def close(self, wait_s: float = 5.0) -> None:
        """Half-close; the server answers what it has and ends the call (else cancel)."""
        if self._ended.is_set():
            return
        with contextlib.suppress(RuntimeError):
            end: list[Outgoing | None] = [None]
            self._loop.call_soon_threadsafe(self._put, end)
        if not self._ended.wait(wait_s):
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._cancel)
            self._ended.wait(1.0)

    def cut(self) -> None:
        """Cancel the call (fault injection): the reader ends it as CANCELLED."""
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._cancel)

    # -- on the loop thread ---------------------------------------------------------------
    def _put(self, messages: list[Outgoing | None]) -> None:
        if self._outq is not None:
            for message in messages:
                if isinstance(message, InlinePush):
                    for data in message.messages():
                        self._outq.put_nowait(data)
                else:
                    self._outq.put_nowait(message)

    def _cancel(self) -> None:
        if self._call is not None:
            self._call.cancel()

    async def _read(self, call: Any) -> None:
        error: TransportError
        try:
            async for response in call:
                with self._cond:
                    self._arrived.append(response)
                    self._cond.notify()
            error = TransportRetryable("UNAVAILABLE", "server ended the Sync stream")
        except grpc.RpcError as exc:
            error = rpc_error(exc)
        except asyncio.CancelledError:
            error = TransportRetryable("CANCELLED", "the Sync stream was closed")
        except Exception as exc:
            error = TransportRetryable("UNKNOWN", f"{type(exc).__name__}: {exc}")
        if isinstance(error, TransportShutdown):  # the unary calls learn it too
            self._rpc.stopping_seen(error)
        with self._cond:
            self._error = error
            self._cond.notify()
        self._ended.set()


async def _drain(outq: asyncio.Queue[bytes | None]) -> AsyncIterator[bytes]:
    """The request stream: messages from the queue until the None sentinel (half-close)."""
    while True:
        message = await outq.get()
        if message is None:
            return
        yield message
