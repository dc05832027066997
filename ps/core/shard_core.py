"""The Store for asyncio (transport-free, no grpc): update math off the event loop.

Register and push application run in a ThreadPoolExecutor (torch releases the
GIL during the kernels), so different ranks' partitions update in parallel;
the event loop only moves messages. Flush waits on an asyncio.Condition that
is notified after every applied push.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from hybridps import optim
from hybridps.errors import FlushTimeout, InvalidArgument, ShardError
from hybridps.optim import OptimizerSpec
from ps.core.checkpoint import DeferredWrites
from ps.core.paging import PageCall, PageResult
from ps.core.partition import TableSpec
from ps.core.push import Answer, PushChunk
from ps.core.server_stats import ServerStats
from ps.core.store import RankStep, RegisteredTable, Store, SyncSession, kv

log = logging.getLogger("ps.core")
T = TypeVar("T")

DEFAULT_FLUSH_TIMEOUT_S = 30.0
# The longest a Flush or Checkpoint may ask to wait: a waiting call holds a coroutine and a
# place in the waiters, so a client cannot park calls on the server for ever.
MAX_WAIT_S = 86400.0
# A one-chunk push of at most this many gradient elements is applied on the event loop
# itself: its kernel takes microseconds, less than the two thread hops of the update pool.
# (The last chunk of a chunked push applies the whole push, however small that chunk is.)
INLINE_FEED_ELEMENTS = 1 << 16


def default_update_threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def torch_threads_per_worker(update_threads: int) -> int:
    """Intra-op threads for each pool thread so the pool does not oversubscribe the cores."""
    return max(1, (os.cpu_count() or 1) // max(1, update_threads))


def _init_update_thread(num_threads: int) -> None:
    torch.set_num_threads(num_threads)


def _feed_float32(session: SyncSession, chunk: PushChunk) -> Answer | None:
    """Feed a chunk whose gradients may have travelled as bf16/fp16 (--wire-dtype): the
    optimizer math is float32, so upcast here, in the update thread, not on the loop."""
    if chunk.grads.dtype in (torch.bfloat16, torch.float16):
        chunk.grads = chunk.grads.float()
    return session.feed(chunk)


def _feed_all_float32(session: SyncSession, chunks: Sequence[PushChunk]
                      ) -> list[Answer | None]:
    return [_feed_float32(session, chunk) for chunk in chunks]


class ShardCore:
    def __init__(self, store: Store, *, update_threads: int = 0, kernel_threads: int = 0,
                 flush_timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S) -> None:
        self.store = store
        self.update_threads = update_threads or default_update_threads()
        # The native kernel's threads are its own pool, not torch's intra-op threads (which
        # are cut per update thread below): one update of a big push may use every core.
        self.kernel_threads = kernel_threads or optim.default_kernel_threads()
        optim.set_kernel_threads(self.kernel_threads)
        self.flush_timeout_s = flush_timeout_s
        per_thread = torch_threads_per_worker(self.update_threads)
        torch.set_num_threads(per_thread)
        self._pool = ThreadPoolExecutor(max_workers=self.update_threads,
                                        thread_name_prefix="ps-update",
                                        initializer=_init_update_thread,
                                        initargs=(per_thread,))
        self._applied = asyncio.Condition()
        self.deferred = DeferredWrites(self.update_threads)  # the two-step Checkpoint's
        # Flushes waiting on _applied: a push wakes them only when there are any (the loop
        # runs both, so none can start waiting between the check and the notify).
        self._flush_waiters = 0
        log.info(kv("core_start", server_id=store.server_id, update_threads=self.update_threads,
                    torch_threads=per_thread))
        # Which row kernel runs (native C loops or the torch fallback) and why, for users.
        info = optim.kernel_info()
        log.info(kv("kernel", **{k: v for k, v in info.items() if k != "native_build"},
                    build=info.get("native_build", "-")))

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a bulk conversion of the transport (encoding an answer) in the update pool,
        so the event loop keeps moving messages meanwhile."""
        return await self._run(fn, *args)

    async def register(self, run_id: str, rank: int, world_size: int, incarnation: int,
                       tables: Sequence[TableSpec],
                       optimizer: OptimizerSpec | Mapping[str, Any],
                       restore: tuple[str, int] | None = None,
                       row_dtype: torch.dtype = torch.float32,
                       secret: str = "", *, run_secret: str = "", restore_secret: str = "",
                       checkpoint_dir: str = "") -> tuple[list[RegisteredTable], str]:
        """Store.register_partition: (tables, the partition's secret)."""
        register = functools.partial(self.store.register_partition, run_secret=run_secret,
                                     restore_secret=restore_secret,
                                     checkpoint_dir=checkpoint_dir)
        return await self._run(register, run_id, rank, world_size, incarnation, tables,
                               optimizer, restore, row_dtype, secret)

    async def seed_rows(self, run_id: str, rank: int, incarnation: int, table: str,
                        row_start: int, rows_ND: torch.Tensor) -> tuple[int, int]:
        return await self._run(self.store.seed_rows, run_id, rank, incarnation, table,
                               row_start, rows_ND)

    def open_session(self) -> SyncSession:
        return self.store.open_session()

    async def feed(self, session: SyncSession, chunk: PushChunk) -> Answer | None:
        """Check/buffer one chunk; apply when it completes its push (in the pool, or here
        for a small one-chunk push)."""
        return (await self.feed_all(session, [chunk]))[0]

    async def feed_all(self, session: SyncSession, chunks: Sequence[PushChunk]
                       ) -> list[Answer | None]:
        """`feed` each chunk in order, as if each came alone (one message's pushes: a
        PushBatch's entries), with one hop to the update pool for all of them, or none
        when every one is small. A refused chunk raises after the ones before it were
        applied, as when they come one by one."""
        if all(self._on_loop(chunk) for chunk in chunks):
            answers = [_feed_float32(session, chunk) for chunk in chunks]
        else:
            answers = await self._run(_feed_all_float32, session, chunks)
        if self._flush_waiters and any(a is not None and not a.duplicate for a in answers):
            async with self._applied:
                self._applied.notify_all()
        return answers

    def _on_loop(self, chunk: PushChunk) -> bool:
        return (chunk.total_chunks == 1 and chunk.grads.numel() <= INLINE_FEED_ELEMENTS
                and not self.store.spill.enabled)  # a spilled page's read: not on the loop

    async def flush(self, run_id: str, rank: int, step: int,
                    timeout_s: float = 0.0) -> list[RankStep]:
        """Wait until every named (rank, table) applied `step`; FlushTimeout otherwise."""
        self._flush_waiters += 1
        try:
            if not 0 <= timeout_s <= MAX_WAIT_S:
                raise InvalidArgument(f"flush run={run_id!r}: timeout_s={timeout_s} must be "
                                      f"in [0, {MAX_WAIT_S:g}] (0: the server's default)")
            timeout = timeout_s or self.flush_timeout_s
            applied, behind = self.store.flush_status(run_id, rank, step)
            if not behind:
                return applied

            def done() -> bool:
                return not self.store.flush_status(run_id, rank, step)[1]

            async with self._applied:
                try:
                    await asyncio.wait_for(self._applied.wait_for(done), timeout)
                except TimeoutError:
                    _, behind = self.store.flush_status(run_id, rank, step)
                    late = ", ".join(f"rank {r.rank} table {r.table!r} at step {r.last_step}"
                                     for r in behind)
                    raise FlushTimeout(
                        f"flush run={run_id!r} rank={rank} step={step}: still behind after "
                        f"{timeout:g}s: {late}"
                    ) from None
            return self.store.flush_status(run_id, rank, step)[0]
        except ShardError as exc:
            self.store.record_refusal(exc.reason, run_id)
            raise
        finally:
            self._flush_waiters -= 1

    async def checkpoint(self, run_id: str, ranks: Sequence[int], step: int, directory: str,
                         timeout_s: float = 0.0, since: int | None = None,
                         deferred: bool = False) -> tuple[list[tuple[int, Any]], int]:
        """Wait until `ranks` (all: empty) applied every push through `step`, then save
        (`since`: incremental, Store.checkpoint): (the files, the largest partition copy's
        bytes). `deferred`: answer () once the copies are taken; their write runs in the
        background (ps/core/checkpoint.py DeferredWrites) and `checkpoint_done` waits for
        it. A checkpoint of the same ranks waits for the previous one's write first."""
        for rank in (list(ranks) or [-1]):
            await self.flush(run_id, rank, step, timeout_s)
        previous = self.deferred.previous(run_id, ranks)
        if previous is not None:  # its error went to its CheckpointDone
            await asyncio.wait([asyncio.wrap_future(previous)])
        write, snapshot_bytes = await self._run(functools.partial(
            self.store.checkpoint_write, deferred=deferred), run_id, list(ranks), step,
            directory, since)
        if deferred:
            self.deferred.start(run_id, ranks, step, directory, write)
            return [], snapshot_bytes
        return await self._run(write), snapshot_bytes

    async def checkpoint_done(self, run_id: str, ranks: Sequence[int], step: int,
                              directory: str, timeout_s: float = 0.0
                              ) -> list[tuple[int, Any]]:
        """The files of the deferred checkpoint of `step`, once durable (the write's error
        otherwise; FlushTimeout after `timeout_s`, the write going on)."""
        done = self.deferred.done(run_id, ranks, step, directory)
        timeout = timeout_s or self.flush_timeout_s
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(done)), timeout)
        except TimeoutError:
            raise FlushTimeout(f"checkpoint done run={run_id!r} ranks={sorted(set(ranks))} "
                               f"step={step}: its files are still being written after "
                               f"{timeout:g}s") from None

    async def page(self, run_id: str, rank: int, incarnation: int, table: str,
                   call: PageCall) -> PageResult:
        """Store.page, off the event loop."""
        return await self._run(self.store.page, run_id, rank, incarnation, table, call)

    def stats(self, run_id: str = "") -> ServerStats:
        return self.store.stats(run_id)

    def shutdown(self) -> None:
        self.deferred.shutdown()
        self._pool.shutdown(wait=True, cancel_futures=True)
