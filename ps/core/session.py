"""One Sync stream's view of the Store (transport-free, no grpc): chunk assembly,
exactly-once application, queue-depth accounting. See ps/core/store.py.

Exactly-once: a push of a step already applied gets the answer saved for it, if it
carries the same payload (its digest, hybridps/push_checks.py, computed in the pass that
checks each chunk, is kept with the answer); a re-sent step with another payload is a
client's bug, refused (Conflict) naming the step."""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hybridps.errors import Conflict, InvalidArgument, ShardError
from hybridps.push_checks import PayloadDigest
from ps.core.partition import Partition, TableState
from ps.core.push import Answer, PushChunk, check_push_lr, first_duplicate

TableKey = tuple[str, int, str]  # (run_id, rank, table)


class Store(Protocol):
    """What a session needs of ps.core.store.Store (a protocol: no import cycle)."""

    def resolve(self, run_id: str, rank: int, incarnation: int, table: str,
                what: str) -> tuple[Partition, TableState]: ...

    def record_refusal(self, reason: str, run_id: str = "", rank: int | None = None,
                       table: str = "") -> None: ...

    def _queue_add(self, key: TableKey, n: int) -> None: ...

    # (run_id, rank, table, seconds) of every answered push (ps/edge/metrics.py), or None
    push_observer: Callable[[str, int, str, float], None] | None


@dataclass
class _Pending:
    """The buffered chunks of the push in progress on one session."""

    identity: tuple[str, int, int, int, str]
    num_chunks: int
    part: Partition
    table: TableState
    what: str
    ids: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    grad_max: float = 0.0  # the largest |gradient| of the chunks so far
    lr: float | None = None  # Push.lr of chunk 0 (None: the registered lr)
    # the payload digest, chunk by chunk (TableState.check_rows adds each)
    digest: PayloadDigest = field(default_factory=PayloadDigest)
    tickets: list[TableKey] = field(default_factory=list)  # queue_depth entries it holds

    @property
    def next_chunk(self) -> int:
        return len(self.ids)


