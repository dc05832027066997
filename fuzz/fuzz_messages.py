"""The fuzzer's messages (fuzz/fuzz_proto.py): valid requests of fuzz partitions, and
their field-level and byte-level mutations, from one random.Random.

`Generator.item()` gives an Item (method, serialized requests, the pushes of a Sync call,
the call's metadata, whether a builder made it); `learn`, `refused` and `answered` feed
back what the server said (a Register's partition and its secret, a push's step, a Page
call's seq and the ids it paged out), so later messages reach past the first checks. The
metadata carries the partition's secret (hybridps/partition_secret.py) most of the time,
and sometimes none or a wrong one; a Register carries its fuzz run's run secret
(hybridps/run_secret.py), whose checkpoint directory the fuzzer claimed.

The fuzz runs cover the registry: run i's optimizer is KINDS[i % len(KINDS)]
(hybridps/optim_kinds.py, every kind), and its tables are static, one dynamic, or both
dynamic by i // len(KINDS). `coverage_gaps` names each RPC of the proto services, each
optimizer kind (of the registry and of OptimizerConfig.Kind) and each table mode that a
campaign never exercised, so an RPC or an optimizer added without a builder here fails
the campaign.
"""

from __future__ import annotations

import math
import random
import re
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from hybridps import wire
from hybridps.optim_kinds import KINDS, TAKES_WEIGHT_DECAY
from hybridps.partition_secret import partition_metadata, run_secret_metadata
from hybridps.security import AUTH_HEADER, BEARER
from hybridps.v1 import admin_pb2, shard_pb2

Metadata = tuple[tuple[str, str], ...]

# every kind with static tables, then with table b dynamic, then (the rest) both dynamic
FUZZ_RUNS = [f"fuzz-{i}" for i in range(max(16, 2 * len(KINDS) + 2))]
TABLES = ("a", "b")
SERVICES = (shard_pb2.DESCRIPTOR.services_by_name["ShardService"],
            admin_pb2.DESCRIPTOR.services_by_name["AdminService"])
# the RPCs whose valid calls must also be answered OK at least once in a campaign
MUST_SUCCEED = ("Register", "Sync", "Page")
WRONG_TOKEN = "not-the-admin-token-0000"

INTS = [0, 1, -1, 2, 7, 2**31 - 1, -(2**31), 2**32, 2**53 + 1, 2**62, 2**63 - 1, -(2**63)]
FLOATS = [0.0, -0.0, 1.0, -1.0, 1e-300, 5e-324, 1e300, 3e38, -3e38, math.inf, -math.inf,
          math.nan]
STRINGS = ["", ".", "..", "../x", "../../evil", "/", "/etc/passwd", "a/b", "a\\b", "x" * 300,
           "\x00", "emb\x00", " ", "é", "\u202e", "fuzz-0", "a", "b", "healthy", "%s%n",
           "..\\..", "~", "-", "*"]


def run_number(run: str) -> int:
    tail = run.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def run_kind(run: str) -> str:
    """The optimizer of a fuzz run (module doc)."""
    return KINDS[run_number(run) % len(KINDS)]


def run_dynamic_tables(run: str) -> tuple[str, ...]:
    """The dynamic tables of a fuzz run (module doc)."""
    mode = run_number(run) // len(KINDS)
    return () if mode == 0 else ("b",) if mode == 1 else TABLES


def proto_kind(kind: str) -> str:
    """The OptimizerConfig.Kind name of a registry kind (ValueError for a kind the proto
    lacks)."""
    shard_pb2.OptimizerConfig.Kind.Value(kind.upper())
    return kind.upper()


def service_methods() -> list[str]:
    """Every RPC of the proto services, by name."""
    return [m.name for service in SERVICES for m in service.methods]


def optimizer_kinds() -> list[str]:
    """Every optimizer kind of the registry and of the proto's enum."""
    names = shard_pb2.OptimizerConfig.Kind.keys()
    return sorted(set(KINDS) | {n.lower() for n in names if n != "KIND_UNSPECIFIED"})


