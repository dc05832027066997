"""CPU the shard server spends on one step's push: a batch of shared-memory pushes.

    python bench/bench_push_cpu.py            # ~1 min
    python bench/bench_push_cpu.py --quick --json runs/bench/push_cpu.json

What a rank sends each step of the default job (4 tables, ~190 unique rows of dim 16
each, by reference into its arena, in one `PushBatch` message), measured two ways
in one run:
  (a) in process: the server's Python path alone (decode, the Store's checks and
      update, the answer message), no gRPC; min and median of 7 rounds;
  (b) a real `python -m ps` and one rank on a real Sync stream, one batch in flight:
      the server's CPU per batch (/proc/<pid>/stat) and the client's, with the next
      batch sent at once (`gap 0`) and after a pause like a training step's (`gap 5`
      ms): a server that sleeps between messages pays more for each (cold caches).
The ratio that matters for goal 4 is (b) at a realistic gap against the step time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
import torch  # noqa: E402
from bench_wire import Server  # noqa: E402  (bench/ is sys.path[0] when run as a script)

from hybridps.optim import OptimizerSpec  # noqa: E402
from hybridps.partition_secret import partition_metadata  # noqa: E402
from hybridps.v1 import shard_pb2, shard_pb2_grpc  # noqa: E402
from ps.core.partition import TableSpec  # noqa: E402
from ps.core.shard_core import ShardCore  # noqa: E402
from ps.core.store import Store  # noqa: E402
from ps.edge.arena_server import ArenaRegistry, ResolvedShmPush  # noqa: E402
from ps.edge.sync_codec import batch_message, decode_request, request_chunks, shm_update  # noqa: E402
from worker.sync.arena import ClientArena, ShmSlot, place, region_bytes  # noqa: E402
from worker.sync.messages import optimizer_message  # noqa: E402

TABLE_ROWS = 250_000
POOL = 32  # distinct (ids, grads) pushes cycled through
SPEC = OptimizerSpec(kind="adam", lr=0.01)


class Pushes:
    """Batch messages of `tables` shm pushes placed into `arena` (regions freed by the
    caller once answered)."""

    def __init__(self, arena: ClientArena, run_id: str, epoch: int, tables: int, rows: int,
                 dim: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.pool = [(torch.randperm(TABLE_ROWS, generator=g)[:rows].sort().values,
                      torch.randn(rows, dim, generator=g)) for _ in range(POOL)]
        self.arena, self.run_id, self.epoch, self.tables = arena, run_id, epoch, tables

    def batch(self, step: int) -> tuple[shard_pb2.SyncRequest, list[ShmSlot]]:
        entries, slots = [], []
        for t in range(self.tables):
            ids_U, grads_UD = self.pool[(step * self.tables + t) % POOL]
            slot = place(self.arena, ids_U, grads_UD, torch.float32, torch.float32)
            if slot is None:
                raise RuntimeError("the arena is full: answered regions were not freed")
            slots.append(slot)
            entries.append(shard_pb2.Push(
                run_id=self.run_id, rank=0, incarnation=1, step=step, table=f"t{t}",
                shm=shard_pb2.ShmRefs(epoch=self.epoch, ids=slot.refs[0],
                                      grads=slot.refs[1], answer=slot.refs[2])))
        batch = shard_pb2.PushBatch(pushes=entries)
        return shard_pb2.SyncRequest(batch=batch), slots

    def free(self, slots: list[ShmSlot]) -> None:
        for slot in slots:
            self.arena.ring.free(slot.region)


def table_specs(tables: int, dim: int) -> list[TableSpec]:
    return [TableSpec(name=f"t{t}", num_rows=TABLE_ROWS, dim=dim, row_start=0,
                      row_end=TABLE_ROWS) for t in range(tables)]


# -- (a) in process ----------------------------------------------------------------------

def in_process_us(tables: int, rows: int, dim: int, per_round: int) -> list[float]:
    """µs per batch message of 7 rounds of `per_round` messages, the server's Python path."""
    store = Store()
    store.register("bench", 0, 1, 1, table_specs(tables, dim), SPEC)
    # every batch of a round is placed before any is answered
    arena = ClientArena(max(64 << 20, 2 * per_round * tables * region_bytes(rows, dim)),
                        rank=0)
    registry = ArenaRegistry()
    try:
        accepted, reason, epoch = registry.attach("bench", 0, arena.path, arena.size,
                                                  arena.nonce)
        if not accepted:
            raise RuntimeError(f"arena refused: {reason}")
        pushes = Pushes(arena, "bench", epoch, tables, rows, dim)
        return asyncio.run(_rounds(store, registry, pushes, per_round))
    finally:
        registry.close()
        arena.close()


