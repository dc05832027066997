"""Same-node shared memory for the Sync stream, worker side: the arena and its regions.

With `--shm auto|on` a rank creates an arena (a file under /dev/shm, mode 0600,
space reserved up front) and offers it at Register; the node's shard server maps it
(ps/shm.py). While it is accepted, each push copies its ids and gradients once into a
region of the arena, the Push message carries only references, and the server writes
the answer's delta (or rows) into the same region; the Update is a header. Layout
constants: hybridps/shm.py.

Lifetimes:
- the file: unlinked right after the first Register answered (the server has mapped
  it by then, or will not use it), and in `close`; the memory lives until both
  processes unmapped it. A rank killed between creating it and that answer leaves
  the file behind (hybridps-<pid>-r<rank>-*.arena in /dev/shm);
- a region: allocated for one push, kept while the push is unanswered (a re-sent
  push references the same bytes), and freed only after its update was taken by the
  training thread *and* the training thread came back for the next `take`: the
  RowUpdate's ids and delta view the region until then (no copy), which is all any
  consumer needs (the staleness window applies them at once; a checkpoint saves the
  pending ones synchronously). The server writes into a region only before the push
  is answered, or fenced by the arena epoch (ps/shm.py), so a region freed here is
  never written again by a handler of an older stream.
- a full arena: the push goes inline (ordinary gRPC tensors) instead of waiting:
  regions are only freed by the training thread's next `take`, and that may itself be
  waiting for this very push. `SyncStats.shm_inline_pushes` counts these, a warning
  says so once; size the arena to hold about K+2 steps of pushes (ids 8 bytes, then
  gradients and answer dim x 4 bytes a row each) with --shm-mb.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import mmap
import os
import secrets
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridps import shm as layout
from hybridps import wire
from hybridps.logs import kv
from hybridps.v1 import shard_pb2

log = logging.getLogger("worker.shm")



class ShmUnavailable(RuntimeError):
    """The arena could not be created (no /dev/shm, not enough space, ...)."""


@dataclass
class Region:
    offset: int
    nbytes: int
    freed: bool = False


class RingAllocator:
    """Regions of [start, end) handed out first-in first-out.

    Allocation is at the head; a region may be freed in any order, and space comes back
    from the tail as the oldest regions are freed (pushes are answered and taken in
    step order, so that is almost always at once). O(1) per call, no per-row work.
    Thread-safe: the sync thread allocates, the training thread frees.
    """

    def __init__(self, start: int, end: int) -> None:
        if not 0 <= start < end:
            raise ValueError(f"ring [{start}, {end}) is empty")
        self.start, self.end = start, end
        self._lock = threading.Lock()
        self._live: collections.deque[Region] = collections.deque()
        self._head = self._tail = start

    @property
    def capacity(self) -> int:
        return self.end - self.start

    @property
    def used(self) -> int:
        with self._lock:
            if not self._live:
                return 0
            if self._head > self._tail:
                return self._head - self._tail
            return self.capacity - (self._tail - self._head)

    def alloc(self, nbytes: int) -> Region | None:
        """A region of `nbytes` (rounded up to layout.ALIGN), or None when it does not fit."""
        size = layout.align_up(nbytes)
        if size == 0:
            return Region(self.start, 0, freed=True)  # nothing to hold
        with self._lock:
            if not self._live:
                self._head = self._tail = self.start
            if not self._live or self._head > self._tail:  # live bytes are [tail, head)
                if self._head + size <= self.end:
                    at = self._head
                elif self.start + size <= self._tail:
                    at = self.start  # wrap: [head, end) stays unused until the tail passes
                else:
                    return None
            elif self._head + size <= self._tail:  # wrapped: free bytes are [head, tail)
                at = self._head
            else:
                return None
            region = Region(at, size)
            self._live.append(region)
            self._head = at + size
            return region

    def free(self, region: Region) -> None:
        if region.nbytes == 0:
            return
        with self._lock:
            region.freed = True
            while self._live and self._live[0].freed:
                self._live.popleft()
            if self._live:
                self._tail = self._live[0].offset
            else:
                self._head = self._tail = self.start


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


class ClientArena:
    """The rank's arena: a /dev/shm file mapped here, offered to the server at Register."""

    def __init__(self, size_bytes: int, rank: int, directory: str = layout.SHM_DIR) -> None:
        size = layout.align_up(max(size_bytes, layout.MIN_ARENA_BYTES), mmap.PAGESIZE)
        name = f"hybridps-{os.getpid()}-r{rank}-{secrets.token_hex(8)}.arena"
        self.path = os.path.join(directory, name)
        self.size = size
        self.nonce = secrets.token_bytes(layout.NONCE_BYTES)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ShmUnavailable(f"cannot create {self.path}: {exc.strerror}") from None
        # From here on the file is removed at the latest when this object goes or the
        # process exits normally.
        self._unlink = weakref.finalize(self, _unlink_quietly, self.path)
        try:
            # Reserve the pages now: on a full tmpfs a lazily grown file is a SIGBUS on
            # first touch (in this process or the server); this is an error we can report.
            os.posix_fallocate(fd, 0, size)
            # Mapped with its page tables filled (MAP_POPULATE): a region's first use
            # would otherwise fault in every page, in the middle of a push.
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED | layout.MAP_POPULATE,
                                   mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            self._unlink()
            raise ShmUnavailable(f"cannot reserve {size} bytes in {self.path}: "
                                 f"{exc.strerror} (is {directory} big enough? --shm-mb)"
                                 ) from None
        finally:
            os.close(fd)
        self._views = layout.Views(self._mmap)
        header = layout.pack_header(self.nonce, size)
        self._mmap[:len(header)] = header
        self.ring = RingAllocator(layout.HEADER_BYTES, size)

    def offer(self) -> shard_pb2.SharedMemoryArena:
        return shard_pb2.SharedMemoryArena(path=self.path, size=self.size, nonce=self.nonce)

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return self._views.view(offset, dtype, shape)

    def unlink(self) -> None:
        """Remove the file name (the mappings stay valid)."""
        self._unlink()

    def close(self) -> None:
        """Unlink, and forget the mapping: it is unmapped when the last tensor viewing it
        (a RowUpdate the training thread holds) is gone. Never mmap.close(): tensors from
        torch.frombuffer keep the mmap object alive but hold no buffer export, so closing
        it would unmap memory they still point into."""
        self._unlink()
        self._mmap = None  # type: ignore[assignment]
        self._views = None  # type: ignore[assignment]


