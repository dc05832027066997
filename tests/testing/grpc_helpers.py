"""Client-side helpers for tests that talk to a real shard server."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import grpc
import torch

from hybridps import wire
from hybridps.channel_options import channel_options
from hybridps.partition_secret import (
    SECRET_HEADER,
    partition_metadata,
    run_secret_metadata,
)
from hybridps.v1 import shard_pb2, shard_pb2_grpc

ADAM = shard_pb2.OptimizerConfig(kind=shard_pb2.OptimizerConfig.ADAM, lr=0.05, beta1=0.9,
                                 beta2=0.999, eps=1e-8)


# (address, run_id, rank) -> the partition secret the latest Register through a channel of
# `open_channel` answered; the channel attaches it to later calls (as the worker does).
SECRETS: dict[tuple[str, str, int], str] = {}


def open_channel(address: str, max_message_bytes: int | None = None, *,
                 carry_secrets: bool = True) -> grpc.Channel:
    """A channel to a test server; with `carry_secrets` its calls carry the partition
    secret that Register answered (like the worker), unless given metadata already does."""
    options = channel_options() if max_message_bytes is None else channel_options(
        max_message_bytes)
    channel = grpc.insecure_channel(address, options=options)
    grpc.channel_ready_future(channel).result(timeout=30)
    if not carry_secrets:
        return channel
    return grpc.intercept_channel(channel, SecretCarrier(address))


def secret_metadata(address: str, run_id: str, rank: int) -> tuple[tuple[str, str], ...]:
    """The metadata carrying (run_id, rank)'s secret from the latest Register (none: ())."""
    secret = SECRETS.get((address, run_id, rank), "")
    return partition_metadata(run_id, rank, secret)


class SecretCarrier(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Remembers the secret of every Register answered, and attaches it to the calls that
    name that partition (a Sync stream: the partition its first message pushes to)."""

    def __init__(self, address: str) -> None:
        self.address = address

    def _owner(self, method: str, request: Any) -> tuple[str, int] | None:
        if not hasattr(request, "run_id"):  # raw bytes: sent as they are
            return None
        name = method.rsplit("/", 1)[-1]
        if name in ("Register", "SeedRows", "Finish", "Flush"):
            rank = request.rank
        elif name in ("Checkpoint", "CheckpointDone"):
            rank = request.ranks[0] if request.ranks else -1
        else:
            return None
        if rank < 0:  # any rank of the run: the secret of one of them
            ranks = sorted(r for (a, run, r) in SECRETS if a == self.address
                           and run == request.run_id)
            rank = ranks[0] if ranks else 0
        return request.run_id, rank

    def _details(self, details: Any, owner: tuple[str, int] | None) -> Any:
        metadata = list(details.metadata or ())
        if owner is None or any(k == SECRET_HEADER for k, _ in metadata):
            return details
        metadata += secret_metadata(self.address, *owner)
        return details._replace(metadata=metadata)

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any,
                              request: Any) -> Any:
        details = self._details(client_call_details,
                                self._owner(client_call_details.method, request))
        outcome = continuation(details, request)
        if isinstance(request, shard_pb2.RegisterRequest) and outcome.exception() is None:
            SECRETS[(self.address, request.run_id, request.rank)] = \
                outcome.result().partition_secret
        return outcome

    def intercept_stream_stream(self, continuation: Any, client_call_details: Any,
                                request_iterator: Any) -> Any:
        if not client_call_details.method.endswith("/Sync"):
            return continuation(client_call_details, request_iterator)
        requests = iter(request_iterator)
        first = next(requests, None)  # the partition the stream pushes to
        owner = None
        if first is not None:
            push = first.batch.pushes[0] if first.HasField("batch") and first.batch.pushes \
                else first.push
            owner = (push.run_id, push.rank)
        chained = itertools.chain([first], requests) if first is not None else iter(())
        return continuation(self._details(client_call_details, owner), chained)


def shard_stub(channel: grpc.Channel) -> shard_pb2_grpc.ShardServiceStub:
    return shard_pb2_grpc.ShardServiceStub(channel)


def table(name: str, num_rows: int, dim: int, row_start: int, row_end: int
          ) -> shard_pb2.TableSpec:
    return shard_pb2.TableSpec(name=name, num_rows=num_rows, dim=dim, row_start=row_start,
                               row_end=row_end)


def register(stub: shard_pb2_grpc.ShardServiceStub, run_id: str,
             tables: Sequence[shard_pb2.TableSpec], *, rank: int = 0, world_size: int = 1,
             incarnation: int = 0,
             optimizer: shard_pb2.OptimizerConfig = ADAM, run_secret: str = "",
             checkpoint_dir: str = "") -> shard_pb2.RegisterResponse:
    """A Register; `run_secret` (hybridps/run_secret.py) travels in its metadata."""
    return stub.Register(shard_pb2.RegisterRequest(
        run_id=run_id, rank=rank, world_size=world_size, incarnation=incarnation,
        tables=list(tables), optimizer=optimizer, checkpoint_dir=checkpoint_dir), timeout=30,
        metadata=run_secret_metadata(run_secret))


def push_messages(run_id: str, step: int, table_name: str, ids: torch.Tensor,
                  grads: torch.Tensor, *, rank: int = 0, incarnation: int = 0,
                  max_message_bytes: int | None = None) -> list[shard_pb2.SyncRequest]:
    """One push, split into chunks by rows when max_message_bytes is given."""
    n = int(ids.shape[0])
    per = n or 1
    if max_message_bytes is not None:
        per = wire.rows_per_chunk(int(grads.shape[1]), max_message_bytes)
    bounds = list(wire.chunk_bounds(n, per))
    out = []
    for i, (s, e) in enumerate(bounds):
        msg = shard_pb2.Push(run_id=run_id, rank=rank, incarnation=incarnation, step=step,
                             table=table_name,
                             chunk=shard_pb2.InlineChunk(index=i, count=len(bounds)))
        wire.encode(ids[s:e], msg.chunk.ids)
        wire.encode(grads[s:e], msg.chunk.grads)
        out.append(shard_pb2.SyncRequest(push=msg))
    return out


def sync(stub: shard_pb2_grpc.ShardServiceStub, requests: Iterable[shard_pb2.SyncRequest],
         timeout: float = 60) -> list[shard_pb2.SyncResponse]:
    return list(stub.Sync(iter(list(requests)), timeout=timeout))


def assemble(responses: Sequence[shard_pb2.SyncResponse]
             ) -> list[tuple[int, str, torch.Tensor, torch.Tensor, float, bool]]:
    """Inline answers -> one (step, table, ids, delta, decay, duplicate) per answered push."""
    answers = []
    parts: list[shard_pb2.Update] = []
    for response in responses:
        u = response.update
        parts.append(u)
        assert u.chunk.index == len(parts) - 1, "answer chunks out of order"
        if u.chunk.index == u.chunk.count - 1:
            ids = torch.cat([wire.decode(p.chunk.ids) for p in parts])
            delta = torch.cat([wire.decode(p.chunk.delta) for p in parts])
            answers.append((u.step, u.table, ids, delta, u.decay, u.duplicate))
            parts = []
    assert not parts, "incomplete chunked answer"
    return answers
