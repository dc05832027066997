"""Same-node shared memory, server side: map a rank's arena, check every reference.

Transport layer (the servicer's side of the line; no grpc here and nothing the core
needs): `ArenaRegistry.attach` maps the arena a rank offers at Register, `resolve`
turns a push's references into tensors viewing it, `ServerArena.write_answer` puts
an answer into the region the push named.

The arena is untrusted input, written by another process at any time:
- only files of the expected shape are mapped: in SHM_DIR, named like an arena, a
  regular file (no symlink) owned by this server's user with no group/other access,
  of the announced size, with the announced nonce in its header. A process that can
  offer such a file could signal this server anyway (same user), so mapping it gives
  nothing away;
- every reference is checked (inside the data part, aligned, length = shape x dtype,
  the answer region disjoint from the inputs) before anything reads it;
- ids are copied out before they are validated (they index the optimizer state: a
  rank rewriting them after the check must not make the kernel write out of bounds);
  gradients are read in place (a rank racing its own gradients only harms its own
  partition, and every element read is inside the mapping).

Region lifetime (the rule both sides keep; the worker side is worker/sync/arena.py): the
worker reuses a region only after the Update of its push arrived and was taken, and
never re-sends a push after its Update arrived. The server writes into a region
all under the partition lock (the push's ResolvedShmPush is the core's AnswerSink):
- (a) in the kernel, applying the push for the first time (AnswerSink.out, fp32
  deltas): no Update of that push exists yet, so the region is still the push's
  whichever stream applies it (a push is applied once);
- (b) through `write_answer` in every other case - a duplicate (from the answer
  cache, which only borrows a delta the kernel wrote here: a duplicate is a push the
  rank got no answer for, so it has not reused the region), a --wire-dtype delta
  converted, master rows copied.
  `write_answer` holds the arena's lock and checks the push's epoch; each Register
  that accepts the arena starts a new epoch (under that lock). So a Sync handler of a
  stream that broke - still running here while the rank reconnected, re-sent, got
  its answers and reused the regions - writes nothing. Its pushes are refused with
  ABORTED (StaleShmEpoch) when they are read, too.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import math
import mmap
import os
import stat
import threading
from dataclasses import dataclass

import torch

from hybridps import arena_layout as layout
from hybridps.errors import BadShmReference, StaleShmEpoch
from hybridps.logs import kv

log = logging.getLogger("ps.arena_server")


@dataclass(frozen=True)
class ShmRef:
    """A tensor the push says lies in the arena (ShmTensor, converted)."""

    name: str                 # ids | grads | answer, for messages
    dtype: torch.dtype | None  # None: not a dtype that travels
    dtype_name: str
    shape: tuple[int, ...]
    offset: int
    length: int

    def describe(self) -> str:
        return (f"shm {self.name} (offset {self.offset}, length {self.length}, "
                f"{self.dtype_name} {list(self.shape)})")

    @property
    def span(self) -> tuple[int, int]:
        return self.offset, self.offset + self.length


class ArenaRefused(Exception):
    """The arena cannot be used; the message says why (sent back in RegisterResponse)."""


def check_ref(ref: ShmRef, size: int, what: str) -> None:
    """Raise BadShmReference naming the value unless `ref` is a valid region of an arena
    of `size` bytes."""
    problem = _ref_problem(ref, size)
    if problem is not None:  # the message is formatted only then (3 refs a push, on the loop)
        raise BadShmReference(f"{what}: {ref.describe()}: {problem}")


def _ref_problem(ref: ShmRef, size: int) -> str | None:
    if ref.dtype is None:
        return f"dtype {ref.dtype_name} cannot travel"
    if any(s < 0 for s in ref.shape):
        return f"negative dimension in shape {list(ref.shape)}"
    numel = math.prod(ref.shape)
    itemsize = ref.dtype.itemsize
    if ref.length != numel * itemsize:
        return (f"length {ref.length} does not match shape {list(ref.shape)} of "
                f"{ref.dtype_name} ({numel * itemsize} bytes)")
    if ref.offset % layout.ALIGN:
        return f"offset {ref.offset} is not a multiple of {layout.ALIGN}"
    if not layout.HEADER_BYTES <= ref.offset <= ref.offset + ref.length <= size:
        return (f"[{ref.offset}, {ref.offset + ref.length}) is outside the arena's data "
                f"[{layout.HEADER_BYTES}, {size})")
    return None


def _overlap(a: ShmRef, b: ShmRef) -> bool:
    return a.length > 0 and b.length > 0 and a.offset < b.span[1] and b.offset < a.span[1]


class ServerArena:
    """One rank's arena, mapped read-write."""

    def __init__(self, path: str, size: int, nonce: bytes, mapping: mmap.mmap,
                 epoch: int) -> None:
        self.path, self.size, self.nonce = path, size, nonce
        self._mmap = mapping
        self._views = layout.Views(mapping)
        self.lock = threading.Lock()
        self.epoch = epoch
        self.pushes = 0
        self.bytes = 0  # tensor bytes read and answered through the arena

    def view(self, ref: ShmRef) -> torch.Tensor:
        """The checked region as a tensor (keeps the mapping alive while it lives)."""
        assert ref.dtype is not None  # check_ref ran
        return self._views.view(ref.offset, ref.dtype, ref.shape)

    def check_epoch(self, epoch: int, what: str) -> None:
        if epoch != self.epoch:
            raise StaleShmEpoch(f"{what}: shm epoch {epoch} is not the arena's current epoch "
                                f"{self.epoch}: the rank registered again since (a stream "
                                "left over from a reconnect)")

    def write_answer(self, epoch: int, region: torch.Tensor, answer: torch.Tensor,
                     what: str) -> None:
        """Copy (and convert) `answer` into `region`, unless a newer epoch began."""
        with self.lock:
            self.check_epoch(epoch, what)
            if answer.numel() and answer.data_ptr() != region.data_ptr():
                region.copy_(answer)

    def close(self) -> None:
        """Forget the mapping: it is unmapped when the last tensor viewing it is gone.

        Never mmap.close(): tensors from torch.frombuffer hold the mmap object but no
        buffer export, so closing it would unmap memory they still point into (a handler
        finishing, an answer in the cache)."""
        self._mmap = None  # type: ignore[assignment]
        self._views = None  # type: ignore[assignment]


