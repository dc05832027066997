"""Frames of the Sync socket (server: ps/socket_server.py, worker: worker/socket_client.py).

1 byte kind, 4 bytes little-endian payload length, the payload. Kinds: HELLO (the
worker's auth token; the server's empty answer), PUSH (a serialized SyncRequest), UPDATE
(a serialized SyncResponse), STATUS (last frame from the server: 4-byte little-endian
gRPC status code number, then UTF-8 details).
"""

from __future__ import annotations

import struct

FRAME = struct.Struct("<BI")  # kind, payload length
CODE = struct.Struct("<I")
HELLO, PUSH, UPDATE, STATUS = b"H"[0], b"P"[0], b"U"[0], b"S"[0]
KIND_NAMES = {HELLO: "HELLO", PUSH: "PUSH", UPDATE: "UPDATE", STATUS: "STATUS"}
MAX_HELLO_BYTES = 4096
FRAME_SLACK_BYTES = 64 << 10  # header fields on top of the largest message


def frame(kind: int, payload: bytes = b"") -> bytes:
    return FRAME.pack(kind, len(payload)) + payload


def kind_name(kind: int) -> str:
    return KIND_NAMES.get(kind, f"unknown ({kind})")


# gRPC status code numbers by name (grpc.StatusCode): a STATUS frame carries the number,
# so that both sides speak of errors the way the gRPC stream does.
STATUS_CODES = {
    "OK": 0, "CANCELLED": 1, "UNKNOWN": 2, "INVALID_ARGUMENT": 3, "DEADLINE_EXCEEDED": 4,
    "NOT_FOUND": 5, "ALREADY_EXISTS": 6, "PERMISSION_DENIED": 7, "RESOURCE_EXHAUSTED": 8,
    "FAILED_PRECONDITION": 9, "ABORTED": 10, "OUT_OF_RANGE": 11, "UNIMPLEMENTED": 12,
    "INTERNAL": 13, "UNAVAILABLE": 14, "DATA_LOSS": 15, "UNAUTHENTICATED": 16,
}
STATUS_NAMES = {number: name for name, number in STATUS_CODES.items()}


def status_name(number: int) -> str:
    return STATUS_NAMES.get(number, "UNKNOWN")
