"""Client-side helpers for tests that talk to a real shard server."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import grpc
import torch

from hybridps import wire
from hybridps.channel_options import channel_options
from hybridps.v1 import shard_pb2, shard_pb2_grpc

ADAM = shard_pb2.OptimizerConfig(kind=shard_pb2.OptimizerConfig.ADAM, lr=0.05, beta1=0.9,
                                 beta2=0.999, eps=1e-8)


def open_channel(address: str, max_message_bytes: int | None = None) -> grpc.Channel:
    options = channel_options() if max_message_bytes is None else channel_options(
        max_message_bytes)
    channel = grpc.insecure_channel(address, options=options)
    grpc.channel_ready_future(channel).result(timeout=30)
    return channel


def shard_stub(channel: grpc.Channel) -> shard_pb2_grpc.ShardServiceStub:
    return shard_pb2_grpc.ShardServiceStub(channel)


def table(name: str, num_rows: int, dim: int, row_start: int, row_end: int
          ) -> shard_pb2.TableSpec:
    return shard_pb2.TableSpec(name=name, num_rows=num_rows, dim=dim, row_start=row_start,
                               row_end=row_end)


def register(stub: shard_pb2_grpc.ShardServiceStub, run_id: str,
             tables: Sequence[shard_pb2.TableSpec], *, rank: int = 0, world_size: int = 1,
             incarnation: int = 0,
             optimizer: shard_pb2.OptimizerConfig = ADAM) -> shard_pb2.RegisterResponse:
    return stub.Register(shard_pb2.RegisterRequest(
        run_id=run_id, rank=rank, world_size=world_size, incarnation=incarnation,
        tables=list(tables), optimizer=optimizer), timeout=30)


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
