"""The Sync stream over a Unix socket, for ranks on this node (no gRPC per step).

A rank whose shared-memory arena the server accepted (ps/arena_server.py) is told, in
the Register answer, the path of this socket (`SharedMemoryStatus.sync_socket`). It then
writes the Sync stream's request messages to the socket and reads the responses back
itself (worker/socket_client.py), with no event loop on its side. Why: with the arena
the messages are headers of a few hundred bytes, and for those the cost is the
transport, not the bytes; a framed Unix socket costs a fraction of a gRPC message on
both sides (measured: docs/performance-log.md, "Second round: the Sync socket").

Both transports run a stream through the same `SyncStream` (ps/sync_stream.py): decode,
dedupe, ordering, checks, answers and run tracking are the gRPC stream's. Here each
message is answered before the next is read, with no read-ahead task or queue between
the socket and the core (the socket buffer reads ahead). Errors keep their gRPC status
code (ps/status.py `status_for`, via `abort_with`), sent in a last STATUS frame before
the server closes the connection. A drain (SIGTERM) ends a connection between messages:
one waiting for its next frame is woken at once.

Frames (hybridps/socket_frames.py): 1 byte kind, 4 bytes little-endian length, payload.
- HELLO (worker first, then the server's empty HELLO back): the auth token (may be
  empty). A wrong token gets STATUS UNAUTHENTICATED.
- PUSH (worker): a serialized SyncRequest, exactly as on the Sync stream.
- UPDATE (server): a serialized SyncResponse, exactly as on the Sync stream.
- STATUS (server, last): 4 bytes status code, then the UTF-8 details. Code 0 (OK):
  the worker half-closed and everything it sent was answered.
- The worker half-closes (shutdown SHUT_WR) when done; the server answers what it
  read, sends STATUS OK and closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
from pathlib import Path
from typing import Any

import grpc

from hybridps import arena_layout as layout
from hybridps import wire
from hybridps.logs import kv
from hybridps.security import token_matches
from hybridps.socket_frames import (
    CODE,
    FRAME,
    FRAME_SLACK_BYTES,
    HELLO,
    MAX_HELLO_BYTES,
    PUSH,
    STATUS,
    UPDATE,
    frame,
    kind_name,
)
from ps.service import ShardServicer
from ps.status import SHUTTING_DOWN, abort_with
from ps.sync_codec import decode_request
from ps.sync_stream import SyncStream

log = logging.getLogger("ps.socket_server")

HELLO_TIMEOUT_S = 10.0


def status_frame(code: grpc.StatusCode, details: str) -> bytes:
    return frame(STATUS, CODE.pack(code.value[0]) + details.encode("utf-8", "replace"))


class FrameError(wire.WireError):
    """The peer sent something that is not a frame of this protocol."""


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> tuple[int, bytes] | None:
    """The next (kind, payload); None at a clean end (EOF between frames)."""
    try:
        head = await reader.readexactly(FRAME.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise FrameError(f"connection ended inside a frame header ({len(exc.partial)} of "
                         f"{FRAME.size} bytes)") from None
    kind, length = FRAME.unpack(head)
    if length > max_bytes:
        raise FrameError(f"frame of {length} bytes is over the limit of {max_bytes}")
    try:
        return kind, await reader.readexactly(length)
    except asyncio.IncompleteReadError as exc:
        raise FrameError(f"connection ended inside a frame ({len(exc.partial)} of {length} "
                         "bytes)") from None


class SocketCallContext:
    """What `abort_with` uses of a grpc.aio.ServicerContext: abort (the status kept)."""

    def __init__(self) -> None:
        self.code = grpc.StatusCode.OK
        self.details = ""

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: Any = ()) -> None:
        self.code, self.details = code, details
        raise grpc.aio.AbortError()


def socket_path(directory: str = layout.SHM_DIR) -> str:
    """A fresh path next to the arenas (reachable wherever the arenas are)."""
    name = f"hybridps-sync-{os.getpid()}-{secrets.token_hex(4)}.sock"
    return str(Path(directory) / name)


class SyncSocketServer:
    """Serves the Sync stream on a Unix socket: one connection is one `SyncStream`."""

    def __init__(self, servicer: ShardServicer, token: str, max_message_bytes: int,
                 path: str = "") -> None:
        self.servicer = servicer
        self.token = token
        self.max_frame_bytes = max_message_bytes + FRAME_SLACK_BYTES
        self.path = path or socket_path()
        self._server: asyncio.AbstractServer | None = None
        self._handlers: set[asyncio.Task[Any]] = set()
        self._idle: set[asyncio.Task[Any]] = set()  # handlers waiting for a frame
        self._drain_watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=self.path,
                                                       limit=1 << 20)
        self._drain_watch = asyncio.create_task(self._cancel_idle_on_drain())
        log.info(kv("sync_socket", path=self.path))

    async def close(self) -> None:
        """Stop accepting; handlers end with their Sync (drained by begin_drain first)."""
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
        if self._drain_watch is not None:
            self._drain_watch.cancel()
        if self._handlers:
            await asyncio.wait(set(self._handlers), timeout=5.0)
        Path(self.path).unlink(missing_ok=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            if await self._hello(reader, writer):
                await self._sync(reader, writer)
        except (ConnectionError, FrameError) as exc:
            log.info(kv("sync_socket_closed", error=str(exc) or type(exc).__name__))
        finally:
            if task is not None:
                self._handlers.discard(task)
            writer.close()

    async def _hello(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        try:
            got = await asyncio.wait_for(read_frame(reader, MAX_HELLO_BYTES), HELLO_TIMEOUT_S)
        except TimeoutError:
            return False
        if got is None:
            return False
        kind, payload = got
        if kind != HELLO:
            raise FrameError(f"the first frame is a {kind_name(kind)}, not a HELLO")
        if self.token and not token_matches(payload.decode("utf-8", "replace"), self.token):
            self.servicer.core.store.record_refusal("unauthenticated")
            writer.write(status_frame(grpc.StatusCode.UNAUTHENTICATED,
                                      "missing or wrong auth token on the Sync socket"))
            await writer.drain()
            return False
        writer.write(frame(HELLO))
        await writer.drain()
        return True

    async def _sync(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One message at a time, answered before the next is read: no read-ahead task or
        queue between the socket and the core (the socket buffer is the read-ahead)."""
        stream = SyncStream(self.servicer)
        context = SocketCallContext()
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("the Sync socket's handler runs outside a task")
        try:
            try:
                while True:
                    if self.servicer.stopping.is_set():
                        await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
                    self._idle.add(task)  # a drain may cancel the wait for the next frame
                    try:
                        got = await read_frame(reader, self.max_frame_bytes)
                    except asyncio.CancelledError:
                        if not self.servicer.stopping.is_set():
                            raise
                        task.uncancel()  # the drain's: what was read is answered; stop
                        continue
                    finally:
                        self._idle.discard(task)
                    if got is None:  # the worker half-closed: all it sent is answered
                        break
                    kind, payload = got
                    if kind != PUSH:
                        raise FrameError(f"a {kind_name(kind)} frame where a PUSH was expected")
                    for chunk in stream.decode(decode_request(payload)):
                        # (header and message as they are: an inline answer may be MiBs)
                        for update in await stream.answer(chunk):
                            writer.writelines((FRAME.pack(UPDATE, len(update)), update))
                    if writer.is_closing():
                        return
                    await writer.drain()
            except grpc.aio.AbortError:
                raise
            except ConnectionError:  # the worker is gone: nobody to answer
                return
            except Exception as exc:
                await abort_with(context, "Sync", exc, **stream.fields())
        except grpc.aio.AbortError:
            if not writer.is_closing():
                writer.write(status_frame(context.code, context.details))
            return
        finally:
            stream.close()
        if not writer.is_closing():
            writer.write(status_frame(grpc.StatusCode.OK, ""))
            with contextlib.suppress(ConnectionError):  # the worker closed after its half-close
                await writer.drain()

    async def _cancel_idle_on_drain(self) -> None:
        """When the server begins to drain, stop the connections waiting for a frame."""
        await self.servicer.stopping.wait()
        for task in list(self._idle):
            task.cancel()
