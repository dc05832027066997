"""Tensors on the wire: raw little-endian bytes plus dtype and shape.

Decoding is zero-copy where it can be: the returned tensor views the message's
bytes (read-only memory, so callers that keep or mutate it must clone).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from hybridps.v1 import shard_pb2

DType = shard_pb2.DType

_TORCH_BY_WIRE: dict[int, torch.dtype] = {
    shard_pb2.FLOAT32: torch.float32,
    shard_pb2.FLOAT16: torch.float16,
    shard_pb2.BFLOAT16: torch.bfloat16,
    shard_pb2.INT64: torch.int64,
    shard_pb2.INT32: torch.int32,
}
_WIRE_BY_TORCH = {v: k for k, v in _TORCH_BY_WIRE.items()}

if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
    raise ImportError("hybridps sends tensors as little-endian bytes; big-endian hosts unsupported")


class WireError(ValueError):
    """A Tensor message that does not describe a valid tensor."""


_NAME_BY_WIRE = {v: str(shard_pb2.DType.Name(v)) for v in shard_pb2.DType.values()}


def dtype_name(wire_dtype: int) -> str:
    name = _NAME_BY_WIRE.get(wire_dtype)
    return name if name is not None else f"<unknown dtype {wire_dtype}>"


def torch_dtype(wire_dtype: int) -> torch.dtype | None:
    """The torch dtype of a DType enum value (None: unknown or unspecified)."""
    return _TORCH_BY_WIRE.get(wire_dtype)


def wire_dtype(dtype: torch.dtype) -> int:
    """The DType enum value of a torch dtype that can travel (WireError if none)."""
    if dtype not in _WIRE_BY_TORCH:
        raise WireError(f"dtype {dtype} cannot travel on the wire")
    return _WIRE_BY_TORCH[dtype]


def encode(tensor: torch.Tensor, out: shard_pb2.Tensor | None = None) -> shard_pb2.Tensor:
    """Fill (or create) a Tensor message from a CPU or device tensor."""
    if tensor.dtype not in _WIRE_BY_TORCH:
        raise WireError(f"dtype {tensor.dtype} cannot travel on the wire")
    msg = out if out is not None else shard_pb2.Tensor()
    msg.dtype = _WIRE_BY_TORCH[tensor.dtype]  # type: ignore[assignment]
    msg.shape[:] = list(tensor.shape)
    host = tensor.detach().to("cpu").contiguous()
    if host.dtype == torch.bfloat16:
        host = host.view(torch.int16)
    msg.data = host.numpy().tobytes()
    return msg


def decode(msg: shard_pb2.Tensor, what: str = "tensor") -> torch.Tensor:
    """Tensor message -> CPU tensor viewing the message bytes (no copy)."""
    if msg.dtype not in _TORCH_BY_WIRE:
        raise WireError(f"{what}: unsupported dtype {dtype_name(msg.dtype)}")
    dtype = _TORCH_BY_WIRE[msg.dtype]
    shape = tuple(int(s) for s in msg.shape)
    if any(s < 0 for s in shape):
        raise WireError(f"{what}: negative dimension in shape {list(shape)}")
    numel = 1
    for s in shape:
        numel *= s
    itemsize = torch.empty((), dtype=dtype).element_size()
    data = msg.data  # each read of a bytes field makes a new copy of it: read it once
    if len(data) != numel * itemsize:
        raise WireError(
            f"{what}: {len(data)} bytes do not match shape {list(shape)} of "
            f"{dtype_name(msg.dtype)} ({numel * itemsize} bytes expected)"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    np_dtype = np.int16 if dtype == torch.bfloat16 else None
    with warnings.catch_warnings():
        # torch warns that the buffer is read-only; callers clone before writing.
        warnings.simplefilter("ignore", UserWarning)
        if np_dtype is not None:
            arr = np.frombuffer(data, dtype=np_dtype)
            return torch.from_numpy(arr).view(torch.bfloat16).reshape(shape)
        return torch.frombuffer(data, dtype=dtype).reshape(shape)


def rows_per_chunk(dim: int, max_chunk_bytes: int, row_itemsize: int = 4) -> int:
    """How many (id, row) pairs fit in one message of at most max_chunk_bytes."""
    per_row = 8 + dim * row_itemsize
    # Leave room for the header fields of the message.
    return max(1, (max_chunk_bytes - 1024) // per_row)


def chunk_bounds(num_rows: int, rows_in_chunk: int) -> Iterator[tuple[int, int]]:
    """[start, end) row slices; an empty push still yields one empty chunk."""
    if num_rows == 0:
        yield 0, 0
        return
    for start in range(0, num_rows, rows_in_chunk):
        yield start, min(num_rows, start + rows_in_chunk)


# -- framed messages: tensors encoded and decoded without protobuf copies ---------------
#
# Protobuf (upb) copies a bytes field on every assignment, read and serialization, and
# computing ByteSize serializes the whole message. A Push of 64k rows x 64 fp32 is 16
# MiB, so the generated code's path cost ~5 copies of it on each side. The functions
# below write and read the same encoding (a valid protobuf message: fields may come in
# any order) with one copy to build the outgoing bytes and none to read the incoming
# ones: decoded tensors view the received buffer (read-only: callers that keep a
# tensor beyond the message or write to it must clone). The Sync stream uses them on
# both sides (ps/edge/sync_codec.py; worker/sync/messages.py, worker/sync/transport.py); every
# other RPC and every other client keeps the generated code, which reads these
# messages like any other.

ALIGN = 8  # tensor data starts at a multiple of this within the encoded message
_LEN, _VARINT, _I64, _I32 = 2, 0, 1, 5
_PAD_FIELD = shard_pb2.Tensor.DESCRIPTOR.fields_by_name["pad"].number


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _key(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    if tensor.numel() == 0:
        return memoryview(b"")
    host = tensor.detach().to("cpu").contiguous()
    if host.dtype == torch.bfloat16:
        host = host.view(torch.int16)
    return host.numpy().data.cast("B")


# A tensor field of a framed message: its name, or the names from the outer message down
# to it (("push", "chunk", "ids"): SyncRequest.push.chunk.ids).
TensorPath = str | tuple[str, ...]


def _path(field_path: TensorPath) -> tuple[str, ...]:
    return (field_path,) if isinstance(field_path, str) else tuple(field_path)


def _field_numbers(descriptor: Any, path: tuple[str, ...]) -> list[int]:
    """The field number of each name of `path`, from `descriptor` down."""
    numbers = []
    for name in path:
        found = descriptor.fields_by_name[name]
        numbers.append(found.number)
        descriptor = found.message_type
    return numbers


def encode_framed(head: Any, tensors: Sequence[tuple[TensorPath, torch.Tensor]]) -> bytes:
    """`head` (a message whose tensor fields are unset) plus the named Tensor fields,
    serialized: what the generated code would give, with the tensor data 8-byte aligned
    (Tensor.pad) and copied once. The tensors come first, so their padding does not
    depend on the other fields (a duplicate answer pads like the original). A tensor
    inside a sub-message travels as that sub-message holding only the tensor: parsers
    merge repeated occurrences of a message field, so the reader sees one sub-message."""
    parts: list[bytes | memoryview] = []
    offset = 0
    for field_path, tensor in tensors:
        path = _path(field_path)
        name = ".".join(path)
        if tensor.dtype not in _WIRE_BY_TORCH:
            raise WireError(f"{name}: dtype {tensor.dtype} cannot travel on the wire")
        if any(int(s) < 0 for s in tensor.shape):
            raise WireError(f"{name}: negative dimension in shape {list(tensor.shape)}")
        numbers = _field_numbers(head.DESCRIPTOR, path)
        data = _raw_bytes(tensor)
        nbytes = data.nbytes
        inner = _key(1, _VARINT) + _varint(_WIRE_BY_TORCH[tensor.dtype])
        if tensor.dim():
            packed = b"".join(_varint(int(s)) for s in tensor.shape)
            inner += _key(2, _LEN) + _varint(len(packed)) + packed
        data_key = _key(3, _LEN) + _varint(nbytes)
        for pad in range(2 * ALIGN):  # a length crossing a varint boundary skips a residue
            pad_field = _key(_PAD_FIELD, _LEN) + _varint(pad) + bytes(pad)
            prefix = inner + pad_field + data_key
            length = len(prefix) + nbytes
            for number in reversed(numbers):  # wrap: the Tensor, then each sub-message
                wrapper = _key(number, _LEN) + _varint(length)
                prefix = wrapper + prefix
                length += len(wrapper)
            if (offset + len(prefix)) % ALIGN == 0:
                break
        parts += [prefix, data]
        offset += len(prefix) + nbytes
    parts.append(head.SerializeToString())
    return b"".join(parts)


M = TypeVar("M")


@dataclass
class Framed(Generic[M]):
    """A received message: its non-tensor fields in `message` (the tensor fields left
    empty), its tensors in `tensors` by field name (the last name of the field's path),
    views of the received bytes. `error` is set instead when the bytes are not a valid
    message (a gRPC deserializer must not raise; the handler raises it)."""

    message: M
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    error: WireError | None = None
    nbytes: int = 0

    def tensor(self, name: str, what: str) -> torch.Tensor:
        """The named tensor (WireError when the message has none: a Tensor field left
        unset has no dtype)."""
        if self.error is not None:
            raise self.error
        found = self.tensors.get(name)
        if found is None:
            raise WireError(f"{what}: {name}: unsupported dtype "
                            f"{dtype_name(shard_pb2.DTYPE_UNSPECIFIED)}")
        return found


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end:
            raise WireError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise WireError("varint longer than 10 bytes")


def _skip(buf: memoryview, pos: int, end: int, wire_type: int) -> int:
    if wire_type == _VARINT:
        return _read_varint(buf, pos, end)[1]
    if wire_type == _I64:
        pos += 8
    elif wire_type == _I32:
        pos += 4
    elif wire_type == _LEN:
        length, pos = _read_varint(buf, pos, end)
        pos += length
    else:
        raise WireError(f"unsupported protobuf wire type {wire_type}")
    if pos > end:
        raise WireError("truncated field")
    return pos


def _int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _view_tensor(data: bytes, buf: memoryview, start: int, end: int, what: str) -> torch.Tensor:
    """Parse one Tensor message in data[start:end]; the tensor views `data` when aligned."""
    dtype_value = 0
    shape: list[int] = []
    data_at, data_len = start, 0
    pos = start
    while pos < end:
        key, pos = _read_varint(buf, pos, end)
        number, wire_type = key >> 3, key & 7
        if number == 1 and wire_type == _VARINT:
            dtype_value, pos = _read_varint(buf, pos, end)
        elif number == 2 and wire_type == _LEN:
            length, pos = _read_varint(buf, pos, end)
            stop = pos + length
            if stop > end:
                raise WireError(f"{what}: truncated shape")
            while pos < stop:
                dim, pos = _read_varint(buf, pos, stop)
                shape.append(_int64(dim))
        elif number == 2 and wire_type == _VARINT:
            dim, pos = _read_varint(buf, pos, end)
            shape.append(_int64(dim))
        elif number == 3 and wire_type == _LEN:
            data_len, pos = _read_varint(buf, pos, end)
            data_at = pos
            pos += data_len
            if pos > end:
                raise WireError(f"{what}: truncated data")
        else:
            pos = _skip(buf, pos, end, wire_type)
    dtype = _TORCH_BY_WIRE.get(dtype_value)
    if dtype is None:
        raise WireError(f"{what}: unsupported dtype {dtype_name(dtype_value)}")
    if any(s < 0 for s in shape):
        raise WireError(f"{what}: negative dimension in shape {shape}")
    numel = 1
    for s in shape:
        numel *= s
    itemsize = torch.empty((), dtype=dtype).element_size()
    if data_len != numel * itemsize:
        raise WireError(
            f"{what}: {data_len} bytes do not match shape {shape} of "
            f"{dtype_name(dtype_value)} ({numel * itemsize} bytes expected)")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        # torch warns that the buffer is read-only; callers clone before writing.
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.frombuffer(data, dtype=dtype, count=numel, offset=data_at)
    if tensor.data_ptr() % itemsize:
        # Not from encode_framed (no padding): misaligned elements are not for the
        # kernels (vectorized loops may assume natural alignment), so copy.
        tensor = tensor.clone()
    return tensor.reshape(shape)


# field number -> the tensor's name (a Tensor field), or the fields below it (a message)
_Tree = dict[int, "str | _Tree"]


def _tree(descriptor: Any, paths: Sequence[TensorPath]) -> _Tree:
    tree: _Tree = {}
    for field_path in paths:
        path = _path(field_path)
        numbers = _field_numbers(descriptor, path)
        level = tree
        for number in numbers[:-1]:
            below = level.setdefault(number, {})
            assert isinstance(below, dict)
            level = below
        level[numbers[-1]] = path[-1]
    return tree


def _split(data: bytes, buf: memoryview, start: int, end: int, tree: _Tree,
           spans: dict[str, tuple[int, int]], what: str) -> bytes | None:
    """The bytes of data[start:end] without the tensor fields of `tree`, whose spans go
    to `spans`; None when it holds none of them (the caller keeps the bytes as they are)."""
    rest: list[bytes] = []
    found = False
    pos = start
    while pos < end:
        field_at = pos
        key, pos = _read_varint(buf, pos, end)
        number, wire_type = key >> 3, key & 7
        below = tree.get(number)
        if below is None or wire_type != _LEN:
            pos = _skip(buf, pos, end, wire_type)
            rest.append(data[field_at:pos])
            continue
        length, pos = _read_varint(buf, pos, end)
        stop = pos + length
        if stop > end:
            name = below if isinstance(below, str) else f"#{number}"
            raise WireError(f"{what}: truncated field {name}")
        if isinstance(below, str):
            if below in spans:
                raise WireError(f"{what}: field {below} appears twice")
            spans[below] = (pos, stop)
            found = True
        else:
            inner = _split(data, buf, pos, stop, below, spans, what)
            if inner is None:
                rest.append(data[field_at:stop])
            else:
                found = True
                rest.append(_key(number, _LEN) + _varint(len(inner)) + inner)
        pos = stop
    return b"".join(rest) if found else None


def decode_framed(cls: type[M], data: bytes, tensor_fields: Sequence[TensorPath],
                  what: str = "message") -> Framed[M]:
    """The bytes of a `cls` message, its `tensor_fields` as views of `data`.

    Never raises: a malformed message gives Framed(cls(), error=WireError(...)).
    """
    try:
        tree = _tree(cls.DESCRIPTOR, tensor_fields)  # type: ignore[attr-defined]
        buf = memoryview(data)
        end = len(buf)
        spans: dict[str, tuple[int, int]] = {}
        rest = _split(data, buf, 0, end, tree, spans, what)
        message = cls.FromString(data if rest is None else rest)  # type: ignore[attr-defined]
        tensors: dict[str, torch.Tensor] = {}
        if spans:
            head = describe_head(message)  # for error texts
            for name, (start, stop) in spans.items():
                tensors[name] = _view_tensor(data, buf, start, stop, f"{what} {head}: {name}")
        return Framed(message, tensors, nbytes=end)
    except WireError as exc:
        if not str(exc).startswith(what):
            exc = WireError(f"{what}: {exc}")
        return Framed(cls(), error=exc, nbytes=len(data))
    except Exception as exc:  # protobuf's DecodeError and the like
        return Framed(cls(), error=WireError(f"{what}: not a valid message: {exc}"),
                      nbytes=len(data))


def describe_head(message: Any) -> str:
    """run, rank, step, table (and chunk) of a Sync message, for error texts."""
    for name in ("push", "update"):  # a SyncRequest / SyncResponse: its one push or update
        if _has(message, name):
            message = getattr(message, name)
    parts = []
    for name in ("run_id", "rank", "step", "table"):
        if hasattr(message, name):
            parts.append(f"{name}={getattr(message, name)!r}")
    if _has(message, "chunk"):
        parts.append(f"chunk={message.chunk.index!r}")
    return " ".join(parts)


def _has(message: Any, name: str) -> bool:
    try:
        return bool(message.HasField(name))
    except (ValueError, AttributeError):
        return False
