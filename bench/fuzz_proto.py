"""Protocol fuzzer: malformed and mutated messages against a live shard server while
healthy 2-rank runs train on the same server.

    python bench/fuzz_proto.py                     # 100,000 messages
    python bench/fuzz_proto.py --messages 2000     # tests/test_fuzz_proto.py
    python bench/fuzz_proto.py --seed 5 --json runs/fuzz.json

Messages (plain Python generation from --seed, no hypothesis: fast enough for 10^5):
- random bytes, sent as the request of a random method;
- valid RegisterRequest / SyncRequest (inline pushes of registered fuzz partitions, at
  their next step) / FlushRequest / CheckpointRequest / FinishRequest / SeedRowsRequest /
  ShardStatsRequest messages, then 0-3 mutations: a field set to an edge value of its
  type (integer limits, NaN, inf, -0.0, traversal paths, long or non-ASCII strings,
  unknown enum numbers), a field cleared, a repeated entry removed or duplicated, or,
  on the serialized bytes, bits flipped, a truncation, bytes inserted or deleted.
Unary requests go one per call, Sync requests 1-4 per stream. The fuzz partitions use
their own run ids (a pool of 16, so the state they allocate stays bounded); the healthy
runs' ids are never used (guessing them is the token's business, docs/deploy.md).

Meanwhile healthy runs (torchrun, 2 ranks, the Sync socket, checkpoints) train back to
back on the same server until the fuzz is over; each must equal the same run on a server
of its own, bitwise (rows and dense weights, and the server's m, v, steps in the final
checkpoint). Every call's status is counted by code and printed. Exit code 0 only with
zero INTERNAL and zero UNKNOWN statuses, the server alive and SERVING at the end with
no internal error in its log, and every healthy run bitwise equal to the solo one.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc
import torch
from campaign_tools import (
    REPO,
    SMALL_JOB,
    PsProcess,
    child_env,
    load_line,
    server_state_differences,
    state_differences,
    worker_cmd,
)
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from hybridps import wire
from hybridps.admin import health_status
from hybridps.channel_options import channel_options
from hybridps.v1 import admin_pb2, shard_pb2

BAD_CODES = ("INTERNAL", "UNKNOWN")
CALL_TIMEOUT_S = 2.0  # a Flush or Checkpoint asked to wait 1e300 s ends here
FUZZ_RUNS = [f"fuzz-{i}" for i in range(16)]
TABLES = ("a", "b")
# A Flush or Checkpoint of a step not applied yet waits its timeout_s (0: the server's
# default): short ones keep the fuzz moving (the healthy runs send their own timeout).
SERVER_FLAGS = ["--max-state-bytes", str(1 << 30), "--flush-timeout-s", "0.1"]
HEALTHY_STEPS = 150

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

    def __init__(self, rng: random.Random, checkpoint_dirs: list[str]) -> None:
        self.rng = rng
        self.shapes: dict[tuple[str, int], Shape] = {}
        self.lock = threading.Lock()
        self.checkpoint_dirs = checkpoint_dirs

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

    def register(self) -> shard_pb2.RegisterRequest:
        s = self.shape()
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
            request.restore.directory = self.rng.choice(self.checkpoint_dirs)
            request.restore.step = self.rng.randrange(-1, 200)
        return request

    def push(self, sent: list[tuple[Shape, str, int]] | None = None) -> shard_pb2.SyncRequest:
        """A push of a fuzz partition at its next step (counting the earlier pushes of the
        same call, `sent`, which this one joins); the step advances when it is answered."""
        s = self.shape()
        lo, hi = s.table_range()
        n = self.rng.randrange(0, max(1, hi - lo) + 1)
        ids = torch.tensor(sorted(self.rng.sample(range(lo, hi), min(n, hi - lo))),
                           dtype=torch.int64)
        grads = torch.randn(len(ids), s.dim,
                            generator=torch.Generator().manual_seed(self.rng.randrange(2**31)))
        table = self.rng.choice(TABLES)
        with self.lock:
            step = s.next[table] + sum(1 for x, t, _ in sent or [] if x is s and t == table)
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

    def flush(self) -> shard_pb2.FlushRequest:
        s = self.shape()
        return shard_pb2.FlushRequest(run_id=s.run, rank=self.rng.choice([s.rank, -1]),
                                      step=max(0, s.next_step - self.rng.randrange(3)),
                                      timeout_s=self.rng.choice([0.001, 0.01, 0.05]))

    def checkpoint(self) -> shard_pb2.CheckpointRequest:
        s = self.shape()
        return shard_pb2.CheckpointRequest(
            run_id=s.run, step=max(0, s.next_step - 1),
            directory=self.rng.choice(self.checkpoint_dirs),
            ranks=self.rng.choice([[], [s.rank]]), timeout_s=0.01)

    def finish(self) -> shard_pb2.FinishRequest:
        s = self.shape()
        return shard_pb2.FinishRequest(run_id=s.run, rank=s.rank, incarnation=s.incarnation,
                                       last_step=max(s.next.values()) - 1,
                                       aborted=self.rng.random() < 0.5, reason="fuzz")

    def seed_rows(self) -> shard_pb2.SeedRowsRequest:
        s = self.shape()
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
    def item(self) -> tuple[str, list[bytes], list[tuple[Shape, str, int]]]:
        """(method, requests, the pushes of a Sync call): one request, or 1-4 for Sync."""
        rng = self.rng
        if rng.random() < 0.15:
            method = rng.choice(["Register", "SeedRows", "Flush", "Checkpoint", "Finish",
                                 "GetShardStats", "Sync"])
            count = rng.randrange(1, 3) if method == "Sync" else 1
            return method, [rng.randbytes(rng.randrange(0, 200)) for _ in range(count)], []
        method = rng.choices(["Register", "Sync", "Flush", "Checkpoint", "Finish", "SeedRows",
                              "GetShardStats"], weights=[20, 40, 10, 8, 6, 6, 10])[0]
        if method == "Sync":  # valid pushes first (applied and answered), then maybe not
            sent: list[tuple[Shape, str, int]] = []
            valid = [self.push(sent).SerializeToString() for _ in range(rng.randrange(0, 4))]
            return method, [*valid, self.mutate(self.push(sent))], sent
        build: dict[str, Callable[[], Message]] = {
            "Register": self.register, "Flush": self.flush, "Checkpoint": self.checkpoint,
            "Finish": self.finish, "SeedRows": self.seed_rows, "GetShardStats": self.stats}
        return method, [self.mutate(build[method]())], []

    def answered(self, sent: list[tuple[Shape, str, int]], reply: bytes) -> None:
        """A SyncResponse: the push it answers is applied, its partition's next step on."""
        try:
            response = shard_pb2.SyncResponse.FromString(reply)
        except Exception:
            return
        updates = (list(response.batch.updates) if response.HasField("batch")
                   else [response.update])
        with self.lock:
            for update in updates:
                for shape, table, step in sent:
                    if (table, step) == (update.table, update.step) and step < 2**40:
                        shape.next[table] = max(shape.next[table], step + 1)

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
            for t in rep.tables:
                if t.name in shape.next:
                    shape.next[t.name] = int(t.last_step) + 1
            # only shapes whose next messages stay in range (a mutated incarnation of
            # 2**63 - 1 would overflow the next Register's + 1)
            if (0 < shape.rows <= 4096 and 0 < shape.dim <= 64 and 0 < shape.world <= 8
                    and 0 <= shape.incarnation < 2**40
                    and max(shape.next.values()) < 2**40):
                self.shapes[(req.run_id, req.rank)] = shape


