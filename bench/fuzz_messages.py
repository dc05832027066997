"""The fuzzer's messages (bench/fuzz_proto.py): valid requests of fuzz partitions, and
their field-level and byte-level mutations, from one random.Random.

`Generator.item()` gives (method, serialized requests, the pushes of a Sync call, the
call's metadata); `learn` and `answered` feed back what the server accepted (a
Register's partition and its secret, a push's step), so later messages reach past the
first checks. The metadata carries the partition's secret (hybridps/partition_secret.py)
most of the time, and sometimes none or a wrong one; a Register carries its fuzz run's
run secret (hybridps/run_secret.py), whose checkpoint directory the fuzzer claimed.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Callable
from typing import Any

import torch
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from hybridps import wire
from hybridps.partition_secret import partition_metadata, run_secret_metadata
from hybridps.v1 import admin_pb2, shard_pb2

Metadata = tuple[tuple[str, str], ...]

FUZZ_RUNS = [f"fuzz-{i}" for i in range(16)]
TABLES = ("a", "b")

INTS = [0, 1, -1, 2, 7, 2**31 - 1, -(2**31), 2**32, 2**53 + 1, 2**62, 2**63 - 1, -(2**63)]
FLOATS = [0.0, -0.0, 1.0, -1.0, 1e-300, 5e-324, 1e300, 3e38, -3e38, math.inf, -math.inf,
          math.nan]
STRINGS = ["", ".", "..", "../x", "../../evil", "/", "/etc/passwd", "a/b", "a\\b", "x" * 300,
           "\x00", "emb\x00", " ", "é", "\u202e", "fuzz-0", "a", "b", "healthy", "%s%n",
           "..\\..", "~", "-", "*"]


class Shape:
    """A fuzz partition: its tables' rows and dim, incarnation and next step (learned from
    the Registers that succeeded), optimizer and row dtype (fixed per run id)."""

    def __init__(self, run: str, rank: int, world: int, rows: int, dim: int,
                 incarnation: int = 0) -> None:
        self.run, self.rank, self.world, self.rows, self.dim = run, rank, world, rows, dim
        self.incarnation = incarnation
        self.secret = ""  # the partition secret its Register answered
        self.next = dict.fromkeys(TABLES, 0)  # table -> the next step to push
        number = int(run.rsplit("-", 1)[-1]) if run.rsplit("-", 1)[-1].isdigit() else 0
        self.optimizer = ("ADAM", "ADAMW", "SGD")[number % 3]
        self.bf16 = number % 5 == 4  # a master-rows partition: SeedRows before pushes

    @property
    def next_step(self) -> int:
        """The next step of every table (the oldest)."""
        return min(self.next.values())

    def table_range(self) -> tuple[int, int]:
        per = -(-self.rows // self.world)
        start = min(self.rows, self.rank * per)
        return start, min(self.rows, start + per)


class Generator:
    """Messages from one seed: (method, request bytes), a Sync call's list of them."""

    def __init__(self, rng: random.Random, checkpoint_dirs: list[str],
                 run_secrets: dict[str, str] | None = None,
                 run_dirs: dict[str, str] | None = None) -> None:
        """`checkpoint_dirs`: directories any message may name; `run_secrets` and
        `run_dirs`: each fuzz run's secret and the directory claimed with it."""
        self.rng = rng
        self.shapes: dict[tuple[str, int], Shape] = {}
        self.lock = threading.Lock()
        self.checkpoint_dirs = checkpoint_dirs
        self.run_secrets = run_secrets or {}
        self.run_dirs = run_dirs or {}

    # -- credentials ---------------------------------------------------------------------
    def credentials(self, s: Shape) -> Metadata:
        """The partition's secret (85%), none (10%) or a wrong one (5%)."""
        what = self.rng.random()
        if what < 0.85 and s.secret:
            return partition_metadata(s.run, s.rank, s.secret)
        if what < 0.95:
            return ()
        return partition_metadata(s.run, s.rank, self.rng.choice(["0" * 32, "x", s.secret]))

    def register_credentials(self, s: Shape) -> Metadata:
        """The run secret (90%) and the partition's secret when known (70%)."""
        out: Metadata = ()
        if self.rng.random() < 0.9:
            out += run_secret_metadata(self.run_secrets.get(s.run, ""))
        if s.secret and self.rng.random() < 0.7:
            out += partition_metadata(s.run, s.rank, s.secret)
        return out

    def directory(self, s: Shape, step: int) -> str:
        """A checkpoint directory: mostly a step of the run's own claimed directory."""
        own = self.run_dirs.get(s.run)
        if own and self.rng.random() < 0.7:
            return f"{own}/step-{max(step, 0):010d}"
        return self.rng.choice(self.checkpoint_dirs)

    # -- valid messages ------------------------------------------------------------------
    def shape(self) -> Shape:
        with self.lock:
            if self.shapes and self.rng.random() < 0.8:
                return self.rng.choice(list(self.shapes.values()))
        run = self.rng.choice(FUZZ_RUNS)
        number = int(run.split("-")[1])
        world = 1 + number % 3
        return Shape(run, self.rng.randrange(world), world, 16 * (1 + number % 8),
                     4 * (1 + number % 4))

    def register(self, s: Shape | None = None) -> shard_pb2.RegisterRequest:
        s = s or self.shape()
        lo, hi = s.table_range()
        request = shard_pb2.RegisterRequest(
            run_id=s.run, rank=s.rank, world_size=s.world,
            incarnation=s.incarnation + self.rng.choice([0, 0, 1]),
            tables=[shard_pb2.TableSpec(name=t, num_rows=s.rows, dim=s.dim, row_start=lo,
                                        row_end=hi) for t in TABLES],
            optimizer=shard_pb2.OptimizerConfig(
                kind=s.optimizer, lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8,
                weight_decay=0.01 if s.optimizer == "ADAMW" else 0.0))
        if s.bf16:
            request.row_dtype = shard_pb2.BFLOAT16
        if self.rng.random() < 0.05:
            step = self.rng.randrange(-1, 200)
            request.restore.directory = self.directory(s, step)
            request.restore.step = step
        return request

    def push(self, sent: list[tuple[Shape, str, int]] | None = None,
             s: Shape | None = None) -> shard_pb2.SyncRequest:
        """A push of a fuzz partition (`s`, else any) at its next step (counting the
        earlier pushes of the same call, `sent`, which this one joins); the step advances
        when it is answered."""
        s = s or self.shape()
        lo, hi = s.table_range()
        n = self.rng.randrange(0, max(1, hi - lo) + 1)
        ids = torch.tensor(sorted(self.rng.sample(range(lo, hi), min(n, hi - lo))),
                           dtype=torch.int64)
        grads = torch.randn(len(ids), s.dim,
                            generator=torch.Generator().manual_seed(self.rng.randrange(2**31)))
        with self.lock:
            ahead = {t: s.next[t] + sum(1 for x, u, _ in sent or [] if x is s and u == t)
                     for t in TABLES}
        # mostly the table behind: the tables stay at one step, so Checkpoints can succeed
        table = (min(TABLES, key=ahead.__getitem__) if self.rng.random() < 0.7
                 else self.rng.choice(TABLES))
        step = ahead[table]
        if self.rng.random() < 0.1:
            step = self.rng.choice(INTS)
        if sent is not None:
            sent.append((s, table, step))
        push = shard_pb2.Push(run_id=s.run, rank=s.rank, incarnation=s.incarnation,
                              step=step, table=table,
                              chunk=shard_pb2.InlineChunk(index=0, count=1))
        wire.encode(ids, push.chunk.ids)
        wire.encode(grads, push.chunk.grads)
        if self.rng.random() < 0.15:
            return shard_pb2.SyncRequest(batch=shard_pb2.PushBatch(pushes=[push, push]))
        return shard_pb2.SyncRequest(push=push)

    def flush(self, s: Shape | None = None) -> shard_pb2.FlushRequest:
        s = s or self.shape()
        return shard_pb2.FlushRequest(run_id=s.run, rank=self.rng.choice([s.rank, -1]),
                                      step=max(0, s.next_step - self.rng.randrange(3)),
                                      timeout_s=self.rng.choice([0.001, 0.01, 0.05]))

    def checkpoint(self, s: Shape | None = None) -> shard_pb2.CheckpointRequest:
        s = s or self.shape()
        return shard_pb2.CheckpointRequest(
            run_id=s.run, step=max(0, s.next_step - 1),
            directory=self.directory(s, s.next_step - 1),
            ranks=[s.rank] if self.rng.random() < 0.7 else [], timeout_s=0.01)

    def finish(self, s: Shape | None = None) -> shard_pb2.FinishRequest:
        s = s or self.shape()
        return shard_pb2.FinishRequest(run_id=s.run, rank=s.rank, incarnation=s.incarnation,
                                       last_step=max(s.next.values()) - 1,
                                       aborted=self.rng.random() < 0.5, reason="fuzz")

    def seed_rows(self, s: Shape | None = None) -> shard_pb2.SeedRowsRequest:
        s = s or self.shape()
        lo, hi = s.table_range()
        request = shard_pb2.SeedRowsRequest(run_id=s.run, rank=s.rank,
                                            incarnation=s.incarnation,
                                            table=self.rng.choice(TABLES), row_start=lo)
        wire.encode(torch.zeros(hi - lo, s.dim), request.rows)
        return request

    def stats(self) -> admin_pb2.ShardStatsRequest:
        return admin_pb2.ShardStatsRequest(run_id=self.rng.choice(["", *FUZZ_RUNS]))

    # -- mutations -----------------------------------------------------------------------
    def mutate(self, message: Message) -> bytes:
        """0-3 field-level mutations, then (sometimes) byte-level ones; the bytes."""
        for _ in range(self.rng.choice([0, 0, 1, 1, 2, 3])):
            self._mutate_field(message)
        data = message.SerializeToString()
        if self.rng.random() < 0.25:
            data = self._mutate_bytes(bytearray(data))
        return data

    def _fields(self, message: Message, out: list[tuple[Message, Any]]) -> None:
        for field in message.DESCRIPTOR.fields:
            out.append((message, field))
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                if _repeated(field):
                    for item in getattr(message, field.name):
                        self._fields(item, out)
                elif message.HasField(field.name):
                    self._fields(getattr(message, field.name), out)

    def _value(self, field: Any) -> Any:
        rng, kind = self.rng, field.type
        if kind in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
            return rng.choice(FLOATS) if rng.random() < 0.8 else rng.uniform(-1e6, 1e6)
        if kind == FieldDescriptor.TYPE_BOOL:
            return rng.random() < 0.5
        if kind == FieldDescriptor.TYPE_STRING:
            return rng.choice(STRINGS) if rng.random() < 0.8 else "".join(
                chr(rng.randrange(1, 0x3000)) for _ in range(rng.randrange(40)))
        if kind == FieldDescriptor.TYPE_BYTES:
            return rng.randbytes(rng.choice([0, 1, 7, 8, 32, 100, 300]))
        if kind == FieldDescriptor.TYPE_ENUM:
            return rng.randrange(-1, 40)
        bits = 64 if kind in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64,
                              FieldDescriptor.TYPE_SFIXED64) else 32
        value = rng.choice(INTS) if rng.random() < 0.7 else rng.randrange(-100, 10_000)
        low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        return min(high, max(low, value))

    def _mutate_field(self, message: Message) -> None:
        fields: list[tuple[Message, Any]] = []
        self._fields(message, fields)
        owner, field = self.rng.choice(fields)
        what = self.rng.random()
        if _repeated(field):
            items = getattr(owner, field.name)
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                if items and what < 0.5:
                    del items[self.rng.randrange(len(items))]
                elif items:
                    items.add().CopyFrom(self.rng.choice(list(items)))
                else:
                    items.add()
            elif what < 0.3 and len(items):
                del items[self.rng.randrange(len(items))]
            else:
                items.append(self._value(field))
            return
        if what < 0.15 or field.type == FieldDescriptor.TYPE_MESSAGE:
            owner.ClearField(field.name)
            return
        try:
            setattr(owner, field.name, self._value(field))
        except (ValueError, TypeError):
            owner.ClearField(field.name)

    def _mutate_bytes(self, data: bytearray) -> bytes:
        rng = self.rng
        for _ in range(rng.randrange(1, 4)):
            what = rng.random()
            if not data or what < 0.2:
                data[rng.randrange(len(data) + 1):rng.randrange(len(data) + 1)] = (
                    rng.randbytes(rng.randrange(1, 16)))
            elif what < 0.6:
                at = rng.randrange(len(data))
                data[at] ^= 1 << rng.randrange(8)
            elif what < 0.8:
                del data[rng.randrange(len(data)):]
            else:
                at = rng.randrange(len(data))
                del data[at:at + rng.randrange(1, 8)]
        return bytes(data)

    # -- one item ------------------------------------------------------------------------
    def item(self) -> tuple[str, list[bytes], list[tuple[Shape, str, int]], Metadata]:
        """(method, requests, the pushes of a Sync call, the call's metadata): one
        request, or 1-4 for Sync."""
        rng = self.rng
        if rng.random() < 0.15:
            method = rng.choice(["Register", "SeedRows", "Flush", "Checkpoint", "Finish",
                                 "GetShardStats", "Sync"])
            count = rng.randrange(1, 3) if method == "Sync" else 1
            return (method, [rng.randbytes(rng.randrange(0, 200)) for _ in range(count)], [],
                    self.credentials(self.shape()))
        method = rng.choices(["Register", "Sync", "Flush", "Checkpoint", "Finish", "SeedRows",
                              "GetShardStats"], weights=[20, 40, 10, 8, 6, 6, 10])[0]
        s = self.shape()
        if method == "Sync":  # valid pushes of one partition first (applied and answered),
            sent: list[tuple[Shape, str, int]] = []  # then maybe not; sometimes another's
            valid = [self.push(sent, s).SerializeToString() for _ in range(rng.randrange(0, 4))]
            last = self.push(sent, s if rng.random() < 0.9 else None)
            return method, [*valid, self.mutate(last)], sent, self.credentials(s)
        if method == "GetShardStats":
            return method, [self.mutate(self.stats())], [], ()
        if method == "Register":
            return (method, [self.mutate(self.register(s))], [],
                    self.register_credentials(s))
        build: dict[str, Callable[[Shape], Message]] = {
            "Flush": self.flush, "Checkpoint": self.checkpoint, "Finish": self.finish,
            "SeedRows": self.seed_rows}
        return method, [self.mutate(build[method](s))], [], self.credentials(s)

    def answered(self, sent: list[tuple[Shape, str, int]], reply: bytes) -> tuple[int, int]:
        """A SyncResponse: the push it answers is applied, its partition's next step on.
        Returns (pushes answered as applied, answered as duplicates)."""
        try:
            response = shard_pb2.SyncResponse.FromString(reply)
        except Exception:
            return 0, 0
        updates = (list(response.batch.updates) if response.HasField("batch")
                   else [response.update])
        with self.lock:
            for update in updates:
                for shape, table, step in sent:
                    if (table, step) == (update.table, update.step) and step < 2**40:
                        shape.next[table] = max(shape.next[table], step + 1)
        duplicates = sum(1 for u in updates if u.duplicate)
        return len(updates) - duplicates, duplicates

    def learn(self, method: str, request: bytes, reply: bytes) -> None:
        """A Register that succeeded: its partition can be pushed to at its next step."""
        if method != "Register":
            return
        try:
            req = shard_pb2.RegisterRequest.FromString(request)
            rep = shard_pb2.RegisterResponse.FromString(reply)
        except Exception:
            return
        if not req.tables or not rep.tables:
            return
        spec = req.tables[0]
        with self.lock:
            shape = Shape(req.run_id, req.rank, req.world_size, int(spec.num_rows),
                          int(spec.dim), int(req.incarnation))
            shape.secret = rep.partition_secret
            for t in rep.tables:
                if t.name in shape.next:
                    shape.next[t.name] = int(t.last_step) + 1
            # only shapes whose next messages stay in range (a mutated incarnation of
            # 2**63 - 1 would overflow the next Register's + 1)
            if (0 < shape.rows <= 4096 and 0 < shape.dim <= 64 and 0 < shape.world <= 8
                    and 0 <= shape.incarnation < 2**40
                    and max(shape.next.values()) < 2**40):
                self.shapes[(req.run_id, req.rank)] = shape


def _repeated(field: Any) -> bool:
    """A repeated field (protobuf >= 6 says is_repeated; older ones the label)."""
    if hasattr(field, "is_repeated"):
        return bool(field.is_repeated)
    return bool(field.label == FieldDescriptor.LABEL_REPEATED)
