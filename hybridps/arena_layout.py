"""The shared-memory arena of the Sync stream's same-node data plane: layout only.

A worker rank creates the arena (worker/sync/arena.py), a file under /dev/shm that
the shard server on its node maps (ps/edge/arena_server.py) when it accepts it at Register.
Pushes then carry (offset, length) references into it instead of inline tensors, and the server
writes each answer into a region the push names. Both sides agree on this module.

`Views` is the one way either side turns a region into a tensor.

Layout: a HEADER_BYTES header, then data. The header is MAGIC, the NONCE_BYTES
random nonce the worker also sends in RegisterRequest.shm (so the server knows it
opened the worker's file, not a same-named one of another host or IPC namespace),
and the arena's size as a little-endian uint64. Every region starts at a multiple of
ALIGN (natural alignment of every dtype that travels, and what the kernels expect).
"""

from __future__ import annotations

import math
import mmap
import re
import struct

import torch

MAGIC = b"HPSSHM01"
NONCE_BYTES = 32
HEADER_BYTES = 4096
ALIGN = 64  # regions are cache-line aligned: no false sharing between two regions
SHM_DIR = "/dev/shm"
# Arena file names: what the server agrees to map (nothing else in the directory).
NAME_PATTERN = re.compile(r"^hybridps-[A-Za-z0-9_.\-]{1,200}\.arena$")
MIN_ARENA_BYTES = HEADER_BYTES + (1 << 20)
MAX_ARENA_BYTES = 1 << 40
_SIZE = struct.Struct("<Q")
# Both sides map the arena with its page tables filled up front (Linux; else 0).
MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def pack_header(nonce: bytes, size: int) -> bytes:
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"nonce of {len(nonce)} bytes, expected {NONCE_BYTES}")
    return MAGIC + nonce + _SIZE.pack(size)


def unpack_header(data: bytes) -> tuple[bytes, bytes, int]:
    """(magic, nonce, size) of an arena's first bytes."""
    need = len(MAGIC) + NONCE_BYTES + _SIZE.size
    if len(data) < need:
        raise ValueError(f"arena header of {len(data)} bytes, expected {need}")
    magic = data[:len(MAGIC)]
    nonce = data[len(MAGIC):len(MAGIC) + NONCE_BYTES]
    (size,) = _SIZE.unpack_from(data, len(MAGIC) + NONCE_BYTES)
    return bytes(magic), bytes(nonce), int(size)


def align_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


class Views:
    """Regions of one mapping as tensors (each keeps the mapping alive while it lives).

    One tensor over the whole mapping per dtype, made on first use; a region is then a
    single `as_strided` of it (bounds-checked by torch against the mapping) rather
    than `frombuffer` + `view`: the shard server makes three a push, on its event loop.
    """

    def __init__(self, mapping: mmap.mmap) -> None:
        self._mapping = mapping
        self._whole: dict[torch.dtype, torch.Tensor] = {}

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The region at `offset` (a multiple of the dtype's size) as a `shape` tensor."""
        if math.prod(shape) == 0:
            return torch.empty(shape, dtype=dtype)
        itemsize = dtype.itemsize
        if offset % itemsize:
            raise ValueError(f"offset {offset} is not a multiple of {dtype}'s {itemsize} "
                             "bytes")
        whole = self._whole.get(dtype)
        if whole is None:
            whole = torch.frombuffer(self._mapping, dtype=dtype,
                                     count=len(self._mapping) // itemsize)
            self._whole[dtype] = whole
        return whole.as_strided(shape, contiguous_strides(shape), offset // itemsize)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides, in elements, of a tensor of `shape`."""
    if len(shape) == 2:  # [U, dim] gradients and answers: the common case, no loop
        return (shape[1], 1)
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return tuple(strides)
