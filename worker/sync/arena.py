"""Shared-memory placement, worker side: the rank's arena, its regions, what goes by
reference, and when a region comes back.

With `--same-node auto|require` a rank creates an arena (a file under /dev/shm, mode 0600,
space reserved up front) and offers it at Register; the node's shard server maps it
(ps/edge/arena_server.py). While it is accepted, each push copies its ids and gradients once
into a region of the arena, the Push message carries only references (ShmRefs), and
the server writes the answer's delta (or rows) into the same region; the Update is a
header. Layout constants: hybridps/arena_layout.py.

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
  is answered, or fenced by the arena epoch (ps/edge/arena_server.py), so a region freed
  here is never written again by a handler of an older stream.
- a full arena: the push goes inline instead of waiting: regions are only freed by
  the training thread's next `take`, and that may itself be waiting for this very
  push. `SyncStats.shm_inline_pushes` counts these, a warning says so once.

Size (`size_arena`). K+2 steps of pushes are live at once (step t's region is freed at
the take before step t+K+2, after the push of step t+K+1), and a wrap can leave up to a
region unused at the ring's end: the arena holds K+3 steps (ids 8 bytes, then gradients
and answer dim x 4 bytes a row each). `--same-node-mb 0` (the default) sizes it from the
run's own pushes when the task says how many rows it pushes a step
(Task.rows_pushed_per_step: with KGE's 1vsAll every owned row, every step), at least
64 MiB, within the free space of /dev/shm; a given --same-node-mb that holds fewer steps is
used as given, with a warning naming the size that would.

Shape suffixes in names: `_U` one entry per row a push carries (its unique ids), `_D`
the table's dim: `ids_U` int64 [U], `grads_UD` [U, dim].
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import mmap
import os
import secrets
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hybridps import arena_layout as layout
from hybridps import wire
from hybridps.logs import kv
from hybridps.v1 import shard_pb2
from worker.config.train_config import SHM_MODES
from worker.updates.source import ServerRefused

if TYPE_CHECKING:
    from worker.config.train_config import SameNodeConfig, SyncConfig
    from worker.embedding.sharded import ShardedEmbedding
    from worker.runtime.dist import DistContext
    from worker.tasks.base import Task

log = logging.getLogger("worker.arena")




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
    """

    def __init__(self, start: int, end: int) -> None:
        if not 0 <= start < end:
            raise ValueError(f"ring [{start}, {end}) is empty")
        self.start, self.end = start, end
        self._live: collections.deque[Region] = collections.deque()
        self._head = self._tail = start

    @property
    def capacity(self) -> int:
        return self.end - self.start

    @property
    def used(self) -> int:
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
                                 f"{exc.strerror} (is {directory} big enough? --same-node-mb)"
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


AUTO_MIN_BYTES = 64 << 20  # the arena without an estimate, and the least one sized
SHM_SHARE = 0.8  # of the free space in the arena's directory, for all of a node's ranks


def arena_bytes_needed(pushes: Sequence[tuple[int, int]], staleness: int,
                       wire_dtype: torch.dtype, answer_dtype: torch.dtype) -> int:
    """Bytes to hold K+3 steps of pushes, one push (rows, dim) per table unit a step."""
    per_step = sum(region_bytes(rows, dim, wire_dtype, answer_dtype) for rows, dim in pushes)
    return layout.HEADER_BYTES + (staleness + 3) * per_step


def size_arena(requested: int, needed: int | None, *, staleness: int, local_ranks: int,
               directory: str = layout.SHM_DIR) -> tuple[int, str | None]:
    """(arena bytes, a warning or None): `requested` 0 is --same-node-mb 0, sized from
    `needed` (None: the task cannot say: AUTO_MIN_BYTES). Module doc."""
    mib = 1 << 20
    if needed is None:
        return (requested or AUTO_MIN_BYTES), None
    steps = f"{staleness + 3} steps of this run's pushes ({needed / mib:.0f} MiB)"
    if requested:
        if requested >= needed:
            return requested, None
        return requested, (f"--same-node-mb {requested // mib} holds fewer than {steps}: "
                           f"pushes that do not fit go inline, at about half the speed; use "
                           f"--same-node-mb {math.ceil(needed / mib)} (or 0: sized by itself)")
    size = max(AUTO_MIN_BYTES, needed)
    try:
        stat = os.statvfs(directory)
        room = int(stat.f_bavail * stat.f_frsize * SHM_SHARE / max(local_ranks, 1))
    except OSError:
        return size, None
    if size <= room:
        return size, None
    return max(room, layout.MIN_ARENA_BYTES), (
        f"the same-node arena should hold {steps} but {directory} has room for "
        f"{room / mib:.0f} MiB a rank ({local_ranks} ranks): pushes that do not fit go "
        f"inline, at about half the speed; enlarge {directory} or pass --same-node off")


def arena_bytes_for_run(sync: SyncConfig, node: SameNodeConfig, task: Task,
                        embedding: ShardedEmbedding, ctx: DistContext, wire: torch.dtype) -> int:
    """The arena of this rank (--same-node-mb, 0: sized from the pushes its task says it
    makes a step, Task.rows_pushed_per_step) for gradients sent as `wire`; rank 0 warns
    when it is too small."""
    answer = embedding.row_dtype if embedding.row_dtype != torch.float32 else wire
    rows = task.rows_pushed_per_step(ctx.world_size)
    units = [(u.dim, [(m.name, m.end - m.start) for m in u.members])
             for u in embedding.units.values()]
    needed = None
    if rows is not None and all(name in rows for _, members in units for name, _ in members):
        pushes = [(sum(min(rows[name], owned) for name, owned in members), dim)
                  for dim, members in units]
        needed = arena_bytes_needed(pushes, sync.staleness, wire, answer)
    size, warning = size_arena(node.same_node_mb << 20, needed,
                               staleness=sync.staleness, local_ranks=ctx.local_world_size)
    if warning and ctx.rank == 0:
        log.warning(kv("same_node_arena", bytes=size, needed=needed, problem=warning))
    return size


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


