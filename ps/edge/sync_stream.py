"""One Sync stream (its gRPC plumbing: ps/edge/service.py): decode each message, feed its
chunks to the core in order, and encode the answers; no transport here."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hybridps import wire
from hybridps.errors import (
    BadShmReference,
    InvalidArgument,
    NotRegistered,
    StaleShmEpoch,
    WrongSecret,
)
from hybridps.v1 import shard_pb2
from ps.core.lifecycle import RunTracker
from ps.core.partition_auth import Binding
from ps.core.push import Answer, PushChunk
from ps.core.shard_core import ShardCore
from ps.core.store import kv
from ps.edge.arena_server import ArenaRegistry, ResolvedShmPush
from ps.edge.status import refusal_reason
from ps.edge.sync_codec import (
    WirePushChunk,
    batch_message,
    encode_answer,
    request_chunks,
    request_owner,
    shm_update,
    update_message,
)

log = logging.getLogger("ps.service")

MIN_ANSWER_MESSAGE_BYTES = 1 << 20


@dataclass
class BatchPushes:
    """A PushBatch's entries, answered together: fed in one hop to the update pool
    (ShardCore.feed_all) and answered in one UpdateBatch."""

    entries: list[WirePushChunk]


# What `decode` hands on, one `answer` each: a push (or a chunk of one), or a batch.
StreamItem = PushChunk | BatchPushes


class StreamHost(Protocol):
    """What a stream needs of the servicer that runs it (ps/edge/service.py ShardServicer)."""

    core: ShardCore
    shm_arenas: ArenaRegistry | None
    max_message_bytes: int
    tracker: RunTracker

    def stream_closed(self, run_id: str, rank: int) -> None: ...


class SyncStream:
    """`decode` each message as it arrives (a refused one is recorded and raises), then
    `answer` its chunks in order: the encoded SyncResponse messages to send back. `close`
    once, at the end. On an error, `fields()` names the push it happened in, for the log.

    A stream is bound to one partition (`binding`, made by Store.bind when the connection
    opened with the partition's secret): a message naming another (run, rank), or arriving
    after the partition was registered anew, is refused (WrongSecret) before anything of
    it is read.
    """

    def __init__(self, host: StreamHost, binding: Binding) -> None:
        self._host = host
        self._core = host.core
        self.binding = binding
        self.session = self._core.open_session()
        self._current: PushChunk | None = None
        self._push_message_bytes = 0  # the largest message of the push being received
        self._stream_of: tuple[str, int] | None = None  # (run, rank), once a push was accepted

    def decode(self, framed: wire.Framed[shard_pb2.SyncRequest]) -> list[StreamItem]:
        store = self._core.store
        try:
            if framed.error is None:
                self._check_bound(framed)
            chunks = request_chunks(framed, self._host.shm_arenas, store)
        except (wire.WireError, BadShmReference, StaleShmEpoch, WrongSecret,
                NotRegistered, InvalidArgument) as exc:
            store.record_refusal(refusal_reason(exc), *request_owner(framed))
            raise
        for chunk in chunks:
            self.session.received(chunk)
        if framed.message.WhichOneof("kind") == "batch":
            return [BatchPushes(chunks)]
        return list(chunks)

    def _check_bound(self, framed: wire.Framed[shard_pb2.SyncRequest]) -> None:
        """The message's push (a batch's first entry: request_chunks refuses a batch with
        an entry of another partition) is of the partition this connection is bound to,
        still registered as it was: WrongSecret otherwise."""
        if framed.message.WhichOneof("kind") is not None:
            run_id, rank, _ = request_owner(framed)
            self._core.store.check_bound(self.binding, run_id, rank, "push")

    async def answer(self, item: StreamItem) -> list[bytes]:
        """The encoded SyncResponses of one decoded item (none for a chunk that does not
        complete its push)."""
        if isinstance(item, BatchPushes):
            return await self._answer_batch(item.entries)
        chunk = item
        self._current = chunk
        if isinstance(chunk, WirePushChunk):
            self._push_message_bytes = max(self._push_message_bytes, chunk.message_bytes)
        answer = await self._core.feed(self.session, chunk)
        self._opened(chunk)
        if answer is None:
            return []
        self._log_answer(chunk, answer)
        in_shm = (shm_update(chunk.sink, answer)
                  if isinstance(chunk.sink, ResolvedShmPush) else None)
        if in_shm is not None:
            return [update_message(in_shm)]
        delta_dtype = chunk.update_dtype if isinstance(chunk, WirePushChunk) else torch.float32
        # Encoding copies the answer (and converts a bf16/fp16 delta): in the update pool,
        # where the copy runs without the GIL, not on the event loop. Answer in messages
        # as large as the push's (the client's --max-chunk-bytes): gRPC moves messages of
        # a few MiB fastest, and an answer of one message of tens of MiB is a fresh mmap,
        # page faults included, every time. (+1 KiB: rows_per_chunk leaves that much for
        # the header fields; a push of unknown size gets the server's limit.)
        limit_bytes = self._host.max_message_bytes
        if self._push_message_bytes:
            limit_bytes = min(limit_bytes, max(self._push_message_bytes + 1024,
                                               MIN_ANSWER_MESSAGE_BYTES))
        self._push_message_bytes = 0
        return await self._core.offload(encode_answer, answer, limit_bytes, delta_dtype)

    async def _answer_batch(self, entries: list[WirePushChunk]) -> list[bytes]:
        """Every entry is a whole shared-memory push (request_chunks checked): applied in
        order in one hop, answered in one message, in the batch's order."""
        self._current = entries[0]
        answers = await self._core.feed_all(self.session, entries)
        self._opened(entries[0])
        updates = []
        for chunk, answer in zip(entries, answers, strict=True):
            if answer is not None and isinstance(chunk.sink, ResolvedShmPush):
                self._log_answer(chunk, answer)
                updates.append(shm_update(chunk.sink, answer))
        return [batch_message(updates)] if updates else []

    def _opened(self, chunk: PushChunk) -> None:
        if self._stream_of is None:  # the first push accepted: the stream counts as open
            self._stream_of = (chunk.run_id, chunk.rank)
            self._host.tracker.stream_opened(*self._stream_of)

    @staticmethod
    def _log_answer(chunk: PushChunk, answer: Answer) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug(kv("answered", run=chunk.run_id, rank=chunk.rank, step=answer.step,
                         table=answer.table, rows=int(answer.ids.shape[0]),
                         duplicate=answer.duplicate))

    def fields(self) -> dict[str, Any]:
        chunk = self._current
        if chunk is None:
            return {}
        return {"run": chunk.run_id, "rank": chunk.rank, "step": chunk.step,
                "table": chunk.table}

    def close(self) -> None:
        self.session.close()
        self._core.store.unbind(self.binding)
        if self._stream_of is not None:
            self._host.stream_closed(*self._stream_of)
