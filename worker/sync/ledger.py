"""Exactly-once bookkeeping of one rank's pushes: no I/O, one owner thread.

Every push stays *unanswered* from the moment it is handed to a transport until its
whole answer arrived: after a reconnect every unanswered push is sent again, as the
same bytes (an inline push keeps its encoded messages; a push by reference keeps its
region and is stamped with the new arena epoch), and the server, which dedupes by
(run, rank, incarnation, step, table), answers one it already applied from its cache.
An answer to a push that is not unanswered (a second answer to a re-sent push) is
ignored. Chunks of an inline answer are collected per push and must come in order; a
reconnect drops the partial ones (the re-sent push is answered whole again).

A re-Register answers where the server's state is; `check_registered` refuses to go on
when that is not where this rank left it (the server restarted and lost the state).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from hybridps import wire
from hybridps.v1 import shard_pb2
from worker.sync.arena import PlacedShmPush, ShmSlot
from worker.sync.messages import InlinePush, Outgoing, placed_message
from worker.sync.transport import Response
from worker.updates.source import RowUpdate, ServerRefused, SyncStats

# An unanswered push: its inline messages (encoded once), or its placement in the arena.
Pending = InlinePush | PlacedShmPush
Key = tuple[int, int]  # (step, table index)


class SyncLedger:
    def __init__(self, tables: Sequence[str], dims: dict[str, int], row_dtype: torch.dtype,
                 stats: SyncStats, who: str, resumed_step: int = -1,
                 tables_in: Mapping[str, int] | None = None) -> None:
        """`who` names the rank and server in errors; `resumed_step`: the step a resumed
        run restored (-1: a fresh run); `tables_in`: the tables a group carries (the stats
        count tables' updates)."""
        self.tables = list(tables)
        self.tables_in = tables_in or {}
        self.table_index = {name: i for i, name in enumerate(self.tables)}
        self.dims = dims
        self.rows_answered = row_dtype != torch.float32  # bf16 rows: answers are rows
        self.row_dtype = row_dtype
        self.stats = stats
        self.who = who
        self.resumed_step = resumed_step
        self.pushed_through = resumed_step  # the newest step recorded
        self.unanswered: dict[Key, Pending] = {}
        self._partial: dict[Key, list[Response]] = {}
        self.progress = False  # an answer arrived (take_progress clears it)

    def __len__(self) -> int:
        return len(self.unanswered)

    def take_progress(self) -> bool:
        """Whether an answer arrived since the last call."""
        progressed, self.progress = self.progress, False
        return progressed

    def oldest_step(self) -> int | None:
        return min(self.unanswered)[0] if self.unanswered else None

    # -- pushes -------------------------------------------------------------------------
    def add_step(self, step: int, pushes: Sequence[tuple[str, Pending]],
                 epoch: int) -> list[Outgoing]:
        """Record the step's pushes as unanswered; what sends them (the by-reference ones
        of several tables in one batch message, counted here; inline ones are counted
        when encoded)."""
        self.pushed_through = max(self.pushed_through, step)
        messages: list[Outgoing] = []
        placed: list[PlacedShmPush] = []
        tables_placed = 0  # tables whose pushes go by reference (a group's: each of its)
        for table, pending in pushes:
            self.unanswered[(step, self.table_index[table])] = pending
            if isinstance(pending, PlacedShmPush):
                placed.append(pending)
                tables_placed += self.tables_in.get(table, 1)
            else:
                messages.append(pending)
        if placed:
            message = placed_message(placed, epoch)
            messages.append(message)
            self.stats.shm_batches += tables_placed > 1
            self.stats.push_chunks += 1
            self.stats.push_bytes += len(message)
        return messages

    def resend(self, epoch: int) -> list[Outgoing]:
        """Every unanswered push's messages, in (step, table) order, for a new connection
        (by reference: stamped with `epoch`, the arena epoch of the latest Register).
        Partial answers are dropped: the server answers each push whole again."""
        self._partial.clear()
        messages: list[Outgoing] = []
        for key in sorted(self.unanswered):
            pending = self.unanswered[key]
            if isinstance(pending, PlacedShmPush):
                messages.append(placed_message([pending], epoch))
            else:
                messages.append(pending)
        return messages

    def demote(self, encode: Callable[[int, str, torch.Tensor, torch.Tensor, float | None],
                                      InlinePush]) -> None:
        """The server no longer holds the arena: every push by reference goes inline
        (with the lr it was sent with, Push.lr)."""
        for (step, index), pending in list(self.unanswered.items()):
            if isinstance(pending, PlacedShmPush):
                slot, head = pending.slot, pending.head
                lr = head.lr if head.HasField("lr") else None
                self.unanswered[(step, index)] = encode(step, self.tables[index], slot.ids,
                                                        slot.grads, lr)

    # -- answers ------------------------------------------------------------------------
    def on_response(self, framed: Response) -> list[tuple[RowUpdate, ShmSlot | None]]:
        """The complete updates a response brings (with their region, for one answered in
        the arena); ServerRefused for a response that breaks the protocol."""
        if framed.error is not None:
            raise ServerRefused(f"{self.who} sent an update that does not decode: "
                                f"{framed.error}")
        response = framed.message
        kind = response.WhichOneof("kind")
        if kind == "batch":
            out = []
            for update in response.batch.updates:
                key = self._answered_key(update)
                if key is not None:
                    out.append(self._shm_answer(key, update))
            return out
        if kind != "update":
            raise ServerRefused(f"{self.who} sent a response with neither an update nor a "
                                "batch")
        update = response.update
        key = self._answered_key(update)
        if key is None:
            return []
        if update.WhichOneof("data") == "shm" or isinstance(self.unanswered[key], PlacedShmPush):
            return [self._shm_answer(key, update)]
        return self._inline_answer(key, update, framed)

    def _answered_key(self, update: shard_pb2.Update) -> Key | None:
        """(step, table index) of the unanswered push `update` answers; None: one we
        already have the answer of (a re-sent push)."""
        index = self.table_index.get(update.table)
        if index is None:
            raise ServerRefused(f"{self.who} sent an update for unknown table "
                                f"{update.table!r} (step {update.step})")
        key = (update.step, index)
        if key not in self.unanswered:
            self.stats.ignored_updates += 1
            return None
        return key

    def _what(self, update: shard_pb2.Update) -> str:
        return f"{self.who}: update step {update.step} table {update.table!r}"

    def _check_rows(self, update: shard_pb2.Update) -> None:
        if update.rows != self.rows_answered:
            raise ServerRefused(f"{self._what(update)}: the server answered "
                                f"{'rows' if update.rows else 'a delta'} but this rank keeps "
                                f"{self.row_dtype} rows")

    def _answered(self, key: Key, update: shard_pb2.Update) -> None:
        del self.unanswered[key]
        self.progress = True
        self.stats.updates += self.tables_in.get(self.tables[key[1]], 1)
        self.stats.unit_updates += 1
        self.stats.duplicates += int(update.duplicate)

    def _shm_answer(self, key: Key, update: shard_pb2.Update
                    ) -> tuple[RowUpdate, ShmSlot | None]:
        pending = self.unanswered[key]
        got = update.WhichOneof("data")
        if not (isinstance(pending, PlacedShmPush) and got == "shm"):
            sent = "by shared memory" if isinstance(pending, PlacedShmPush) else "inline"
            raise ServerRefused(f"{self._what(update)}: a push sent {sent} was answered "
                                f"{'by shared memory' if got == 'shm' else 'inline'}")
        self._check_rows(update)
        slot = pending.slot
        delta_UD = slot.answer
        if not update.rows and delta_UD.dtype in (torch.bfloat16, torch.float16):
            delta_UD = delta_UD.float()  # --wire-dtype: deltas are applied in fp32
        self._answered(key, update)
        self.stats.update_chunks += 1
        return (RowUpdate(update.step, update.table, slot.ids, delta_UD, float(update.decay),
                          update.duplicate, update.rows), slot)

    def _inline_answer(self, key: Key, update: shard_pb2.Update, framed: Response
                       ) -> list[tuple[RowUpdate, ShmSlot | None]]:
        what = self._what(update)
        if update.WhichOneof("data") != "chunk":
            raise ServerRefused(f"{what}: neither inline nor by shared memory")
        parts = self._partial.setdefault(key, [])
        chunk = update.chunk
        if chunk.index != len(parts):
            raise ServerRefused(f"{what}: chunk {chunk.index} arrived, expected {len(parts)}")
        parts.append(framed)
        self.stats.update_chunks += 1
        if len(parts) < max(chunk.count, 1):
            return []
        del self._partial[key]
        try:
            ids = [p.tensor("ids", what) for p in parts]
            deltas = [p.tensor("delta", what) for p in parts]
        except wire.WireError as exc:
            raise ServerRefused(str(exc)) from None
        # One chunk: the tensors view the received bytes (read-only, kept alive by the
        # views); every consumer of a RowUpdate only reads them, so no copy is made.
        ids_U = torch.cat(ids) if len(ids) > 1 else ids[0]
        delta_UD = torch.cat(deltas) if len(deltas) > 1 else deltas[0]
        if not update.rows and delta_UD.dtype in (torch.bfloat16, torch.float16):
            delta_UD = delta_UD.float()  # --wire-dtype: deltas are applied in fp32
        dim = self.dims[update.table]
        if ids_U.dim() != 1 or delta_UD.shape != (ids_U.shape[0], dim):
            raise ServerRefused(f"{what}: ids {list(ids_U.shape)} and delta "
                                f"{list(delta_UD.shape)} do not fit a table of dim {dim}")
        self._check_rows(update)
        self._answered(key, update)
        return [(RowUpdate(update.step, update.table, ids_U, delta_UD, float(update.decay),
                           update.duplicate, update.rows), None)]

    # -- Register -----------------------------------------------------------------------
    def check_registered(self, tables: Sequence[shard_pb2.TableState], first: bool,
                         run_id: str) -> None:
        """The server's optimizer state must be where this rank left it: at the resumed
        step on the first Register, no further back than the oldest unanswered push on a
        later one (and not created anew once anything was pushed)."""
        for table in tables:
            if first and table.last_step != self.resumed_step:
                raise ServerRefused(
                    f"{self.who} already holds optimizer state of run {run_id!r} (table "
                    f"{table.name!r} applied through step {table.last_step}); this worker "
                    "starts at step 0 and cannot resume: use a fresh --run-id")
            if first:
                continue
            index = self.table_index.get(table.name)
            pending = [s for (s, i) in self.unanswered if i == index]
            oldest = min(pending) if pending else self.pushed_through + 1
            if (table.created and self.pushed_through >= 0) or table.last_step < oldest - 1:
                raise ServerRefused(
                    f"{self.who} lost the optimizer state of run {run_id!r} table "
                    f"{table.name!r} (server says last step {table.last_step}, "
                    f"created={table.created}; this worker has answers through step "
                    f"{oldest - 1}): was it restarted?")