@dataclass
class PlacedShmPush:
    """An unanswered push sent by reference: its message without the epoch (stamped
    whenever it is (re)sent) and its region."""

    head: shard_pb2.Push
    slot: ShmSlot

    def stamped(self, epoch: int) -> shard_pb2.Push:
        self.head.shm.epoch = epoch
        return self.head


class ArenaPlacement:
    """The rank's arena across Registers: offered, accepted (`epoch` > 0) or not, what
    each push places in it, and the regions of the updates handed out, freed at the
    next take. One owner thread (the training thread)."""

    def __init__(self, mode: str, size_bytes: int, rank: int, address: str) -> None:
        """`mode`: offer an arena and fall back to inline tensors (auto), insist (on), or
        never (off): worker/config/train_config.py SHM_MODES."""
        if mode not in SHM_MODES:
            raise ValueError(f"shm={mode!r} is not one of {', '.join(SHM_MODES)}")
        self.mode, self.size_bytes, self.rank, self.address = mode, size_bytes, rank, address
        self.arena: ClientArena | None = None
        self.epoch = 0  # > 0 while the server accepts the arena
        self.status = "off"  # SyncStats.shm: "off", "on", or "inline: <why not>"
        self.inline_pushes = 0  # pushes that went inline while the arena was accepted
        self._answered: dict[tuple[int, str], Region] = {}  # regions of arrived updates
        self._taken: list[Region] = []  # freed at the next take

    def offer(self, first: bool) -> shard_pb2.SharedMemoryArena | None:
        """What to offer at this Register: the arena first, then on every re-Register
        while the server uses it. Creates it on the first Register (ServerRefused with
        --same-node require when it cannot)."""
        if first and self.mode != "off" and self.arena is None:
            try:
                self.arena = ClientArena(self.size_bytes, self.rank)
            except ShmUnavailable as exc:
                if self.mode == "on":
                    raise ServerRefused(f"rank {self.rank}: --same-node require: {exc}") from None
                self._fall_back(str(exc))
        elif first and self.mode == "off":
            self.status = "off"
        if self.arena is None or not (first or self.epoch > 0):
            return None
        return self.arena.offer()

    def accept(self, status: shard_pb2.SharedMemoryStatus, first: bool) -> bool:
        """The server's answer to the arena offered at Register: True if accepted. False
        after a re-Register: the pushes placed so far must go again inline."""
        arena = self.arena
        assert arena is not None
        if first:
            arena.unlink()  # the server mapped it by now, or never will: no file left behind
        if status.accepted:
            if first:
                log.info(kv("shm", server=self.address, path=arena.path, bytes=arena.size,
                            epoch=status.epoch))
            self.epoch = int(status.epoch)
            self.status = "on"
            return True
        reason = status.reason or "the server gave no reason"
        if self.mode == "on":
            raise ServerRefused(
                f"rank {self.rank}: --same-node require, but shard server {self.address} did "
                f"not accept the shared-memory arena {arena.path}: {reason} (--same-node auto "
                "falls back to inline tensors)")
        self.epoch = 0
        self._fall_back(reason)
        if first:
            arena.close()
            self.arena = None
        return False

    def place(self, ids_U: torch.Tensor, grads_UD: torch.Tensor, wire_dtype: torch.dtype,
              answer_dtype: torch.dtype, what: str) -> ShmSlot | None:
        """The push copied into a new region; None: inline (no arena, or no room)."""
        arena = self.arena
        if arena is None or not self.epoch:
            return None
        slot = place(arena, ids_U, grads_UD, wire_dtype, answer_dtype)
        if slot is None:
            self.inline_pushes += 1
            if self.inline_pushes == 1:
                log.warning(kv("shm_full", push=what, rows=int(ids_U.shape[0]),
                               arena_bytes=arena.size, used=arena.ring.used,
                               hint="this push (and others that do not fit) goes inline; "
                                    "raise --same-node-mb"))
        return slot

    def answered(self, step: int, table: str, slot: ShmSlot) -> None:
        """The update of (step, table) views `slot` until it was taken and the next take."""
        self._answered[(step, table)] = slot.region

    def before_take(self) -> None:
        """Free the regions of the updates the previous take handed out."""
        if self.arena is None:
            return
        taken, self._taken = self._taken, []
        for region in taken:
            self.arena.ring.free(region)

    def after_take(self, steps_tables: Sequence[tuple[int, str]]) -> None:
        """These updates were handed out: their regions are freed at the next take."""
        for key in steps_tables:
            region = self._answered.pop(key, None)
            if region is not None:
                self._taken.append(region)

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()  # unmapped once the last RowUpdate viewing it is gone

    def _fall_back(self, reason: str) -> None:
        self.status = f"inline: {reason}"
        log.info(kv("shm_fallback", server=self.address, reason=reason,
                    hint="pushes travel inline over gRPC"))
