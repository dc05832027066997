"""After the fuzzer's barrage (fuzz/fuzz_proto.py): valid calls still answered right.

For every optimizer kind of hybridps/optim_kinds.py, a fresh run with one static and one
dynamic table: Register, a Sync push to each table (answered, applied once), a Page call
paging two ids out, a peek that finds them with the rows paged out, a Page call paging one
back in (its row answered), Flush, GetShardStats and Finish. Each wrong answer or refusal
is one line of the result.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import torch

from hybridps import wire
from hybridps.channel_options import channel_options
from hybridps.optim_kinds import KINDS, TAKES_WEIGHT_DECAY
from hybridps.partition_secret import partition_metadata
from hybridps.v1 import admin_pb2, admin_pb2_grpc, shard_pb2, shard_pb2_grpc

ROWS, DIM = 32, 4
TIMEOUT_S = 20.0


def _tensor(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


def _page(run: str, seq: int, *, out_ids: Sequence[int] = (), out_slots: Sequence[int] = (),
          out_rows: torch.Tensor | None = None, in_ids: Sequence[int] = (),
          in_slots: Sequence[int] = (), peek: bool = False) -> shard_pb2.PageRequest:
    request = shard_pb2.PageRequest(run_id=run, rank=0, incarnation=0, table="d", step=1,
                                    seq=seq, peek=peek)
    n = len(out_ids)
    for name, tensor in (
            ("out_ids", _tensor(out_ids)), ("out_slots", _tensor(out_slots)),
            ("out_rows", torch.zeros(0, DIM) if out_rows is None else out_rows),
            ("out_seen", torch.zeros(n, dtype=torch.int64)),
            ("out_freq", torch.ones(n, dtype=torch.int64)),
            ("in_ids", _tensor(in_ids)), ("in_slots", _tensor(in_slots))):
        wire.encode(tensor, getattr(request, name))
    return request


def _one_kind(shard: shard_pb2_grpc.ShardServiceStub, admin: admin_pb2_grpc.AdminServiceStub,
              kind: str) -> list[str]:
    run = f"after-fuzz-{kind}"
    optimizer = shard_pb2.OptimizerConfig(
        kind=kind.upper(), lr=0.01, beta1=0.9,
        beta2=0.999, eps=1e-8, weight_decay=0.01 if kind in TAKES_WEIGHT_DECAY else 0.0)
    reply = shard.Register(shard_pb2.RegisterRequest(
        run_id=run, rank=0, world_size=1, incarnation=0, optimizer=optimizer,
        tables=[shard_pb2.TableSpec(name=name, num_rows=ROWS, dim=DIM, row_start=0,
                                    row_end=ROWS, dynamic=name == "d") for name in "sd"]),
        timeout=TIMEOUT_S)
    meta = partition_metadata(run, 0, reply.partition_secret)
    problems = []

    pushes = []
    for name in "sd":
        push = shard_pb2.Push(run_id=run, rank=0, incarnation=0, step=0, table=name,
                              chunk=shard_pb2.InlineChunk(index=0, count=1))
        wire.encode(_tensor([1, 5]), push.chunk.ids)
        wire.encode(torch.ones(2, DIM), push.chunk.grads)
        pushes.append(shard_pb2.SyncRequest(push=push))
    updates = [r.update for r in shard.Sync(iter(pushes), timeout=TIMEOUT_S, metadata=meta)]
    answered = sorted((u.table, u.step, u.duplicate) for u in updates)
    if answered != [("d", 0, False), ("s", 0, False)]:
        problems.append(f"{kind}: the pushes were answered {answered}")

    rows = torch.arange(2 * DIM, dtype=torch.float32).reshape(2, DIM) + 0.5
    out = shard.Page(_page(run, 1, out_ids=[1001, 1002], out_slots=[3, 4], out_rows=rows),
                     timeout=TIMEOUT_S, metadata=meta)
    if wire.decode(out.found).numel() != 0:
        problems.append(f"{kind}: a page-out call found {wire.decode(out.found).tolist()}")
    peek = shard.Page(_page(run, 0, in_ids=[1001, 1002, 7], peek=True), timeout=TIMEOUT_S,
                      metadata=meta)
    if (wire.decode(peek.found).tolist() != [1, 1, 0]
            or not torch.equal(wire.decode(peek.rows), rows)):
        problems.append(f"{kind}: the peek found {wire.decode(peek.found).tolist()}, not "
                        "the two ids paged out with their rows")
    back = shard.Page(_page(run, 2, in_ids=[1001], in_slots=[3]), timeout=TIMEOUT_S,
                      metadata=meta)
    if (wire.decode(back.found).tolist() != [1]
            or not torch.equal(wire.decode(back.rows), rows[:1])):
        problems.append(f"{kind}: paging 1001 back in found {wire.decode(back.found).tolist()}")

    flushed = shard.Flush(shard_pb2.FlushRequest(run_id=run, rank=0, step=0, timeout_s=5.0),
                          timeout=TIMEOUT_S, metadata=meta)
    if sorted((a.table, a.last_step) for a in flushed.applied) != [("d", 0), ("s", 0)]:
        problems.append(f"{kind}: Flush answered {list(flushed.applied)}")
    stats = admin.GetShardStats(admin_pb2.ShardStatsRequest(run_id=run), timeout=TIMEOUT_S)
    if not stats.partitions:
        problems.append(f"{kind}: GetShardStats shows no partition of {run}")
    shard.Finish(shard_pb2.FinishRequest(run_id=run, rank=0, incarnation=0, last_step=0,
                                         reason="after fuzz"), timeout=TIMEOUT_S,
                 metadata=meta)
    return problems


def valid_calls_problems(address: str) -> list[str]:
    """One line per wrong answer or refusal of the valid calls (module doc)."""
    problems: list[str] = []
    with grpc.insecure_channel(address, options=channel_options()) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        shard = shard_pb2_grpc.ShardServiceStub(channel)
        admin = admin_pb2_grpc.AdminServiceStub(channel)
        for kind in KINDS:
            try:
                problems += _one_kind(shard, admin, kind)
            except grpc.RpcError as exc:
                problems.append(f"{kind}: {exc.code().name}: {exc.details()}")
            except ValueError as exc:  # a registry kind that OptimizerConfig.Kind lacks
                problems.append(f"{kind}: {exc}")
    return problems