@dataclass
class ShmSlot:
    """One push's region: its ids, gradients and answer as views of the arena."""

    region: Region
    ids: torch.Tensor     # int64 [U]
    grads: torch.Tensor   # [U, dim], the wire dtype
    answer: torch.Tensor  # [U, dim], the answer's dtype
    refs: tuple[shard_pb2.ShmTensor, shard_pb2.ShmTensor, shard_pb2.ShmTensor]

    @property
    def tensor_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ids, self.grads, self.answer))


def _ref(tensor: torch.Tensor, offset: int) -> shard_pb2.ShmTensor:
    return shard_pb2.ShmTensor(dtype=wire.wire_dtype(tensor.dtype),  # type: ignore[arg-type]
                               shape=list(tensor.shape), offset=offset,
                               length=tensor.numel() * tensor.element_size())


def _spans(rows: int, dim: int, wire_dtype: torch.dtype, answer_dtype: torch.dtype
           ) -> list[int]:
    """Bytes of a push's ids, gradients and answer in its region, each aligned."""
    sizes = [rows * 8, rows * dim * wire_dtype.itemsize, rows * dim * answer_dtype.itemsize]
    return [layout.align_up(n) for n in sizes]


def region_bytes(rows: int, dim: int, wire_dtype: torch.dtype = torch.float32,
                 answer_dtype: torch.dtype = torch.float32) -> int:
    """The arena bytes one push of `rows` x `dim` takes (`place`'s region)."""
    return sum(_spans(rows, dim, wire_dtype, answer_dtype))


def place(arena: ClientArena, ids_U: torch.Tensor, grads_UD: torch.Tensor,
          wire_dtype: torch.dtype, answer_dtype: torch.dtype) -> ShmSlot | None:
    """Copy a push into a new region (the gradients converted to `wire_dtype` on the
    way), or None when the arena has no room for it."""
    rows, dim = int(grads_UD.shape[0]), int(grads_UD.shape[1])
    spans = _spans(rows, dim, wire_dtype, answer_dtype)
    region = arena.ring.alloc(sum(spans))
    if region is None:
        return None
    offsets = [region.offset, region.offset + spans[0], region.offset + spans[0] + spans[1]]
    if region.nbytes == 0:  # an empty push: valid (empty) references inside the data part
        offsets = [layout.HEADER_BYTES] * 3
    ids = arena.view(offsets[0], torch.int64, (rows,))
    grads = arena.view(offsets[1], wire_dtype, (rows, dim))
    answer = arena.view(offsets[2], answer_dtype, (rows, dim))
    ids.copy_(ids_U)
    grads.copy_(grads_UD)  # the one copy of the gradients (and the --wire-dtype rounding)
    refs = (_ref(ids, offsets[0]), _ref(grads, offsets[1]), _ref(answer, offsets[2]))
    return ShmSlot(region, ids, grads, answer, refs)


def create_arena(mode: str, size_bytes: int, rank: int) -> tuple[ClientArena | None, str]:
    """The arena for `--shm mode` (None and why not, for auto/off)."""
    if mode == "off":
        return None, "--shm off"
    try:
        return ClientArena(size_bytes, rank), ""
    except ShmUnavailable as exc:
        if mode == "on":
            raise
        return None, str(exc)


def log_fallback(address: str, reason: str) -> None:
    log.info(kv("shm_fallback", server=address, reason=reason,
                hint="pushes travel inline over gRPC"))


@dataclass
class ShmPush:
    """An unanswered push sent by reference: its header (re-stamped with the current
    epoch whenever it is (re)sent) and its region."""

    head: shard_pb2.Push
    slot: ShmSlot

    def stamped(self, epoch: int) -> shard_pb2.Push:
        self.head.shm_epoch = epoch
        return self.head

    def message(self, epoch: int) -> bytes:
        return self.stamped(epoch).SerializeToString()


def batch_message(pushes: Sequence[ShmPush], epoch: int, run_id: str, rank: int) -> bytes:
    """One Push message carrying several pushes by reference (Push.batch), each stamped
    with `epoch`: the server answers them in one Update."""
    return shard_pb2.Push(run_id=run_id, rank=rank,
                          batch=[p.stamped(epoch) for p in pushes]).SerializeToString()