class SyncSession:
    """One Sync stream: chunk assembly, exactly-once application, queue-depth accounting.

    Call `received(chunk)` when a chunk arrives (it then counts in queue_depth until
    its push is answered or refused), `feed(chunk)` in arrival order (returns the
    Answer when the chunk completes a push, else None), and `close()` at the end.
    """

    def __init__(self, store: Store) -> None:
        self._store = store
        self._pending: _Pending | None = None
        # received() and close() run on the event loop while feed() runs in a pool thread
        # (and may still be running when a cancelled stream closes): guard the counts.
        self._count_lock = threading.Lock()
        self._counted: collections.Counter[TableKey] = collections.Counter()
        self._arrived: dict[tuple[str, int, int, int, str], float] = {}  # push -> arrival
        self._closed = False

    @staticmethod
    def _key(chunk: PushChunk) -> TableKey:
        return (chunk.run_id, chunk.rank, chunk.table)

    def received(self, chunk: PushChunk) -> None:
        if chunk.chunk == 0:
            key = self._key(chunk)
            with self._count_lock:
                if self._closed:
                    return
                self._counted[key] += 1
                self._store._queue_add(key, 1)
                if self._store.push_observer is not None:
                    self._arrived[chunk.identity] = time.perf_counter()
            chunk.queued = True

    def _finish(self, key: TableKey) -> None:
        with self._count_lock:
            if self._counted[key] > 0:
                self._counted[key] -= 1
                self._store._queue_add(key, -1)

    @property
    def buffered_chunks(self) -> int:
        return 0 if self._pending is None else self._pending.next_chunk

    def feed(self, chunk: PushChunk) -> Answer | None:
        try:
            return self._feed(chunk)
        except Exception as exc:
            self._arrived.pop(chunk.identity, None)
            pending, self._pending = self._pending, None
            if pending is not None:
                for key in pending.tickets:
                    self._finish(key)
            if chunk.queued:
                chunk.queued = False
                self._finish(self._key(chunk))
            reason = exc.reason if isinstance(exc, ShardError) else "internal"
            self._store.record_refusal(reason, chunk.run_id, chunk.rank, chunk.table)
            raise

    def _feed(self, chunk: PushChunk) -> Answer | None:
        n = chunk.total_chunks
        what = chunk.describe()
        if n != 1 or chunk.chunk != 0:
            what += f" chunk {chunk.chunk} of {n}"
        if n < 1 or not 0 <= chunk.chunk < n:
            raise InvalidArgument(
                f"{what}: chunk={chunk.chunk} num_chunks={chunk.num_chunks} is invalid "
                "(need 0 <= chunk < num_chunks)"
            )
        pending = self._pending
        if pending is None:
            if chunk.chunk != 0:
                raise InvalidArgument(
                    f"{what}: no push is in progress on this stream; the chunks of a push "
                    "must arrive in order starting with chunk 0"
                )
            part, table = self._store.resolve(chunk.run_id, chunk.rank, chunk.incarnation,
                                              chunk.table, what)
            table.classify_step(chunk.step, what)  # fail fast on out-of-order / evicted
            pending = _Pending(chunk.identity, n, part, table,
                               what if n == 1 else chunk.describe(), lr=chunk.lr)
            self._pending = pending
        elif chunk.identity != pending.identity or n != pending.num_chunks:
            raise InvalidArgument(
                f"{what}: arrived while {pending.what} waits for chunk {pending.next_chunk} "
                f"of {pending.num_chunks}; the chunks of a push must arrive in order, unmixed"
            )
        elif chunk.chunk != pending.next_chunk:
            raise InvalidArgument(
                f"{what}: expected chunk {pending.next_chunk} of {pending.num_chunks} next"
            )
        if chunk.queued:
            chunk.queued = False
            pending.tickets.append(self._key(chunk))
        if chunk.lr is not None:
            check_push_lr(chunk.lr, what)
        if chunk.lr != pending.lr:
            raise InvalidArgument(
                f"{what}: lr={chunk.lr!r} differs from lr={pending.lr!r} of chunk 0; every "
                "chunk of a push carries the push's lr"
            )
        pending.grad_max = max(pending.grad_max,
                               pending.table.check_rows(chunk.ids, chunk.grads, what,
                                                        pending.digest))
        pending.ids.append(chunk.ids)
        pending.grads.append(chunk.grads)
        if pending.next_chunk < n:
            return None

        # The last chunk: apply the whole push under the partition lock.
        if n == 1:
            ids, grads = pending.ids[0], pending.grads[0]
        else:
            ids, grads = torch.cat(pending.ids), torch.cat(pending.grads)
            dup = first_duplicate(ids)
            if dup is not None:
                raise InvalidArgument(
                    f"{pending.what}: id {dup} appears in more than one chunk; pushes must "
                    "be coalesced (each id once)"
                )
        digest = pending.digest.value(pending.lr)
        with pending.part.lock:
            _, table = self._store.resolve(chunk.run_id, chunk.rank, chunk.incarnation,
                                           chunk.table, pending.what)
            saved = table.classify_step(chunk.step, pending.what)
            sink = chunk.sink if n == 1 else None
            if saved is None:
                answer = table.apply(chunk.step, ids, grads, sink, pending.grad_max,
                                     pending.lr, digest)
            elif saved.digest != digest:
                raise Conflict(
                    f"{pending.what}: step {chunk.step} was applied with another payload "
                    "(ids, gradients or lr differ: its digest does not match); a re-sent "
                    "push must be the one sent before: refused, nothing changed")
            elif sink is not None:
                sink.write(saved.delta)
                answer = saved
            else:  # re-sent inline: the caller gets its own copy of a borrowed delta
                answer = (dataclasses.replace(saved, delta=saved.delta.clone(), borrowed=False)
                          if saved.borrowed else saved)
        self._pending = None
        for key in pending.tickets:
            self._finish(key)
        arrived = self._arrived.pop(chunk.identity, None)
        observer = self._store.push_observer
        if arrived is not None and observer is not None:
            observer(chunk.run_id, chunk.rank, chunk.table, time.perf_counter() - arrived)
        return answer

    def close(self) -> None:
        """End of stream: pushes received but never answered leave queue_depth."""
        with self._count_lock:
            self._closed = True
            for key, n in self._counted.items():
                if n > 0:
                    self._store._queue_add(key, -n)
            self._counted.clear()
            self._arrived.clear()