class Fuzzer:
    """Sends the generator's messages on one channel from `threads` threads; counts."""

    def __init__(self, address: str, messages: int, seed: int, threads: int,
                 checkpoint_dirs: list[str]) -> None:
        self.channel = grpc.insecure_channel(address, options=channel_options())
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self.unary = {
            name: self.channel.unary_unary(f"/hybridps.v1.{svc}/{name}",
                                           request_serializer=_raw,
                                           response_deserializer=_raw)
            for svc, name in (("ShardService", "Register"), ("ShardService", "SeedRows"),
                              ("ShardService", "Flush"), ("ShardService", "Checkpoint"),
                              ("ShardService", "Finish"), ("AdminService", "GetShardStats"))}
        self.sync = self.channel.stream_stream("/hybridps.v1.ShardService/Sync",
                                               request_serializer=_raw,
                                               response_deserializer=_raw)
        self.messages = messages
        self.generators = [Generator(random.Random(seed * 1000 + i), checkpoint_dirs)
                           for i in range(threads)]
        self.lock = threading.Lock()
        self.sent = 0
        self.calls = 0
        self.answers = 0  # SyncResponses received
        self.codes: Counter[str] = Counter()
        self.by_method: Counter[str] = Counter()
        self.seconds: dict[str, float] = defaultdict(float)  # per method, over calls
        self.bad: list[str] = []
        self.generator_errors: list[str] = []
        self.done = threading.Event()

    def run(self) -> None:
        threads = [threading.Thread(target=self._loop, args=(g,), daemon=True)
                   for g in self.generators]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.done.set()
        self.channel.close()

    def _take(self, n: int) -> bool:
        with self.lock:
            if self.sent >= self.messages:
                return False
            self.sent += n
            self.calls += 1
            return True

    def _loop(self, gen: Generator) -> None:
        while True:
            try:
                method, requests, sent = gen.item()
            except Exception as exc:  # the generator's own bug: counted as a failure
                with self.lock:
                    self.generator_errors.append(f"{type(exc).__name__}: {exc}")
                continue
            if not self._take(len(requests)):
                return
            code, details = "OK", ""
            t0 = time.perf_counter()
            try:
                if method == "Sync":
                    for response in self.sync(iter(requests), timeout=CALL_TIMEOUT_S):
                        gen.answered(sent, response)
                        with self.lock:
                            self.answers += 1
                else:
                    reply = self.unary[method](requests[0], timeout=CALL_TIMEOUT_S)
                    gen.learn(method, requests[0], reply)
            except grpc.RpcError as exc:
                code = exc.code().name if exc.code() is not None else "UNKNOWN"
                details = exc.details() or ""
            took = time.perf_counter() - t0
            with self.lock:
                self.seconds[method] += took
                self.codes[code] += 1
                self.by_method[f"{method} {code}"] += 1
                if code in BAD_CODES and len(self.bad) < 50:
                    self.bad.append(f"{method} {code}: {details[:300]} (request "
                                    f"{requests[0][:60].hex()})")


