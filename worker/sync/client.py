"""The shard server as an update source (`ShardClient`, worker/updates/source.py's interface).

Register once (with --row-dtype bf16, SeedRows after it to upload the fp32 initial rows
into the server's master copy), then send each step's pushes over a Sync transport and
read the answers back. The pieces, each in its own module:
- worker/sync/grpc_client.py `ShardRpc`: the channel and every call (its event loop runs in
  a thread of its own), with the call's credentials attached in one place;
- worker/sync/transport.py `SyncTransport`: the gRPC Sync stream (grpc_client.py), which
  carries the pushes and answers inline or, with the arena, their references;
- worker/sync/arena.py `ArenaPlacement`: what goes by reference into shared memory;
- worker/sync/ledger.py `SyncLedger`: the exactly-once bookkeeping, no I/O;
- worker/sync/messages.py: the messages.

One threading model: everything here runs on the thread that calls the client (the
training thread), and so do the ledger, the placement and the transports' `send` and
`receive`; only the gRPC machinery runs on ShardRpc's loop thread, which also
serializes the inline pushes it sends (a copy of the gradients, kept off the step).
The training thread hands a step's pushes to the transport (never waiting for the
network) and reads the answers when the staleness window needs them (`take`).

Failure handling: every wait has a deadline (`--ps-timeout`): registering, waiting for
an update, and a broken connection, which is retried with exponential backoff
(re-Register, then re-send every unanswered push; the server dedupes by (run, rank,
incarnation, step) and answers duplicates from its cache). If the server stays down
past the deadline, or refuses a push, the error is raised naming the server and the step.

Shape suffixes in names: `_U` one entry per row a push carries (its unique ids), `_D`
the table's dim, `_R` the rows this rank owns: `ids_U` [U], `grads_UD` [U, D],
`block_RD` [R, D].
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridps import wire
from hybridps.checkpoint import ShardInfo
from hybridps.logs import kv
from hybridps.optim import OptimizerSpec
from hybridps.paged_rows import PagedOut
from hybridps.security import ClientSecurity
from hybridps.v1 import shard_pb2
from worker.embedding.groups import Member
from worker.embedding.rows import TableConfig
from worker.runtime import faults
from worker.runtime.device_copy import PushOutbox
from worker.runtime.lifecycle import STOP
from worker.sync.arena import ArenaPlacement
from worker.sync.connect import call_until_connected, connect_window_s
from worker.sync.grpc_client import ShardRpc
from worker.sync.ledger import Pending, SyncLedger
from worker.sync.messages import (
    InlinePush,
    PushEncoder,
    make_incarnation,
    optimizer_message,
    table_specs,
)
from worker.sync.transport import (
    SyncTransport,
    TransportError,
    TransportRefused,
    TransportRetryable,
    TransportShutdown,
)
from worker.updates.source import (  # re-exported: the errors and types of every source
    Grads,
    Hold,
    RowUpdate,
    SavedFiles,
    ServerRefused,
    ServerTimeout,
    ServerUnavailable,
    SyncError,
    UpdateSource,
)

__all__ = ["WIRE_DTYPES", "Grads", "RowUpdate", "ServerRefused", "ServerTimeout",
           "ServerUnavailable", "ShardClient", "SyncError", "make_incarnation",
           "optimizer_message"]

log = logging.getLogger("worker.sync")

BACKOFF_START_S = 0.05
BACKOFF_MAX_S = 2.0
STOP_RECONNECT_S = 5.0  # after a stop signal: torchrun kills at 30 s, docker at 10 s
# --wire-dtype values (worker/config/train_config.py validates the flag against these names).
WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# table -> the owned rows as initialised, fp32 blocks (global start, rows): seeds a master
InitialRows = Callable[[str], Iterator[tuple[int, torch.Tensor]]]


class ShardClient(UpdateSource):
    """Register + one Sync transport to the node's shard server."""

    def __init__(self, address: str, *, run_id: str, rank: int, world_size: int,
                 tables: Sequence[TableConfig], ranges: dict[str, tuple[int, int]],
                 optimizer: OptimizerSpec, timeout_s: float, max_chunk_bytes: int,
                 incarnation: int | None = None,
                 restore: tuple[str, int] | None = None,
                 security: ClientSecurity | None = None,
                 row_dtype: torch.dtype = torch.float32,
                 initial_rows: InitialRows | None = None,
                 members: Mapping[str, Sequence[Member]] | None = None,
                 wire_dtype: torch.dtype = torch.float32,
                 shm: str = "off", shm_bytes: int = 64 << 20,
                 rpc: ShardRpc | None = None, run_secret: str = "",
                 restore_secret: str = "", checkpoint_dir: str = "") -> None:
        super().__init__([t.name for t in tables], timeout_s)
        if wire_dtype not in WIRE_DTYPES.values():
            raise ValueError(f"wire dtype {wire_dtype} is not one of "
                             f"{', '.join(map(str, WIRE_DTYPES.values()))}")
        # bf16 rows: the server keeps an fp32 master, seeded from `initial_rows` right
        # after the Register that creates the partition (a restore loads it instead).
        if row_dtype != torch.float32 and initial_rows is None:
            raise ValueError(f"row dtype {row_dtype} needs initial_rows to seed the master")
        self.address, self.run_id, self.rank, self.world_size = address, run_id, rank, world_size
        self.incarnation = make_incarnation() if incarnation is None else incarnation
        self.optimizer, self.max_chunk_bytes = optimizer, max_chunk_bytes
        self.row_dtype, self.wire_dtype, self.initial_rows = row_dtype, wire_dtype, initial_rows
        self.security = security or ClientSecurity()
        # (checkpoint directory, step): the first Register loads the server state from it.
        self.restore = restore
        # members: the tables of each group registered as one table (worker/embedding/groups.py)
        self.table_specs = table_specs(tables, ranges, members)
        self.tables_in.update({n: len(ms) for n, ms in (members or {}).items()})
        self.dims = {t.name: t.dim for t in tables}
        who = f"rank {rank}: shard server {address}"
        self.ledger = SyncLedger(self.buffer.tables, self.dims, row_dtype, self.stats, who,
                                 -1 if restore is None else restore[1], self.tables_in)
        self.placement = ArenaPlacement(shm, shm_bytes, rank, address)
        self.encoder = PushEncoder(run_id, rank, self.incarnation, wire_dtype,
                                   row_dtype if row_dtype != torch.float32 else wire_dtype)
        self.rpc = rpc or ShardRpc(address, self.security,
                                   max(max_chunk_bytes * 2, 64 * 1024 * 1024))
        # The job's proof (worker/checkpoint/run_claim.py), carried by every Register, and the run's
        # checkpoint directory, which the server checks at the first Register.
        if run_secret:
            self.rpc.set_run_secret(run_secret, restore_secret)
        self.checkpoint_dir = checkpoint_dir
        self.server_id = ""
        self.state = "starting"
        self.last_error = ""
        self.newest_pushed = -1
        self._transport: SyncTransport | None = None
        self._broken_since: float | None = None  # broke, with no answer since (_broken)
        self._forget_cut: Callable[[], None] | None = None
        # pushes whose gradients are on their way to the host (worker/runtime/device_copy.py; on
        # the CPU each one is sent at once)
        self.outbox = PushOutbox()
        self._page_seq: dict[str, int] = {}  # per dynamic table: its last Page call
        if restore is not None:
            self.newest_pushed = restore[1]
            self.buffer.start_at(restore[1])

    # -- UpdateSource -------------------------------------------------------------------
    def server_security(self) -> ClientSecurity:
        return self.security

    def start(self) -> None:
        """Register and connect; a failure closes the client (the arena file, the channel)
        before it is raised, whatever the caller does next."""
        try:
            try:
                self.rpc.start()
            except TransportError as exc:
                raise ServerUnavailable(f"rank {self.rank}: {exc.text}") from None
            self._register(first=True, timeout_s=self.timeout_s)
            try:
                self._connect()
            except TransportError as exc:
                self._recover(exc)
        except BaseException:
            self.close()
            raise
        self._forget_cut = faults.on_cut(self.cut_connection)

    def cut_connection(self) -> None:
        """Break the Sync connection (HYBRIDPS_FAULT_CUT): the next send or receive finds
        it broken and recovers (re-Register, reconnect, re-send)."""
        if self._transport is not None:
            self._transport.cut()

    def push(self, step: int, grads: Grads, lr: float | None = None) -> None:
        """UpdateSource.push; `lr` (Push.lr) travels in every message of the step's pushes,
        re-sends included, so the server applies them with it."""
        if self._transport is None:
            raise SyncError(f"rank {self.rank}: the client of shard server {self.address} "
                            f"is {self.state}")
        self.newest_pushed = step
        self.outbox.add(step, grads, lr)  # a GPU's copies to pinned host memory start here
        self._send_ready()

    def poll(self) -> None:
        """UpdateSource.poll: send the pushes whose gradients reached the host."""
        if self._transport is not None:
            self._send_ready()

    def _send_ready(self, through_step: int = -1) -> None:
        """Send, in step order, the pushes whose gradients are on the host, waiting for
        those of steps <= `through_step` (their updates are due)."""
        for step, grads, lr in self.outbox.ready(through_step):
            self._send(step, grads, lr)

    def _send(self, step: int, grads: Grads, lr: float | None) -> None:
        if self._transport is None:
            raise SyncError(f"rank {self.rank}: the client of shard server {self.address} "
                            f"is {self.state}")
        pushes = [(name, self._pending(step, name, grads[name][0], grads[name][1], lr))
                  for name in self.buffer.tables]
        messages = self.ledger.add_step(step, pushes, self.placement.epoch)
        try:
            self._transport.send(messages)
        except TransportError as exc:
            self._recover(exc)  # re-sends every unanswered push, these included

    def take(self, through_step: int) -> tuple[list[RowUpdate], bool]:
        """UpdateSource.take. Updates answered by shared memory view their regions of the
        arena (ids and delta, no copy): valid until the next take, which frees them."""
        waited = self._pump(through_step)
        self.placement.before_take()
        updates, blocked = super().take(through_step)
        self.placement.after_take([(u.step, u.table) for u in updates])
        return updates, blocked or waited

    def peek(self, through_step: int) -> list[RowUpdate]:
        self._pump(through_step)
        return super().peek(through_step)

    def describe_wait(self, step: int, timeout_s: float) -> str:
        missing = ", ".join(self.buffer.missing(step)) or "?"
        text = (f"rank {self.rank}: no update from shard server {self.address} for step {step} "
                f"(tables {missing}) after {timeout_s:g}s; newest step pushed "
                f"{self.newest_pushed}, newest fully answered {self.buffer.arrived_through}, "
                f"connection {self.state}")
        if self.last_error:
            text += f", last error: {self.last_error}"
        return text

    def finish(self, last_step: int) -> None:
        """Flush: the server confirms it applied every push through `last_step`."""
        if last_step < 0 or not self.rpc.running:
            return
        self._send_ready(last_step)
        request = shard_pb2.FlushRequest(run_id=self.run_id, rank=self.rank, step=last_step,
                                         timeout_s=self.timeout_s)
        self._control("Flush", request, self.timeout_s + 5.0,
                      f"Flush through step {last_step}")

    def checkpoint(self, step: int, directory: str, since: int | None = None,
                   deferred: bool = False) -> list[Any]:
        """The server saves this rank's optimizer state once it applied every push <= step
        (Checkpoint RPC, ranks=[rank]); the files it wrote (CheckpointResponse.files).
        `since` S: incremental, the rows changed since its checkpoint of step S.
        `deferred`: it answers (no files) once its copy of the state is taken, and
        `checkpoint_done` waits for the files."""
        self._send_ready(step)
        request = shard_pb2.CheckpointRequest(run_id=self.run_id, step=step,
                                              directory=directory, ranks=[self.rank],
                                              timeout_s=self.timeout_s,
                                              incremental=since is not None,
                                              since_step=-1 if since is None else since,
                                              deferred=deferred)
        response = self._control("Checkpoint", request, self.timeout_s + 60.0,
                                 f"Checkpoint of step {step}")
        return list(response.files)

    def checkpoint_done(self, step: int, directory: str) -> list[Any]:
        """The files of the deferred checkpoint of `step`, once the server made them
        durable (CheckpointDone RPC); a SyncError with the server's when its write failed."""
        request = shard_pb2.CheckpointDoneRequest(run_id=self.run_id, step=step,
                                                  directory=directory, ranks=[self.rank])
        response = self._control("CheckpointDone", request, self.timeout_s + 60.0,
                                 f"CheckpointDone of step {step}")
        return list(response.files)

    def snapshot_to(self, directory: Path, step: int, hold: Hold,
                    since: int | None = None) -> Callable[[], SavedFiles]:
        """UpdateSource.snapshot_to, in two steps: the server copies the partition's state
        at `step` now, before the next push can apply (the rows changed since `since`
        when given), and answers; it writes the copy in the background, and the returned
        write waits until those files are durable (`checkpoint_done`: in the checkpoint's
        job, so with --checkpoint-async the step loop goes on meanwhile). A dynamic
        table's paged-out rows are its `paged/` file."""
        self.checkpoint(step, str(directory), since, deferred=True)

        def files() -> SavedFiles:
            out: SavedFiles = {}
            for f in self.checkpoint_done(step, str(directory)):
                kind = "paged" if f.file.startswith("paged/") else "optim"
                out.setdefault(f.table, {})[kind] = ShardInfo(
                    f.table, f.rank, f.row_start, f.row_end, f.file, f.bytes, f.crc32,
                    f.delta)
            return out

        return files

    def restore_from(self, directory: Path, step: int) -> None:
        """UpdateSource.restore_from: the server loaded the state when this client first
        registered (`restore`); this checks it was the same checkpoint."""
        if self.restore is None or (Path(self.restore[0]), self.restore[1]) != (
                Path(directory), step):
            raise SyncError(f"rank {self.rank}: shard server {self.address} restored "
                            f"{self.restore}, not checkpoint {directory} step {step}: pass "
                            "restore= when creating the client")

    def end_run(self, last_step: int, aborted: bool = False, reason: str = "") -> bool:
        """Finish: this rank is done (after its last Flush, or stopping early). Never
        raises: returns False (and logs) when the server was not told."""
        request = shard_pb2.FinishRequest(run_id=self.run_id, rank=self.rank,
                                          incarnation=self.incarnation, last_step=last_step,
                                          aborted=aborted, reason=reason)
        try:
            response = self.rpc.call_any("Finish", request, min(self.timeout_s, 10.0))
        except TransportError as exc:  # best effort: the run's outcome does not depend on it
            log.warning(kv("finish_failed", server=self.address, last_step=last_step,
                           aborted=aborted, error=exc.text))
            return False
        log.info(kv("finished", server=self.address, last_step=last_step, aborted=aborted,
                    reason=reason or "-",
                    ranks_finished=f"{response.ranks_finished}/{response.ranks_registered}",
                    server_stopping=response.server_stopping))
        return True

    def close(self) -> None:
        if self._forget_cut is not None:
            self._forget_cut()
        self.outbox.clear()
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.close()
        self.state = "closed"
        self.rpc.close(min(self.timeout_s, 10.0))
        self.placement.close()

    # -- dynamic tables: the RowPager of worker/embedding/dynamic/ids.py (the Page RPC) ---
    def page(self, table: str, step: int, out: PagedOut, out_slots: torch.Tensor,
             in_ids: torch.Tensor, in_slots: torch.Tensor, expire_steps: int,
             counters: Mapping[str, int] | None = None
             ) -> tuple[torch.Tensor, PagedOut, np.ndarray]:
        """The node's server pages `out` out and `in_ids` in (shard.proto PageRequest);
        retried with the same sequence number until answered (the server applies it once)."""
        seq = self._page_seq.get(table, 0) + 1
        request = shard_pb2.PageRequest(run_id=self.run_id, rank=self.rank,
                                        incarnation=self.incarnation, table=table, step=step,
                                        seq=seq, expire_steps=expire_steps)
        for field, t in (("out_ids", out.ids), ("out_slots", out_slots),
                         ("out_rows", out.rows.reshape(-1, self.dims[table]).float()),
                         ("out_seen", out.seen), ("out_freq", out.freq), ("in_ids", in_ids),
                         ("in_slots", in_slots)):
            wire.encode(t, getattr(request, field))
        if counters:
            request.counters.CopyFrom(shard_pb2.DynamicCounters(**counters))
        response = self._page_call(request, f"Page of table {table!r} at step {step}")
        self._page_seq[table] = seq
        found = wire.decode(response.found, "found").clone().to(torch.bool)
        got = PagedOut(in_ids[found], wire.decode(response.rows, "rows").clone(), {},
                       wire.decode(response.seen, "seen").clone(),
                       wire.decode(response.freq, "freq").clone())
        return found, got, wire.decode(response.dropped, "dropped").numpy().copy()

    def peek_paged(self, table: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        request = shard_pb2.PageRequest(run_id=self.run_id, rank=self.rank,
                                        incarnation=self.incarnation, table=table, peek=True)
        wire.encode(ids, request.in_ids)
        response = self._page_call(request, f"read of paged rows of table {table!r}")
        found = wire.decode(response.found, "found").clone().to(torch.bool)
        return found, wire.decode(response.rows, "rows").clone()

    def local_store(self, table: str) -> None:
        """None: the store is the server's (RowPager)."""
        return None

    def _page_call(self, request: shard_pb2.PageRequest, what: str) -> Any:
        """One Page call, retried on a broken connection within --ps-timeout."""
        deadline = time.monotonic() + self.timeout_s
        delay = BACKOFF_START_S
        while True:
            try:
                return self.rpc.call("Page", request, self.timeout_s)
            except TransportError as exc:
                if isinstance(exc, TransportShutdown):  # the stream's line: stop at once
                    self._note(exc)
                left = deadline - time.monotonic()
                if not isinstance(exc, TransportRetryable) or left <= 0:
                    kind = ServerTimeout if exc.code == "DEADLINE_EXCEEDED" else ServerRefused
                    raise kind(f"rank {self.rank}: {what} on shard server {self.address} "
                               f"failed: {exc.text}") from None
                self.last_error = exc.text
                time.sleep(min(delay, left))
                delay = min(delay * 2, BACKOFF_MAX_S)

    # -- sending and receiving ----------------------------------------------------------
    def _pending(self, step: int, name: str, ids_U: torch.Tensor,
                 grads_UD: torch.Tensor, lr: float | None) -> Pending:
        """The push by reference into the arena, else its inline messages."""
        self.stats.pushes += self.tables_in.get(name, 1)
        self.stats.unit_pushes += 1
        self.stats.push_rows += int(ids_U.numel())
        slot = self.placement.place(ids_U, grads_UD, self.wire_dtype, self.encoder.answer_dtype,
                                    f"step {step} table {name!r}")
        if slot is not None:
            self.stats.shm_pushes += self.tables_in.get(name, 1)
            self.stats.shm_bytes += slot.tensor_bytes
            return self.encoder.by_reference(step, name, slot, lr)
        if self.placement.epoch:
            self.stats.shm_inline_pushes += self.tables_in.get(name, 1)
        return self._inline(step, name, ids_U, grads_UD, lr)

    def _inline(self, step: int, name: str, ids_U: torch.Tensor,
                grads_UD: torch.Tensor, lr: float | None) -> InlinePush:
        """Encoded by the transport (the gRPC stream: on its loop thread), once."""
        return InlinePush(lambda: self.encoder.inline(step, name, ids_U, grads_UD,
                                                      self.max_chunk_bytes, lr),
                          self._count_encoded)

    def _count_encoded(self, messages: list[bytes]) -> None:
        self.stats.push_chunks += len(messages)
        self.stats.push_bytes += sum(len(m) for m in messages)

    def _pump(self, through_step: int) -> bool:
        """Read answers until every update through `through_step` arrived; True if it had
        to wait for one (what already arrived is read without waiting first, so the
        staleness stats count real waits, not reads)."""
        self._send_ready(through_step)
        deadline: float | None = None
        waited = False
        while self.buffer.arrived_through < through_step:
            if self._transport is None:
                raise SyncError(f"rank {self.rank}: the client of shard server "
                                f"{self.address} is {self.state}")
            now = time.monotonic()
            if deadline is None:
                deadline, wait_s = now + self.timeout_s, 0.0
            elif now >= deadline:
                raise ServerTimeout(self.describe_wait(self.buffer.arrived_through + 1,
                                                       self.timeout_s))
            else:
                waited, wait_s = True, deadline - now
            try:
                for response in self._transport.receive(wait_s):
                    for update, slot in self.ledger.on_response(response):
                        if slot is not None:
                            self.placement.answered(update.step, update.table, slot)
                        self.buffer.put(update)
            except TransportError as exc:
                self._recover(exc)
        return waited

    def _connect(self) -> None:
        """Open the gRPC Sync stream (bound to the partition Register answered)."""
        self._transport = self.rpc.open_stream()
        self.stats.transport, self.state = "stream", "streaming"

    def _recover(self, exc: TransportError) -> None:
        """The connection broke: re-Register (backoff, up to --ps-timeout from the last
        answer), reconnect, re-send every unanswered push. A refusal is raised naming the
        server."""
        while True:
            self._note(exc)
            broken, self._transport = self._transport, None
            if broken is not None:
                broken.close()
            since = self._broken(broken.name if broken is not None else "none")
            self._reregister(since)
            try:
                self._connect()
                assert self._transport is not None
                self._transport.send(self.ledger.resend(self.placement.epoch))
                return
            except TransportError as again:
                exc = again

    def _note(self, exc: TransportError) -> None:
        """Note the error; a refusal (not worth a retry) is raised naming the server, and
        so is a server that said it is shutting down (no use waiting --ps-timeout)."""
        self.last_error = exc.text
        if isinstance(exc, TransportRefused):
            raise ServerRefused(self._refusal_text(exc)) from None
        if isinstance(exc, TransportShutdown):
            raise ServerUnavailable(
                f"rank {self.rank}: shard server {self.address} is shutting down, and the "
                f"optimizer state of run {self.run_id!r} goes with it ({self._unanswered()}): "
                "stopping now instead of waiting --ps-timeout; restart the server and "
                "resume from the last checkpoint (--resume; torchrun --max-restarts "
                "does it)") from None

    def _unanswered(self) -> str:
        first = self.ledger.oldest_step()
        return (f"{len(self.ledger)} pushes unanswered"
                + (f" from step {first}" if first is not None else ""))

    def _broken(self, transport: str) -> float:
        """Count and log a broken connection; returns when it broke: the re-Register
        deadline runs from the last answer, not from each of several breaks in a row."""
        if self.ledger.take_progress() or self._broken_since is None:
            self._broken_since = time.monotonic()
        self.stats.reconnects += 1
        log.warning(kv("reconnect", server=self.address, error=self.last_error,
                       unanswered=len(self.ledger), transport=transport))
        return self._broken_since

    def _reregister(self, broken_since: float) -> None:
        """Backoff + re-Register until it works, or ServerUnavailable past the deadline:
        --ps-timeout, or STOP_RECONNECT_S once the rank was told to stop (SIGTERM: the
        launcher's kill follows; waiting for a restarted server is no use then)."""
        self.state = "reconnecting"
        delay = BACKOFF_START_S
        stop_at: float | None = None
        while True:
            now = time.monotonic()
            if STOP.requested and stop_at is None:
                stop_at = now + STOP_RECONNECT_S
            left = broken_since + self.timeout_s - now
            if stop_at is not None and stop_at - now < left:
                left = stop_at - now
                why, then = (f"told to stop ({STOP.reason}) while shard server "
                             f"{self.address} is unreachable",
                             ": resume from the last checkpoint (--resume)")
            else:
                why, then = (f"shard server {self.address} unreachable for "
                             f"{self.timeout_s:g}s", "")
            if left <= 0:
                raise ServerUnavailable(f"rank {self.rank}: {why} (last error: "
                                        f"{self.last_error}); {self._unanswered()}{then}")
            time.sleep(min(delay, left))
            delay = min(delay * 2, BACKOFF_MAX_S)
            try:
                self._register(first=False, timeout_s=max(min(left, 10.0), 0.1))
                return
            except TransportError as exc:
                self._note(exc)

    def _refusal_text(self, exc: TransportError) -> str:
        step = self.ledger.oldest_step()
        step = self.newest_pushed if step is None else step
        when = f"around step {step}" if step >= 0 else "before its first step"
        text = (f"rank {self.rank}: shard server {self.address} refused run {self.run_id!r} "
                f"({when}): {exc.text}")
        if self.wire_dtype == torch.float16 and "non-finite" in text:
            text += (" (--wire-dtype fp16: gradients beyond +-65504 become inf on the wire; "
                     "use bf16 or fp32)")
        return text

    # -- control calls --------------------------------------------------------------------
    def _control(self, method: str, request: Any, timeout_s: float, what: str) -> Any:
        try:
            return self.rpc.call(method, request, timeout_s)
        except TransportError as exc:
            kind = ServerTimeout if exc.code == "DEADLINE_EXCEEDED" else SyncError
            raise kind(f"rank {self.rank}: {what} on shard server {self.address} failed: "
                       f"{exc.text}") from None

    def _register(self, *, first: bool, timeout_s: float) -> None:
        """Register (then seed the master rows of a created bf16 partition). On the first
        one every failure is a SyncError; later ones raise TransportErrors to retry."""
        request = shard_pb2.RegisterRequest(
            run_id=self.run_id, rank=self.rank, world_size=self.world_size,
            incarnation=self.incarnation, tables=self.table_specs,
            optimizer=optimizer_message(self.optimizer),
            row_dtype=wire.wire_dtype(self.row_dtype))  # type: ignore[arg-type]
        if first and self.restore is not None:
            request.restore.directory, request.restore.step = self.restore
        request.checkpoint_dir = self.checkpoint_dir
        offer = self.placement.offer(first)
        if offer is not None:
            request.shm.CopyFrom(offer)
        try:
            if first:  # fails fast where nothing answers (worker/sync/connect.py)
                response = call_until_connected(
                    lambda left: self.rpc.call("Register", request, left),
                    address=self.address, rank=self.rank, timeout_s=timeout_s,
                    window_s=connect_window_s(timeout_s))
            else:
                response = self.rpc.call("Register", request, timeout_s)
        except TransportError as exc:
            if not first:
                raise
            if exc.code == "DEADLINE_EXCEEDED":
                raise ServerTimeout(f"rank {self.rank}: could not register with shard server "
                                    f"{self.address} within {self.timeout_s:g}s "
                                    f"({exc.text})") from None
            raise ServerRefused(self._refusal_text(exc)) from None
        self.stats.registers += 1
        self.server_id = response.server_id
        self.rpc.bind_partition(self.run_id, self.rank, response.partition_secret)
        if response.max_message_bytes > 0:
            self.max_chunk_bytes = min(self.max_chunk_bytes, int(response.max_message_bytes))
        self.ledger.check_registered(response.tables, first, self.run_id)
        accepted = offer is not None and self.placement.accept(response.shm, first)
        if offer is not None and not accepted and not first:
            self.ledger.demote(self._inline)  # the server lost the arena: re-send inline
        self.stats.shm = self.placement.status
        if self.row_dtype != torch.float32:
            self._seed_master(response, first)

    def _seed_master(self, response: shard_pb2.RegisterResponse, first: bool) -> None:
        """Upload the fp32 initial rows into the server's master copy of a new partition.

        Only a partition this Register created needs it, and not one restored from a
        checkpoint (the server loaded its master). check_registered already refused a
        re-Register that found the state lost after pushes, so a created partition here
        has seen no push and the initial rows are still the rows' master.
        """
        assert self.initial_rows is not None
        if wire.torch_dtype(response.row_dtype) != self.row_dtype:
            raise ServerRefused(
                f"rank {self.rank}: shard server {self.address} registered row dtype "
                f"{wire.dtype_name(response.row_dtype)}, not {self.row_dtype}: it keeps no fp32 "
                "master rows (use --row-dtype fp32)")
        if first and self.restore is not None:
            return
        for table in response.tables:
            if table.created:
                self._seed_table(table, first)
        log.info(kv("master_seeded", server=self.address,
                    tables=",".join(t.name for t in response.tables if t.created)))

    def _seed_table(self, table: shard_pb2.TableState, first: bool) -> None:
        assert self.initial_rows is not None
        per_chunk = wire.rows_per_chunk(self.dims[table.name], self.max_chunk_bytes)
        seeded = 0
        for start, block_RD in self.initial_rows(table.name):
            for lo, hi in wire.chunk_bounds(int(block_RD.shape[0]), per_chunk):
                request = shard_pb2.SeedRowsRequest(
                    run_id=self.run_id, rank=self.rank, incarnation=self.incarnation,
                    table=table.name, row_start=start + lo)
                wire.encode(block_RD[lo:hi], request.rows)
                try:
                    reply = self.rpc.call("SeedRows", request, self.timeout_s)
                except TransportError as exc:
                    if isinstance(exc, TransportRetryable) and not first:
                        raise  # the reconnect loop registers (and seeds) again
                    raise ServerRefused(f"rank {self.rank}: seeding the master rows of "
                                        f"table {table.name!r} on shard server "
                                        f"{self.address} failed: {exc.text}") from None
                seeded = int(reply.rows_seeded)
        if seeded != table.rows_held:
            raise ServerRefused(f"rank {self.rank}: shard server {self.address} seeded "
                                f"{seeded} of the {table.rows_held} master rows of table "
                                f"{table.name!r}")
