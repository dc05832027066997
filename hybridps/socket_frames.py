"""Frames of the Sync socket (server: ps/direct.py, worker: worker/direct.py).

1 byte kind, 4 bytes little-endian payload length, the payload. Kinds: HELLO (the
worker's auth token; the server's empty answer), PUSH (a serialized Push), UPDATE (a
serialized Update), STATUS (last frame from the server: 4-byte little-endian gRPC
status code number, then UTF-8 details).
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