def open_arena(path: str, size: int, nonce: bytes, directory: str = layout.SHM_DIR
               ) -> tuple[mmap.mmap, str]:
    """Map the arena a rank offers; ArenaRefused says why not."""
    if len(nonce) != layout.NONCE_BYTES:
        raise ArenaRefused(f"nonce of {len(nonce)} bytes, expected {layout.NONCE_BYTES}")
    if not layout.MIN_ARENA_BYTES <= size <= layout.MAX_ARENA_BYTES:
        raise ArenaRefused(f"size {size} is outside [{layout.MIN_ARENA_BYTES}, "
                           f"{layout.MAX_ARENA_BYTES}]")
    head, name = os.path.split(path)
    if (not os.path.isabs(path) or os.path.realpath(head) != os.path.realpath(directory)
            or not layout.NAME_PATTERN.match(name)):
        raise ArenaRefused(f"path {path!r} is not an arena file in {directory} "
                           "(hybridps-*.arena)")
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ArenaRefused(f"{path} does not exist here (another host, container or IPC "
                           "namespace?)") from None
    except OSError as exc:
        raise ArenaRefused(f"cannot open {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ArenaRefused(f"{path} is not a regular file")
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise ArenaRefused(f"{path} must be owned by uid {os.geteuid()} with mode 0600 "
                               f"(is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})")
        if st.st_size != size:
            raise ArenaRefused(f"{path} has {st.st_size} bytes, the Register says {size}")
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED | layout.MAP_POPULATE,
                            mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    magic, found, announced = layout.unpack_header(mapping[:layout.HEADER_BYTES])
    if magic != layout.MAGIC or announced != size or not hmac.compare_digest(found, nonce):
        mapping.close()
        raise ArenaRefused(f"{path}: header does not match (magic, size or nonce differs "
                           "from the Register: not this rank's arena)")
    return mapping, path


class ArenaRegistry:
    """The arenas accepted, by (run, rank): one each, replaced by a newer one."""

    def __init__(self, directory: str = layout.SHM_DIR) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._arenas: dict[tuple[str, int], ServerArena] = {}
        self._epochs = itertools.count(1)  # server-wide: an old epoch never matches anew

    def get(self, run_id: str, rank: int) -> ServerArena | None:
        return self._arenas.get((run_id, rank))

    def attach(self, run_id: str, rank: int, path: str, size: int,
               nonce: bytes) -> tuple[bool, str, int]:
        """(accepted, reason, epoch). The rank's arena already mapped (a reconnect: its
        file is unlinked by now) gets a new epoch; another one is opened and replaces it."""
        key = (run_id, rank)
        with self._lock:
            held = self._arenas.get(key)
        if held is not None and held.size == size and hmac.compare_digest(held.nonce, nonce):
            with held.lock:  # waits for a write of the old epoch in progress
                held.epoch = next(self._epochs)
            log.info(kv("shm_reattached", run=run_id, rank=rank, epoch=held.epoch))
            return True, "", held.epoch
        try:
            mapping, path = open_arena(path, size, nonce, self.directory)
        except ArenaRefused as exc:
            log.info(kv("shm_refused", run=run_id, rank=rank, reason=str(exc)))
            return False, str(exc), 0
        arena = ServerArena(path, size, nonce, mapping, next(self._epochs))
        with self._lock:
            old, self._arenas[key] = self._arenas.get(key), arena
        if old is not None:
            self._log_release(run_id, rank, old, "replaced")
            old.close()
        log.info(kv("shm_attached", run=run_id, rank=rank, path=path, bytes=size,
                    epoch=arena.epoch))
        return True, "", arena.epoch

    def paths(self) -> list[str]:
        """The files of the arenas mapped now (ps/core/maintenance.py never sweeps these)."""
        with self._lock:
            return [arena.path for arena in self._arenas.values()]

    def release(self, run_id: str, rank: int, why: str) -> None:
        with self._lock:
            arena = self._arenas.pop((run_id, rank), None)
        if arena is not None:
            self._log_release(run_id, rank, arena, why)
            arena.close()

    def close(self) -> None:
        with self._lock:
            arenas, self._arenas = dict(self._arenas), {}
        for (run_id, rank), arena in arenas.items():
            self._log_release(run_id, rank, arena, "server stopping")
            arena.close()

    @staticmethod
    def _log_release(run_id: str, rank: int, arena: ServerArena, why: str) -> None:
        log.info(kv("shm_released", run=run_id, rank=rank, why=why, pushes=arena.pushes,
                    bytes=arena.bytes))


@dataclass
class ResolvedShmPush:
    """A shared-memory push resolved: the tensors the core reads, and the answer region
    as the core's AnswerSink (ps/core/partition.py)."""

    arena: ServerArena
    epoch: int
    ids: torch.Tensor     # a copy (see the module docstring)
    grads: torch.Tensor   # a view of the arena
    answer: torch.Tensor  # a view of the arena, [U, dim] in the answer's dtype
    tensor_bytes: int     # of the three regions (their checked lengths)
    what: str = "push"

    @property
    def out(self) -> torch.Tensor | None:
        """Where the kernel may write an fp32 delta: the region itself."""
        return self.answer if self.answer.dtype == torch.float32 else None

    def write(self, answer_UD: torch.Tensor) -> None:
        if tuple(answer_UD.shape) != tuple(self.answer.shape):
            raise BadShmReference(f"{self.what}: the answer is {list(answer_UD.shape)}, the "
                                  f"push's shm answer region {list(self.answer.shape)} (a "
                                  "re-sent push that differs from the first?)")
        self.arena.write_answer(self.epoch, self.answer, answer_UD, self.what)


def resolve(arena: ServerArena | None, epoch: int, refs: tuple[ShmRef, ShmRef, ShmRef],
            answer_dtype: torch.dtype | None, what: str, no_arena: str) -> ResolvedShmPush:
    """Check a push's (ids, grads, answer) references against the rank's arena.

    `answer_dtype`: what the answer will hold (None: unknown here, e.g. the rank is not
    registered: the core refuses the push before anything is written)."""
    if arena is None:
        raise BadShmReference(f"{what}: references shared memory, but {no_arena}")
    arena.check_epoch(epoch, what)
    ids_ref, grads_ref, answer_ref = refs
    for ref in refs:
        check_ref(ref, arena.size, what)
    if ids_ref.dtype != torch.int64 or len(ids_ref.shape) != 1:
        raise BadShmReference(f"{what}: {ids_ref.describe()} must be INT64 [U]")
    rows = ids_ref.shape[0]
    if grads_ref.dtype not in (torch.float32, torch.bfloat16, torch.float16) \
            or len(grads_ref.shape) != 2 or grads_ref.shape[0] != rows:
        raise BadShmReference(f"{what}: {grads_ref.describe()} must be FLOAT32, BFLOAT16 or "
                              f"FLOAT16 [U={rows}, dim]")
    if answer_ref.shape != grads_ref.shape:
        raise BadShmReference(f"{what}: {answer_ref.describe()} must have the shape of the "
                              f"gradients {list(grads_ref.shape)}")
    if answer_dtype is not None and answer_ref.dtype != answer_dtype:
        raise BadShmReference(f"{what}: {answer_ref.describe()}: the answer of this push is "
                              f"{answer_dtype}, not {answer_ref.dtype_name}")
    for other in (ids_ref, grads_ref):
        if _overlap(answer_ref, other):
            raise BadShmReference(f"{what}: {answer_ref.describe()} overlaps "
                                  f"{other.describe()}")
    return ResolvedShmPush(arena, epoch, arena.view(ids_ref).clone(), arena.view(grads_ref),
                   arena.view(answer_ref),
                   ids_ref.length + grads_ref.length + answer_ref.length, what)