def required_coverage() -> dict[str, str]:
    """label -> 'sent' (a built message went) or 'ok' (one was answered OK)."""
    need = {f"rpc {m}": "sent" for m in service_methods()}
    for method in MUST_SUCCEED:
        need[f"rpc {method}"] = "ok"
    for kind in optimizer_kinds():
        need[f"register {kind}"] = "ok"
        need[f"push {kind}"] = "ok"
    for what in ("register table static", "register table dynamic", "push table static",
                 "push table dynamic", "page move", "page peek"):
        need[what] = "ok"
    return need


def coverage_gaps(sent: Counter[str], ok: Counter[str]) -> list[str]:
    """What `required_coverage` asks that the counts lack, one line each."""
    gaps = []
    for label, need in required_coverage().items():
        if need == "sent" and not sent[label]:
            gaps.append(f"{label}: never sent (no builder makes it?)")
        elif need == "ok" and not ok[label]:
            gaps.append(f"{label}: never answered OK ({sent[label]} sent)")
    return gaps


def _decoded_tensor(msg: shard_pb2.Tensor) -> torch.Tensor | None:
    try:
        return wire.decode(msg)
    except Exception:
        return None


class Item(NamedTuple):
    """One call: its method, request(s), the pushes of a Sync call, its metadata, and
    whether a builder made it (else: random bytes)."""

    method: str
    requests: list[bytes]
    sent: list[tuple[Shape, str, int]]
    metadata: Metadata
    built: bool


