"""Tensors on the wire: raw little-endian bytes plus dtype and shape.

Decoding is zero-copy where it can be: the returned tensor views the message's
bytes (read-only memory, so callers that keep or mutate it must clone).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator

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


def dtype_name(wire_dtype: int) -> str:
    try:
        return str(shard_pb2.DType.Name(wire_dtype))
    except ValueError:
        return f"<unknown dtype {wire_dtype}>"


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
    if len(msg.data) != numel * itemsize:
        raise WireError(
            f"{what}: {len(msg.data)} bytes do not match shape {list(shape)} of "
            f"{dtype_name(msg.dtype)} ({numel * itemsize} bytes expected)"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    np_dtype = np.int16 if dtype == torch.bfloat16 else None
    with warnings.catch_warnings():
        # torch warns that the buffer is read-only; callers clone before writing.
        warnings.simplefilter("ignore", UserWarning)
        if np_dtype is not None:
            arr = np.frombuffer(msg.data, dtype=np_dtype)
            return torch.from_numpy(arr).view(torch.bfloat16).reshape(shape)
        return torch.frombuffer(msg.data, dtype=dtype).reshape(shape)


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
