"""The Sync socket transport: a rank's end of the server's Unix socket (ps/socket_server.py).

A non-blocking Unix socket, written with the requests of each step and read for
responses only when the rank needs them: nothing runs between steps, so no other
Python thread takes the GIL from the training loop. Failures are TransportErrors with
the status code the server sent in its STATUS frame, or UNAVAILABLE for a lost
connection.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
from collections.abc import Sequence

from hybridps.socket_frames import (
    CODE,
    FRAME,
    FRAME_SLACK_BYTES,
    HELLO,
    PUSH,
    STATUS,
    UPDATE,
    frame,
    kind_name,
    status_name,
)
from worker.sync_messages import Outgoing, serialized
from worker.transport import (
    Response,
    SyncTransport,
    TransportError,
    TransportRetryable,
    decode_response,
    transport_error,
)

RECV_BYTES = 1 << 20


class ConnectionLost(TransportRetryable):
    """The connection broke without a word from the server (no STATUS frame read)."""


class SocketTransport(SyncTransport):
    """Connect, say HELLO (`hello`: a serialized SyncHello, the auth token and the
    partition's secret), then send requests and read responses."""

    name = "socket"

    def __init__(self, path: str, hello: bytes, timeout_s: float, max_message_bytes: int) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.max_frame_bytes = max_message_bytes + FRAME_SLACK_BYTES
        self._buf = bytearray()
        self._updates: list[bytes] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(min(timeout_s, 10.0))
            self._sock.connect(path)
            self._sock.setblocking(False)
            self.send_frame(frame(HELLO, hello))
            deadline = time.monotonic() + min(timeout_s, 10.0)
            while not self._updates:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportRetryable("DEADLINE_EXCEEDED",
                                             f"sync socket {path}: no HELLO from the server")
                self._read(left, hello=True)
        except OSError as exc:
            self._sock.close()
            raise TransportRetryable("UNAVAILABLE",
                                     f"sync socket {path}: {exc.strerror or exc}") from None
        except TransportError:
            self._sock.close()
            raise
        self._updates.clear()

    def send(self, messages: Sequence[Outgoing]) -> None:
        """Blocks only while the socket buffer is full, up to the timeout."""
        for message in serialized(messages):
            self.send_frame(FRAME.pack(PUSH, len(message)), message)

    def send_frame(self, *parts: bytes) -> None:
        """Send one frame whole. While the socket buffer is full, what the server sends is
        read (into the answers `receive` returns): the server answers a message before it
        reads the next, so an answer of MiBs it is still writing (an inline push's) would
        otherwise wait on us while we wait on it. The deadline counts from the last byte
        sent or read."""
        views = [memoryview(p) for p in parts if p]
        deadline: float | None = None
        while views:
            try:
                sent = self._sock.sendmsg(views)
            except BlockingIOError:
                now = time.monotonic()
                deadline = deadline or now + self.timeout_s
                if now >= deadline:
                    raise TransportRetryable(
                        "DEADLINE_EXCEEDED", f"sync socket {self.path}: the server reads "
                        f"nothing for {self.timeout_s:g}s") from None
                readable, _, _ = select.select([self._sock], [self._sock], [], deadline - now)
                if readable and self._read(0.0):
                    deadline = None
                continue
            except OSError as exc:
                raise self._last_words(exc.strerror or str(exc)) from None
            deadline = None
            while views and sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            if views and sent:
                views[0] = views[0][sent:]

    def receive(self, wait_s: float) -> list[Response]:
        """The responses that arrived, waiting up to `wait_s` for the first one."""
        deadline = time.monotonic() + wait_s
        while not self._updates:
            left = deadline - time.monotonic()
            if not self._read(max(left, 0.0)) and left <= 0:
                break
        out, self._updates = self._updates, []
        return [decode_response(data) for data in out]

    def _read(self, wait_s: float, hello: bool = False) -> bool:
        """Read what is there (waiting up to `wait_s` for something); True if bytes came."""
        try:
            data = self._sock.recv(RECV_BYTES)
        except BlockingIOError:
            ready, _, _ = select.select([self._sock], [], [], wait_s)
            if not ready:
                return False
            try:
                data = self._sock.recv(RECV_BYTES)
            except BlockingIOError:
                return False
            except OSError as exc:
                raise self._lost(exc.strerror or str(exc)) from None
        except OSError as exc:
            raise self._lost(exc.strerror or str(exc)) from None
        if not data:
            raise self._lost("the server closed the connection")
        self._buf += data
        self._parse(hello)
        return True

    def _parse(self, hello: bool) -> None:
        buf = self._buf
        at = 0
        while len(buf) - at >= FRAME.size:
            kind, length = FRAME.unpack_from(buf, at)
            if length > self.max_frame_bytes:
                raise TransportRetryable(
                    "INTERNAL", f"sync socket {self.path}: a frame of {length} bytes is "
                    f"over the limit of {self.max_frame_bytes}")
            end = at + FRAME.size + length
            if len(buf) < end:
                break
            payload = bytes(buf[at + FRAME.size:end])
            at = end
            if kind == STATUS:
                number = CODE.unpack_from(payload)[0] if len(payload) >= CODE.size else 2
                details = payload[CODE.size:].decode("utf-8", "replace")
                code = status_name(number)
                if code == "OK":
                    code, details = "UNAVAILABLE", "server ended the Sync socket"
                raise transport_error(code, details)
            if kind != (HELLO if hello else UPDATE):
                raise TransportRetryable(
                    "INTERNAL", f"sync socket {self.path}: unexpected {kind_name(kind)} frame")
            self._updates.append(payload)
        del buf[:at]

    def _lost(self, why: str) -> TransportError:
        return ConnectionLost("UNAVAILABLE", f"sync socket {self.path}: {why}")

    def _last_words(self, why: str) -> TransportError:
        """A send failed (the server closed: Broken pipe): the STATUS frame it sent before
        closing, when one is waiting to be read (e.g. "shutting down"), else `why`."""
        try:
            while self._read(0.0):
                pass
        except ConnectionLost:
            pass
        except TransportError as exc:
            return exc  # the server's own words
        return self._lost(why)

    def close(self) -> None:
        """Half-close first: the server answers what it read, then ends."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)
        self._sock.close()

    def cut(self) -> None:
        """Break the connection both ways (fault injection in tests)."""
        self._sock.shutdown(socket.SHUT_RDWR)