class Shape:
    """A fuzz partition: its tables' rows and dim, incarnation and next step (learned from
    the Registers that succeeded), optimizer, row dtype and dynamic tables (fixed per run
    id), and per dynamic table the last Page call applied and the ids paged out."""

    def __init__(self, run: str, rank: int, world: int, rows: int, dim: int,
                 incarnation: int = 0) -> None:
        self.run, self.rank, self.world, self.rows, self.dim = run, rank, world, rows, dim
        self.incarnation = incarnation
        self.secret = ""  # the partition secret its Register answered
        self.next = dict.fromkeys(TABLES, 0)  # table -> the next step to push
        self.kind = run_kind(run)
        self.dynamic = run_dynamic_tables(run)
        self.bf16 = run_number(run) % 5 == 4  # a master-rows partition: SeedRows first
        self.seq = dict.fromkeys(TABLES, 0)  # table -> the last Page call applied
        self.paged: dict[str, set[int]] = {t: set() for t in TABLES}  # ids paged out

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
                 run_dirs: dict[str, str] | None = None, admin_token: str = "",
                 warm_runs: list[str] | None = None) -> None:
        """`checkpoint_dirs`: directories any message may name; `run_secrets` and
        `run_dirs`: each fuzz run's secret and the directory claimed with it;
        `admin_token`: the server's (DropRun carries it; Shutdown never does);
        `warm_runs`: runs whose valid calls open the fuzz unmutated (Register, SeedRows,
        Sync, Page, peek), so a short campaign reaches every kind and table mode."""
        self.rng = rng
        self.shapes: dict[tuple[str, int], Shape] = {}
        self.lock = threading.Lock()
        self.checkpoint_dirs = checkpoint_dirs
        self.run_secrets = run_secrets or {}
        self.run_dirs = run_dirs or {}
        self.admin_token = admin_token
        self.warm: list[tuple[str, str, str]] = []  # (method, run, table) still to send
        for run in warm_runs or []:
            self.warm.append(("Register", run, ""))
            if Shape(run, 0, 1, 1, 1).bf16:
                self.warm += [("SeedRows", run, t) for t in TABLES]
            self.warm += [("Sync", run, ""), ("Sync", run, "")]
            for table in run_dynamic_tables(run):
                self.warm += [("Page", run, table), ("Page", run, table),
                              ("Peek", run, table)]

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
        return self.new_shape(self.rng.choice(FUZZ_RUNS))

    def new_shape(self, run: str, rank: int | None = None) -> Shape:
        number = run_number(run)
        world = 1 + number % 3
        return Shape(run, self.rng.randrange(world) if rank is None else rank, world,
                     16 * (1 + number % 8), 4 * (1 + number % 4))

    def register(self, s: Shape | None = None, exact: bool = False
                 ) -> shard_pb2.RegisterRequest:
        """`exact`: the partition's incarnation, no restore."""
        s = s or self.shape()
        lo, hi = s.table_range()
        request = shard_pb2.RegisterRequest(
            run_id=s.run, rank=s.rank, world_size=s.world,
            incarnation=s.incarnation + (0 if exact else self.rng.choice([0, 0, 1])),
            tables=[shard_pb2.TableSpec(name=t, num_rows=s.rows, dim=s.dim, row_start=lo,
                                        row_end=hi, dynamic=t in s.dynamic) for t in TABLES],
            optimizer=shard_pb2.OptimizerConfig(
                kind=proto_kind(s.kind), lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8,
                weight_decay=0.01 if s.kind in TAKES_WEIGHT_DECAY else 0.0))
        if s.bf16:
            request.row_dtype = shard_pb2.BFLOAT16
        if not exact and self.rng.random() < 0.05:
            step = self.rng.randrange(-1, 200)
            request.restore.directory = self.directory(s, step)
            request.restore.step = step
        return request

    def push(self, sent: list[tuple[Shape, str, int]] | None = None,
             s: Shape | None = None, exact: bool = False) -> shard_pb2.SyncRequest:
        """A push of a fuzz partition (`s`, else any) at its next step (counting the
        earlier pushes of the same call, `sent`, which this one joins); the step advances
        when it is answered. `exact`: of the table behind, never another step, alone."""
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
        table = (min(TABLES, key=ahead.__getitem__) if exact or self.rng.random() < 0.7
                 else self.rng.choice(TABLES))
        step = ahead[table]
        if not exact and self.rng.random() < 0.1:
            step = self.rng.choice(INTS)
        if sent is not None:
            sent.append((s, table, step))
        push = shard_pb2.Push(run_id=s.run, rank=s.rank, incarnation=s.incarnation,
                              step=step, table=table,
                              chunk=shard_pb2.InlineChunk(index=0, count=1))
        wire.encode(ids, push.chunk.ids)
        wire.encode(grads, push.chunk.grads)
        if not exact and self.rng.random() < 0.15:
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
            ranks=[s.rank] if self.rng.random() < 0.7 else [], timeout_s=0.01,
            deferred=self.rng.random() < 0.3)

    def checkpoint_done(self, s: Shape | None = None) -> shard_pb2.CheckpointDoneRequest:
        """The second step of a deferred Checkpoint: mostly the step a deferred one may have
        asked for, sometimes one never asked (answered NOT_FOUND/FAILED_PRECONDITION)."""
        s = s or self.shape()
        step = max(0, s.next_step - 1 - (self.rng.random() < 0.2))
        return shard_pb2.CheckpointDoneRequest(
            run_id=s.run, step=step, directory=self.directory(s, step),
            ranks=[s.rank] if self.rng.random() < 0.7 else [])

    def finish(self, s: Shape | None = None) -> shard_pb2.FinishRequest:
        s = s or self.shape()
        return shard_pb2.FinishRequest(run_id=s.run, rank=s.rank, incarnation=s.incarnation,
                                       last_step=max(s.next.values()) - 1,
                                       aborted=self.rng.random() < 0.5, reason="fuzz")

    def seed_rows(self, s: Shape | None = None, table: str = "") -> shard_pb2.SeedRowsRequest:
        s = s or self.shape()
        lo, hi = s.table_range()
        request = shard_pb2.SeedRowsRequest(run_id=s.run, rank=s.rank,
                                            incarnation=s.incarnation,
                                            table=table or self.rng.choice(TABLES),
                                            row_start=lo)
        wire.encode(torch.zeros(hi - lo, s.dim), request.rows)
        return request

    def stats(self) -> admin_pb2.ShardStatsRequest:
        return admin_pb2.ShardStatsRequest(run_id=self.rng.choice(["", *FUZZ_RUNS]))

    def drop_run(self) -> admin_pb2.DropRunRequest:
        return admin_pb2.DropRunRequest(run_id=self.rng.choice(FUZZ_RUNS), reason="fuzz")

    def shutdown(self) -> admin_pb2.ShutdownRequest:
        return admin_pb2.ShutdownRequest(grace_s=self.rng.choice([0.0, 0.1, -1.0, math.nan]),
                                         reason="fuzz")

    def admin_credentials(self, method: str) -> Metadata:
        """DropRun: the admin token (90%), else none or a wrong one. Shutdown: never the
        admin token (it would stop the server the healthy runs train on)."""
        token = self.admin_token if method == "DropRun" and self.rng.random() < 0.9 else (
            self.rng.choice(["", WRONG_TOKEN]))
        assert method != "Shutdown" or token != self.admin_token or not token
        return ((AUTH_HEADER, BEARER + token),) if token else ()

    def page(self, s: Shape | None = None, table: str = "", peek: bool = False
             ) -> shard_pb2.PageRequest:
        """A valid Page call of one of the partition's dynamic tables (of any table when it
        has none: refused): `peek` reads paged-out ids, else the call pages 0-4 fresh ids
        out of their slots and 0-4 ids in, some paged out before and some unknown."""
        s = s or self.shape()
        rng = self.rng
        table = table or rng.choice(s.dynamic or TABLES)
        lo, hi = s.table_range()
        slots = range(lo, hi)
        with self.lock:
            paged = sorted(s.paged.get(table, ()))
            seq = s.seq.get(table, 0)
        request = shard_pb2.PageRequest(
            run_id=s.run, rank=s.rank, incarnation=s.incarnation, table=table,
            step=s.next_step, seq=seq + 1, expire_steps=rng.choice([0, 0, 0, 1, 5, 100]),
            peek=peek)
        n_in = rng.randrange(0, min(4, len(slots)) + 1)
        in_ids = rng.sample(paged, min(len(paged), rng.randrange(0, n_in + 1)))
        while len(in_ids) < n_in:
            fresh = rng.randrange(2**40)
            if fresh not in in_ids:
                in_ids.append(fresh)
        wire.encode(torch.tensor(in_ids, dtype=torch.int64), request.in_ids)
        if peek:
            return request
        wire.encode(torch.tensor(rng.sample(slots, len(in_ids)), dtype=torch.int64),
                    request.in_slots)
        n_out = rng.randrange(0, min(4, len(slots)) + 1)
        out_ids = {rng.randrange(2**40) for _ in range(n_out)} - set(paged)
        gen = torch.Generator().manual_seed(rng.randrange(2**31))
        for name, tensor in (
                ("out_ids", torch.tensor(sorted(out_ids), dtype=torch.int64)),
                ("out_slots", torch.tensor(rng.sample(slots, len(out_ids)),
                                           dtype=torch.int64)),
                ("out_rows", torch.randn(len(out_ids), s.dim, generator=gen)),
                ("out_seen", torch.full((len(out_ids),), max(0, s.next_step - 1),
                                        dtype=torch.int64)),
                ("out_freq", torch.randint(1, 6, (len(out_ids),), generator=gen))):
            wire.encode(tensor, getattr(request, name))
        request.counters.capacity = len(slots)
        request.counters.lookups = rng.randrange(100)
        return request

    def _mutate_page(self, request: shard_pb2.PageRequest, s: Shape) -> bytes | None:
        """One targeted mutation of a valid Page call (a wrong partition or table, slots
        out of range, repeated ids, wrong shapes or dtypes, huge counts or numbers,
        non-finite rows, an id paged out already, a seq out of order, truncated bytes);
        the bytes, or None to go on with the message."""
        rng = self.rng
        lo, hi = s.table_range()

        def put(name: str, tensor: torch.Tensor) -> None:
            request.ClearField(name)
            wire.encode(tensor, getattr(request, name))

        def ids(name: str) -> list[int]:
            t = _decoded_tensor(getattr(request, name))
            return [] if t is None else [int(x) for x in t.reshape(-1).tolist()]

        def one_out(slot: int, ident: int) -> None:  # the out side: one entry
            put("out_ids", torch.tensor([ident], dtype=torch.int64))
            put("out_slots", torch.tensor([slot], dtype=torch.int64))
            put("out_rows", torch.zeros(1, s.dim))
            put("out_seen", torch.zeros(1, dtype=torch.int64))
            put("out_freq", torch.ones(1, dtype=torch.int64))

        i64 = torch.int64
        what = rng.randrange(16)
        if what == 0:
            request.run_id = rng.choice([*FUZZ_RUNS, "", "healthy-1", "x" * 300])
        elif what == 1:
            request.rank = rng.choice([s.rank + 1, -1, s.world, 2**31 - 1])
        elif what == 2:
            static = [t for t in TABLES if t not in s.dynamic]
            request.table = rng.choice([*static, "nope", "", "a\x00"])
        elif what == 3:
            bad = rng.choice([hi, lo - 1, -1, 2**62, -(2**63), 2**63 - 1])
            if rng.random() < 0.5:
                one_out(bad, rng.randrange(2**40))
            else:
                put("in_ids", torch.tensor([rng.randrange(2**40)], dtype=i64))
                put("in_slots", torch.tensor([bad], dtype=i64))
        elif what == 4:  # extreme and negative raw ids (valid ids: raw ids are any int64)
            extreme = rng.choice([-1, -(2**63), 2**63 - 1, 0])
            if rng.random() < 0.5:
                one_out(rng.randrange(lo, hi) if hi > lo else lo, extreme)
            else:
                put("in_ids", torch.tensor([extreme], dtype=i64))
                put("in_slots", torch.tensor([lo], dtype=i64))
        elif what == 5:  # repeated ids or slots
            name = rng.choice(["out_ids", "out_slots", "in_ids", "in_slots"])
            values = ids(name) or [lo]
            put(name, torch.tensor(values + values[:1], dtype=i64))
        elif what == 6:  # a shape that disagrees
            n = len(ids("out_ids"))
            name, tensor = rng.choice([
                ("out_rows", torch.zeros(n, s.dim + 1)), ("out_rows", torch.zeros(n * s.dim)),
                ("out_rows", torch.zeros(n + 1, s.dim)),
                ("out_seen", torch.zeros(n + 1, dtype=i64)),
                ("out_freq", torch.zeros(n, 2, dtype=i64)),
                ("in_slots", torch.zeros(len(ids("in_ids")) + 1, dtype=i64)),
                ("out_ids", torch.zeros(1, 1, dtype=i64))])
            put(name, tensor)
        elif what == 7:  # a dtype that disagrees
            name = rng.choice(["out_ids", "out_slots", "out_rows", "out_seen", "in_ids",
                               "in_slots"])
            t = _decoded_tensor(getattr(request, name))
            t = torch.zeros(0) if t is None else t
            put(name, t.to(rng.choice([torch.int32, torch.float32, torch.float16,
                                       torch.bfloat16, torch.int64])))
        elif what == 8:  # a shape that claims far more than the data
            name = rng.choice(["out_ids", "out_rows", "in_ids", "in_slots"])
            field = getattr(request, name)
            del field.shape[:]
            field.shape.extend(rng.choice([[2**40], [2**31, 2**31], [2**62, 0], [-1]]))
        elif what == 9:  # many ids, all refused (slots out of range) or found nowhere
            n = rng.choice([5_000, 50_000])
            put("in_ids", torch.arange(n, dtype=i64) + 2**41)
            put("in_slots", torch.full((n,), hi, dtype=i64) if rng.random() < 0.5
                else torch.arange(n, dtype=i64) + lo)
        elif what == 10:
            field = rng.choice(["step", "seq", "expire_steps"])
            setattr(request, field, rng.choice([-1, -(2**63), 2**63 - 1, 2**62]))
        elif what == 11:  # non-finite rows
            one_out(lo if hi > lo else 0, rng.randrange(2**40))
            put("out_rows", torch.full((1, s.dim), rng.choice([math.nan, math.inf])))
        elif what == 12:  # an id paged out already
            with self.lock:
                known = sorted(s.paged.get(request.table, ()))
            if known:
                one_out(lo, rng.choice(known))
        elif what == 13:  # a seq out of order, or a repeat of the last call
            request.seq = rng.choice([request.seq + 1, request.seq - 1, 0])
        elif what == 14:  # counters off every scale
            c = request.counters
            c.capacity, c.occupied, c.hits = (rng.choice(INTS) for _ in range(3))
        else:
            data = request.SerializeToString()
            return data[:rng.randrange(len(data) + 1)]
        return None

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
    def item(self) -> Item:
        """One call: one request, or 1-4 for Sync; the warm-up's first (unmutated)."""
        rng = self.rng
        while self.warm:
            warm = self._warm_item(*self.warm.pop(0))
            if warm is not None:
                return warm
        if rng.random() < 0.15:
            method = rng.choice(service_methods())
            count = rng.randrange(1, 3) if method == "Sync" else 1
            return Item(method, [rng.randbytes(rng.randrange(0, 200)) for _ in range(count)],
                        [], self.credentials(self.shape()), False)
        method = rng.choices(["Register", "Sync", "Flush", "Checkpoint", "CheckpointDone",
                              "Finish", "SeedRows", "GetShardStats", "Page", "DropRun",
                              "Shutdown"],
                             weights=[20, 40, 10, 8, 4, 6, 6, 10, 20, 1, 1])[0]
        s = self.shape()
        if method == "Sync":  # valid pushes of one partition first (applied and answered),
            sent: list[tuple[Shape, str, int]] = []  # then maybe not; sometimes another's
            valid = [self.push(sent, s).SerializeToString() for _ in range(rng.randrange(0, 4))]
            last = self.push(sent, s if rng.random() < 0.9 else None)
            return Item(method, [*valid, self.mutate(last)], sent, self.credentials(s), True)
        if method == "GetShardStats":
            return Item(method, [self.mutate(self.stats())], [], (), True)
        if method in ("DropRun", "Shutdown"):
            request = self.drop_run() if method == "DropRun" else self.shutdown()
            return Item(method, [self.mutate(request)], [], self.admin_credentials(method),
                        True)
        if method == "Register":
            return Item(method, [self.mutate(self.register(s))], [],
                        self.register_credentials(s), True)
        if method == "Page":  # valid (40%), a targeted mutation (30%), field/byte ones
            with self.lock:  # mostly a partition with a dynamic table
                dynamic = [x for x in self.shapes.values() if x.dynamic and x.secret]
            if dynamic and rng.random() < 0.9:
                s = rng.choice(dynamic)
            page = self.page(s, peek=rng.random() < 0.15)
            what = rng.random()
            if what < 0.4:
                data = page.SerializeToString()
            elif what < 0.7:
                targeted = self._mutate_page(page, s)
                data = page.SerializeToString() if targeted is None else targeted
            else:
                data = self.mutate(page)
            return Item(method, [data], [], self.credentials(s), True)
        build: dict[str, Callable[[Shape], Message]] = {
            "Flush": self.flush, "Checkpoint": self.checkpoint,
            "CheckpointDone": self.checkpoint_done, "Finish": self.finish,
            "SeedRows": self.seed_rows}
        return Item(method, [self.mutate(build[method](s))], [], self.credentials(s), True)

    def _warm_item(self, method: str, run: str, table: str) -> Item | None:
        """A valid call of the warm-up (None when its partition did not register)."""
        if method == "Register":
            s = self.new_shape(run, rank=0)
            return Item(method, [self.register(s, exact=True).SerializeToString()], [],
                        run_secret_metadata(self.run_secrets.get(run, "")), True)
        with self.lock:
            registered = self.shapes.get((run, 0))
        if registered is None:
            return None
        s = registered
        meta = partition_metadata(s.run, s.rank, s.secret)
        if method == "SeedRows":
            return Item(method, [self.seed_rows(s, table).SerializeToString()], [], meta, True)
        if method == "Sync":
            sent: list[tuple[Shape, str, int]] = []
            pushes = [self.push(sent, s, exact=True) for _ in TABLES]
            return Item(method, [p.SerializeToString() for p in pushes], sent, meta, True)
        request = self.page(s, table, peek=method == "Peek")
        return Item("Page", [request.SerializeToString()], [], meta, True)

    def labels(self, method: str, requests: list[bytes]) -> list[str]:
        """What a built call exercises (required_coverage's labels), from its bytes."""
        out = [f"rpc {method}"]
        try:
            if method == "Register":
                req = shard_pb2.RegisterRequest.FromString(requests[0])
                names = shard_pb2.OptimizerConfig.Kind
                if req.optimizer.kind in names.values():
                    out.append(f"register {names.Name(req.optimizer.kind).lower()}")
                out += sorted({f"register table {'dynamic' if t.dynamic else 'static'}"
                               for t in req.tables})
            elif method == "Sync":
                for data in requests:
                    sync = shard_pb2.SyncRequest.FromString(data)
                    pushes = (list(sync.batch.pushes) if sync.HasField("batch")
                              else [sync.push])
                    for push in pushes:
                        if push.run_id in FUZZ_RUNS:
                            dynamic = push.table in run_dynamic_tables(push.run_id)
                            out += [f"push {run_kind(push.run_id)}",
                                    f"push table {'dynamic' if dynamic else 'static'}"]
            elif method == "Page":
                page = shard_pb2.PageRequest.FromString(requests[0])
                out.append("page peek" if page.peek else "page move")
        except Exception:  # bytes that are no message: the method is all they exercise
            pass
        return sorted(set(out))

    def refused(self, method: str, request: bytes, details: str) -> None:
        """A Page call out of order: the server names its last seq; take it up."""
        found = re.search(r"last applied (-?\d+)", details)
        if method != "Page" or found is None:
            return
        try:
            req = shard_pb2.PageRequest.FromString(request)
        except Exception:
            return
        with self.lock:
            shape = self.shapes.get((req.run_id, req.rank))
            if shape is not None and req.table in shape.seq:
                shape.seq[req.table] = int(found.group(1))

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
        """A Register that succeeded: its partition can be pushed to at its next step; a
        Page call: its seq and the ids now paged out; a DropRun: the run is gone."""
        if method == "Page":
            self._learn_page(request, reply)
            return
        if method == "DropRun":
            try:
                run = admin_pb2.DropRunRequest.FromString(request).run_id
            except Exception:
                return
            with self.lock:
                for key in [k for k in self.shapes if k[0] == run]:
                    del self.shapes[key]
            return
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
            shape.dynamic = tuple(t.name for t in req.tables if t.dynamic and t.name in TABLES)
            old = self.shapes.get((req.run_id, req.rank))
            for t in rep.tables:
                if t.name in shape.next:
                    shape.next[t.name] = int(t.last_step) + 1
                    if old is not None and not t.created:  # the paged-out rows stay
                        shape.seq[t.name] = old.seq[t.name]
                        shape.paged[t.name] = old.paged[t.name]
            # only shapes whose next messages stay in range (a mutated incarnation of
            # 2**63 - 1 would overflow the next Register's + 1)
            if (0 < shape.rows <= 4096 and 0 < shape.dim <= 64 and 0 < shape.world <= 8
                    and 0 <= shape.incarnation < 2**40
                    and max(shape.next.values()) < 2**40):
                self.shapes[(req.run_id, req.rank)] = shape


    def _learn_page(self, request: bytes, reply: bytes) -> None:
        try:
            req = shard_pb2.PageRequest.FromString(request)
            rep = shard_pb2.PageResponse.FromString(reply)
        except Exception:
            return
        if req.peek:
            return
        out_ids, in_ids, found, dropped = (_decoded_tensor(t) for t in (
            req.out_ids, req.in_ids, rep.found, rep.dropped))
        with self.lock:
            shape = self.shapes.get((req.run_id, req.rank))
            if shape is None or req.table not in shape.seq:
                return
            if req.seq != shape.seq[req.table] + 1:
                return  # a repeat answered again, or another thread's view
            shape.seq[req.table] = req.seq
            paged = shape.paged[req.table]
            if out_ids is not None:
                paged.update(int(x) for x in out_ids.reshape(-1).tolist())
            if in_ids is not None and found is not None and found.numel() == in_ids.numel():
                paged.difference_update(int(x) for x in in_ids[found.bool()].tolist())
            if dropped is not None:
                paged.difference_update(int(x) for x in dropped.reshape(-1).tolist())


def _repeated(field: Any) -> bool:
    """A repeated field (protobuf >= 6 says is_repeated; older ones the label)."""
    if hasattr(field, "is_repeated"):
        return bool(field.is_repeated)
    return bool(field.label == FieldDescriptor.LABEL_REPEATED)
