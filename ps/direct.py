"""The Sync stream over a Unix socket, for ranks on this node (no gRPC per step).

A rank whose shared-memory arena the server accepted (ps/shm.py) is told, in the
Register answer, the path of this socket (`SharedMemoryStatus.sync_socket`). Its
training thread then writes the Sync stream's Push messages to the socket and reads
the Update messages back itself (worker/direct.py), instead of handing them to a
sync thread and grpc.aio. Why: with the arena the messages are ~200-byte headers, and
for those the cost is the transport, not the bytes. grpc.aio took ~0.7 ms of the
rank's CPU per step on its sync thread, under the GIL the training thread needs, and
~0.5 ms of the server's; a framed Unix socket costs tens of microseconds each side.

The same `ShardServicer.Sync` handler serves both transports: this module only feeds it
the decoded pushes of one connection and writes what it yields, so dedupe, ordering,
checks, answers, drain and run tracking are the ones of the gRPC stream. Errors keep
their gRPC status code (`status_for`, via the handler's `context.abort`), sent in a
last STATUS frame before the server closes the connection.

Frames (hybridps/direct.py): 1 byte kind, 4 bytes little-endian length, payload.
- HELLO (worker first, then the server's empty HELLO back): the auth token (may be
  empty). A wrong token gets STATUS UNAUTHENTICATED.
- PUSH (worker): a serialized Push, exactly as on the Sync stream.
- UPDATE (server): a serialized Update, exactly as on the Sync stream.
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
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from hybridps import shm as layout
from hybridps import wire
from hybridps.direct import (
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
from hybridps.logs import kv
from hybridps.security import token_matches
from ps.service import ShardServicer, decode_push

log = logging.getLogger("ps.direct")

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


class DirectContext:
    """What ShardServicer.Sync uses of a grpc.aio.ServicerContext: abort."""

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


class DirectSyncServer:
    """Serves `servicer.Sync` on a Unix socket; one connection is one Sync stream."""

    def __init__(self, servicer: ShardServicer, token: str, max_message_bytes: int,
                 path: str = "") -> None:
        self.servicer = servicer
        self.token = token
        self.max_frame_bytes = max_message_bytes + FRAME_SLACK_BYTES
        self.path = path or socket_path()
        self._server: asyncio.AbstractServer | None = None
        self._handlers: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=self.path,
                                                       limit=1 << 20)
        log.info(kv("sync_socket", path=self.path))

    async def close(self) -> None:
        """Stop accepting; handlers end with their Sync (drained by begin_drain first)."""
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
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
        max_bytes = self.max_frame_bytes

        async def pushes() -> AsyncIterator[Any]:
            while True:
                try:
                    got = await read_frame(reader, max_bytes)
                except ConnectionError:  # the worker is gone: nobody to answer
                    return
                if got is None:  # the worker half-closed: answer what came, then end
                    return
                kind, payload = got
                if kind != PUSH:
                    raise FrameError(f"a {kind_name(kind)} frame where a PUSH was expected")
                yield decode_push(payload)

        context = DirectContext()
        try:
            async for update in self.servicer.Sync(pushes(), context):  # type: ignore[arg-type]
                if writer.is_closing():
                    return
                # (header and message as they are: an inline answer may be megabytes)
                writer.writelines((FRAME.pack(UPDATE, len(update)), update))
                await writer.drain()
        except grpc.aio.AbortError:
            if not writer.is_closing():
                writer.write(status_frame(context.code, context.details))
            return
        if not writer.is_closing():
            writer.write(status_frame(grpc.StatusCode.OK, ""))
            with contextlib.suppress(ConnectionError):  # the worker closed after its half-close
                await writer.drain()