async def _rounds(store: Store, registry: ArenaRegistry, pushes: Pushes,
                  per_round: int) -> list[float]:
    core = ShardCore(store)
    session = core.open_session()
    step, times = 0, []
    try:
        for _ in range(7):
            made = [pushes.batch(step + i) for i in range(per_round)]
            step += per_round
            data = [msg.SerializeToString() for msg, _ in made]
            start = time.perf_counter()
            for raw in data:  # what ShardServicer._read and Sync do with one message
                chunks = request_chunks(decode_request(raw), registry, store)
                for chunk in chunks:
                    session.received(chunk)
                answers = []
                for chunk in chunks:
                    answer = await core.feed(session, chunk)
                    assert answer is not None and isinstance(chunk.sink, ResolvedShmPush)
                    answers.append(shm_update(chunk.sink, answer))
                batch_message(answers)
            times.append((time.perf_counter() - start) / per_round * 1e6)
            for _, slots in made:
                pushes.free(slots)
    finally:
        session.close()
        core.shutdown()
    return times


# -- (b) a real server -------------------------------------------------------------------

def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def through_server(address: str, server_pid: int, tables: int, rows: int, dim: int,
                batches: int, gap_s: float) -> dict[str, float]:
    """Batches of shared-memory pushes on a gRPC Sync stream, one in flight."""
    arena = ClientArena(64 << 20, rank=0)
    run_id = f"bench-{os.getpid()}-{int(gap_s * 1e6)}"
    outbox: queue.Queue[shard_pb2.SyncRequest | None] = queue.Queue()

    def requests() -> Iterator[shard_pb2.SyncRequest]:
        while (msg := outbox.get()) is not None:
            yield msg

    with grpc.insecure_channel(address) as channel:
        stub = shard_pb2_grpc.ShardServiceStub(channel)
        response = stub.Register(shard_pb2.RegisterRequest(
            run_id=run_id, rank=0, world_size=1, incarnation=1,
            tables=[shard_pb2.TableSpec(name=t.name, num_rows=t.num_rows, dim=dim,
                                        row_start=0, row_end=t.num_rows)
                    for t in table_specs(tables, dim)],
            optimizer=optimizer_message(SPEC), shm=arena.offer()), timeout=60)
        if not response.shm.accepted:
            raise RuntimeError(f"the server refused the arena: {response.shm.reason}")
        pushes = Pushes(arena, run_id, response.shm.epoch, tables, rows, dim)
        answers = stub.Sync(requests(), metadata=partition_metadata(
            run_id, 0, response.partition_secret))

        def one(step: int) -> None:
            msg, slots = pushes.batch(step)
            outbox.put(msg)
            answered = len(next(answers).batch.updates)
            if answered != tables:
                raise RuntimeError(f"step {step}: {answered} answers, not {tables}")
            pushes.free(slots)

        warmup = 50
        for step in range(warmup):
            one(step)
        server0, client0, wall0 = (process_cpu_s(server_pid), time.process_time(),
                                   time.perf_counter())
        for step in range(warmup, warmup + batches):
            if gap_s:
                time.sleep(gap_s)
            one(step)
        server1, client1, wall1 = (process_cpu_s(server_pid), time.process_time(),
                                   time.perf_counter())
        outbox.put(None)
        answers.cancel()
    arena.close()
    return {"server_cpu_us": (server1 - server0) / batches * 1e6,
            "client_cpu_us": (client1 - client0) / batches * 1e6,
            "wall_us": (wall1 - wall0) / batches * 1e6 - gap_s * 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer batches (~20 s)")
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--rows", type=int, default=190, help="unique rows per table and push")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--gaps-ms", default="0,5", help="pauses between batches, comma list")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    for name in ("tables", "rows", "dim"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)} must be >= 1")
    gaps = [float(g) for g in args.gaps_ms.split(",") if g]
    if any(g < 0 for g in gaps):
        p.error(f"--gaps-ms {args.gaps_ms!r}: pauses must be >= 0")
    batches = 600 if args.quick else 2000
    shape = f"{args.tables} tables x {args.rows} rows x dim {args.dim}"

    local = in_process_us(args.tables, args.rows, args.dim, 100 if args.quick else 300)
    print(f"batch push of {shape}, by shared memory")
    print(f"(a) in process, server Python path: min {min(local):.0f} us, median "
          f"{statistics.median(local):.0f} us a batch")
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_push_cpu-") as tmp:
        server = Server(Path(tmp), [])
        try:
            for gap in gaps:
                results[f"{gap:g}"] = through_server(
                    server.address(), server.proc.pid, args.tables, args.rows, args.dim,
                    batches, gap / 1000)
        finally:
            server.close()
    print(f"(b) real server, the gRPC Sync stream, {batches} batches, one in flight")
    print(f"{'gap ms':>7} {'server CPU us':>14} {'client CPU us':>14} {'wall us':>9}")
    for gap_ms, r in results.items():
        print(f"{gap_ms:>7} {r['server_cpu_us']:>14.0f} {r['client_cpu_us']:>14.0f} "
              f"{r['wall_us']:>9.0f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        summary: dict[str, Any] = {
            "shape": {"tables": args.tables, "rows": args.rows, "dim": args.dim},
            "in_process_us": local, "through_server": results, "batches": batches,
            "loadavg": os.getloadavg()}
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