def _raw(data: bytes) -> bytes:
    return data


def _repeated(field: Any) -> bool:
    """A repeated field (protobuf >= 6 says is_repeated; older ones the label)."""
    if hasattr(field, "is_repeated"):
        return bool(field.is_repeated)
    return bool(field.label == FieldDescriptor.LABEL_REPEATED)


def _healthy_args(address: str, run_id: str, ck: Path, dump: Path) -> list[str]:
    return ["--ps", address, *SMALL_JOB, "--staleness", "1", "--steps", str(HEALTHY_STEPS),
            "--checkpoint-every", "50", "--checkpoint-dir", str(ck), "--run-id", run_id,
            "--dump-state", str(dump)]


def _healthy(address: str, run_id: str, work: Path) -> tuple[int, Path, Path, str]:
    ck, dump = work / run_id, work / f"{run_id}.pt"
    proc = subprocess.run(worker_cmd(_healthy_args(address, run_id, ck, dump)), cwd=REPO,
                          env=child_env(), capture_output=True, text=True, timeout=900,
                          check=False)
    (work / f"{run_id}.log").write_text(proc.stdout + proc.stderr)
    return proc.returncode, ck, dump, proc.stderr[-3000:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=23)
    parser.add_argument("--dir", default="", help="work directory (default: a temp dir)")
    parser.add_argument("--json", default="", help="write the figures here")
    args = parser.parse_args(argv)
    work = Path(args.dir or tempfile.mkdtemp(prefix="hybridps-fuzz-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    failures: list[str] = []
    print(f"fuzz: {args.messages} messages, seed {args.seed}, {args.threads} threads, beside "
          f"healthy {HEALTHY_STEPS}-step runs; {load_line()}", flush=True)

    solo_server = PsProcess(work / "ps-solo", "--checkpoint-root", str(work), *SERVER_FLAGS)
    try:
        rc, solo_ck, solo_dump, err = _healthy(solo_server.address, "healthy-solo", work)
    finally:
        solo_server.stop()
    if rc != 0:
        print(f"the solo run failed ({rc}):\n{err}", file=sys.stderr)
        return 1

    server = PsProcess(work / "ps", "--checkpoint-root", str(work), *SERVER_FLAGS)
    checkpoint_dirs = [f"fuzz/c{i}" for i in range(6)] + [
        "healthy-solo/step-0000000049", "../outside", "/", "", "fuzz/../../x"]
    fuzzer = Fuzzer(server.address, args.messages, args.seed, args.threads, checkpoint_dirs)
    fuzz_thread = threading.Thread(target=fuzzer.run, daemon=True)
    healthy: list[dict[str, Any]] = []
    fuzz_start = time.perf_counter()
    fuzz_thread.start()
    try:
        n = 0
        while not fuzzer.done.is_set() or n == 0:
            n += 1
            run_id = f"healthy-{n}"
            t0 = time.perf_counter()
            rc, ck, dump, err = _healthy(server.address, run_id, work)
            outcome: dict[str, Any] = {"run": run_id, "exit": rc,
                                       "seconds": round(time.perf_counter() - t0, 1),
                                       "fuzz_messages_by_end": fuzzer.sent}
            if rc != 0:
                failures.append(f"{run_id} exited {rc}: {err}")
            else:
                diffs = (state_differences(solo_dump, dump)
                         + server_state_differences(solo_ck, ck, HEALTHY_STEPS - 1))
                outcome["bitwise_equal"] = not diffs
                failures += [f"{run_id} differs from the solo run: {d}" for d in diffs[:10]]
            healthy.append(outcome)
            verdict = ("bitwise equal to the solo run" if outcome.get("bitwise_equal")
                       else "NOT equal")
            print(f"  healthy run {n}: exit {rc}, {verdict} ({outcome['seconds']}s; "
                  f"{fuzzer.sent} fuzz messages sent so far)", flush=True)
            if not server.alive():
                break
        fuzz_thread.join()
    finally:
        fuzz_s = time.perf_counter() - fuzz_start
        alive = server.alive()
        try:
            health = health_status(server.address, timeout=10) if alive else "DEAD"
        except grpc.RpcError as exc:
            health = f"health call failed: {exc.code()}"
        server.stop()
    server_log = server.log_path.read_text(errors="replace")
    if not alive:
        failures.append("the server process died during the fuzz")
    if health != "SERVING":
        failures.append(f"the server's health at the end: {health}")
    for needle in ("internal_error", "Traceback"):
        if needle in server_log:
            failures.append(f"the server log has {needle!r}")
    bad = sum(fuzzer.codes[c] for c in BAD_CODES)
    if bad:
        failures.append(f"{bad} INTERNAL/UNKNOWN statuses")
    if fuzzer.generator_errors:
        failures.append(f"{len(fuzzer.generator_errors)} generator errors, e.g. "
                        f"{fuzzer.generator_errors[0]}")
    if fuzzer.sent < args.messages:
        failures.append(f"only {fuzzer.sent} of {args.messages} messages were sent")
    elapsed = time.perf_counter() - started
    figures = {"messages": fuzzer.sent, "calls": fuzzer.calls, "seed": args.seed,
               "sync_answers": fuzzer.answers,
               "threads": args.threads, "codes": dict(fuzzer.codes),
               "by_method": dict(sorted(fuzzer.by_method.items())),
               "seconds_by_method": {k: round(v, 1) for k, v in fuzzer.seconds.items()},
               "bad_examples": fuzzer.bad, "healthy_runs": healthy,
               "server_alive": alive, "health": health, "fuzz_seconds": round(fuzz_s, 1),
               "seconds": round(elapsed, 1), "failures": failures, "load": load_line()}
    codes = ", ".join(f"{c} {n}" for c, n in fuzzer.codes.most_common())
    print(f"  {fuzzer.sent} messages in {fuzzer.calls} calls in {fuzz_s:.0f}s "
          f"({fuzzer.sent / max(fuzz_s, 1e-9):.0f} messages/s), {fuzzer.answers} push "
          f"answers received; statuses of the calls by code: {codes}")
    methods: dict[str, Counter[str]] = {}
    for key, count in fuzzer.by_method.items():
        method, code = key.split(" ")
        methods.setdefault(method, Counter())[code] += count
    for method, counts in sorted(methods.items()):
        mean_ms = 1e3 * fuzzer.seconds[method] / max(1, sum(counts.values()))
        print(f"    {method:13s} " + ", ".join(f"{c} {n}" for c, n in counts.most_common())
              + f" (mean {mean_ms:.1f} ms a call)")
    equal = sum(1 for h in healthy if h.get("bitwise_equal"))
    print(f"  INTERNAL/UNKNOWN: {bad}; server alive: {alive}, health {health}; healthy runs "
          f"bitwise equal to the solo run: {equal}/{len(healthy)}")
    print(f"  {len(failures)} failures; {elapsed:.0f}s; {load_line()}")
    for failure in failures[:20]:
        print(f"  FAIL {failure}")
    for example in fuzzer.bad[:10]:
        print(f"  BAD {example}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
