"""The shard server over the wire against the in-process kernel and a raw socket echo.

    python bench/bench_wire.py                   # full run: fp32+bf16, TCP + shm
    python bench/bench_wire.py --quick           # dim 64, 2 batch sizes, fp32, TCP + shm
    python bench/bench_wire.py --json runs/bench_wire.json
    python bench/bench_wire.py --wire-dtype bf16 --transport tcp --dims 128
    python bench/bench_wire.py --quick --transport tcp,shm   # shared memory vs TCP

Side by side in one run, for each dim (64, 128) and batch of unique rows (4k, 16k, 64k):
  (a) kernel: the sparse-Adam step of hybridps.optim.apply_rows_ in this process (the native
      kernel when built, on hybridps.state_alloc.alloc_state tables, reused output buffer), at the
      server's kernel thread count, with the same validation the server does per push
      (range, duplicates, finiteness) left out: the kernel alone, the bar to reach;
  (b) wire: push -> update through a real Sync stream against a real `python -m ps`
      (started on port 0), with the real client (worker/sync/client.py ShardClient: chunking,
      the wire codec, the gRPC stream's loop thread; one torch thread, like a torchrun
      rank), keeping --window pushes in flight; rows/s =
      rows answered / wall time. --transport shm: the same-node shared-memory data
      plane (--shm on: ids and gradients copied into the arena, the answer written
      there by the server, the messages only headers, sent over the server's Sync
      socket);
  (c) the stream's bytes/s: push bytes out + update bytes back, over the same wall time
      (shm: the tensor bytes the messages would have carried, ids + gradients out and
      ids + delta back, so the ratio compares the same payload);
  (d) echo: a raw socket echo server in another process (plain Python sockets; recv_into
      + sendall), the client sending messages of the wire's message size from one
      thread while another reads the echo back; bytes/s counted the same way (out + back).
Ratios: wire rows/s / kernel rows/s (goal >= 0.7) and wire bytes/s / TCP echo bytes/s
(goal >= 0.7). The message size of a batch is min(push size, --max-chunk-bytes); with
--wire-dtype bf16 a row is 8 + 2*dim bytes each way instead of 8 + 4*dim, so rows/s can
rise while bytes/s falls. The server holds one partition (m, v) per dim, dtype and
transport: ~2 * 4 * table_rows * dim bytes each.
The table has --table-rows rows (the same for the kernel and the server). Absolute
numbers on a shared 2-core machine drift; the ratios are measured back to back.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

import hybridps.optim as optim  # noqa: E402
import hybridps.state_alloc as state_alloc  # noqa: E402
from hybridps.optim import OptimizerSpec  # noqa: E402

GOAL_ROWS = 0.7
GOAL_BYTES = 0.7
SPEC = OptimizerSpec("adam", lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
WIRE_ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
STARTUP_TIMEOUT_S = 60.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Row:
    transport: str
    dim: int
    batch: int
    wire_dtype: str
    message_bytes: int
    kernel_rows_per_s: float
    wire_rows_per_s: float
    wire_bytes_per_s: float
    echo_bytes_per_s: float
    wire_steps: int
    rows_ratio: float
    bytes_ratio: float


class Batches:
    """Unique sorted row ids (slices of a random permutation) and gradients, made up front."""

    def __init__(self, rows: int, dim: int, batch: int, count: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        need = min(rows, batch * count)
        perm = torch.randperm(rows, generator=g)[:need]
        self.ids = [perm[i:i + batch].sort().values
                    for i in range(0, max(need - batch + 1, 1), batch)][:count]
        self.grads = [torch.randn(batch, dim, generator=g) * 1e-2 for _ in self.ids]

    def __len__(self) -> int:
        return len(self.ids)


# -- (a) the kernel in this process -----------------------------------------------------

def kernel_rate(rows: int, dim: int, batch: int, seconds: float, threads: int) -> float:
    # m and v as the server allocates them
    m = state_alloc.alloc_state(rows, dim, offset=state_alloc.STATE_OFFSETS["m"])
    v = state_alloc.alloc_state(rows, dim, offset=state_alloc.STATE_OFFSETS["v"])
    data = Batches(rows, dim, batch, 8, seed=dim + batch)
    out = torch.empty(batch, dim)
    step = 0

    def call(i: int) -> None:
        nonlocal step
        step += 1
        optim.apply_rows_(SPEC, m, v, data.ids[i % len(data)], data.grads[i % len(data)],
                          step, out=out, num_threads=threads)

    for i in range(3):
        call(i)
    done, t0 = 0, time.perf_counter()
    while True:
        call(done)
        done += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds and done >= 3:
            break
    return done * batch / elapsed


# -- (b, c) the wire -------------------------------------------------------------------

class Server:
    """`python -m ps` on port 0, like tests/helpers.start_ps_server."""

    def __init__(self, directory: Path, extra: list[str]) -> None:
        port_file = directory / "ps.port"
        args = [sys.executable, "-m", "ps", "--host", "127.0.0.1", "--port", "0",
                "--port-file", str(port_file), "--log-level", "WARNING", *extra]
        self.stderr_path = directory / "ps.stderr"
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("shard server did not start:\n"
                                   + self.stderr_path.read_text(errors="replace"))
            time.sleep(0.05)
        self.port = int(port_file.read_text().strip())

    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def wire_rates(address: str, rows: int, dim: int, batches: list[int], seconds: float,
               window: int, max_chunk_bytes: int, wire_dtype: str, shm: bool = False
               ) -> dict[int, tuple[float, float, int]]:
    """{batch: (rows/s, bytes/s out+back, steps)} through one ShardClient stream."""
    from worker.embedding.rows import TableConfig
    from worker.sync.arena import region_bytes
    from worker.sync.client import WIRE_DTYPES, ShardClient

    kwargs: dict[str, Any] = {"wire_dtype": WIRE_DTYPES[wire_dtype]}
    if shm:  # room for every push in flight (window + the one being made + the taken)
        dtype = WIRE_DTYPES[wire_dtype]  # gradients out, deltas back
        per_push = region_bytes(max(batches), dim, dtype, dtype)
        kwargs.update(shm="on", shm_bytes=max(64 << 20, (window + 4) * per_push))
    client = ShardClient(address, run_id=f"bench-{uuid.uuid4().hex[:8]}", rank=0,
                         world_size=1, tables=[TableConfig("t", rows, dim)],
                         ranges={"t": (0, rows)}, optimizer=SPEC, timeout_s=120.0,
                         max_chunk_bytes=max_chunk_bytes, **kwargs)
    client.start()
    out: dict[int, tuple[float, float, int]] = {}
    step = 0
    # The client copies like a torchrun rank (OMP_NUM_THREADS=1): torch's intra-op pool
    # would split a large copy and spin-wait after it, on the cores the server runs on.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for batch in batches:
            data = Batches(rows, dim, batch, 8, seed=dim * 7 + batch)

            def push(i: int, data: Batches = data) -> None:
                nonlocal step
                client.push(step, {"t": (data.ids[i % len(data)], data.grads[i % len(data)])})
                step += 1

            for i in range(2):  # warm-up: connection, first allocations
                push(i)
            client.take(step - 1)
            first = step
            bytes_up0 = client.stats.push_bytes
            bytes_down = 0
            t0 = time.perf_counter()
            i = 0
            taken = first - 1
            while True:
                push(i)
                i += 1
                if step - 1 - taken >= window:
                    updates, _ = client.take(step - 1 - window)
                    taken = step - 1 - window
                    bytes_down += sum(update_bytes(u.ids_U, u.delta_UD, wire_dtype)
                                      for u in updates)
                if time.perf_counter() - t0 >= seconds and i >= 3:
                    break
            updates, _ = client.take(step - 1)
            bytes_down += sum(update_bytes(u.ids_U, u.delta_UD, wire_dtype) for u in updates)
            elapsed = time.perf_counter() - t0
            steps = step - first
            up = client.stats.push_bytes - bytes_up0
            if shm:
                if client.stats.shm_pushes != step or client.stats.shm_inline_pushes:
                    raise RuntimeError(f"shm: {client.stats.shm_pushes} of {step} pushes by "
                                       f"reference ({client.stats.shm}): not measuring shm")
                up = steps * batch * (8 + dim * WIRE_ITEMSIZE[wire_dtype])
            out[batch] = (steps * batch / elapsed, (up + bytes_down) / elapsed, steps)
    finally:
        torch.set_num_threads(threads)
        client.close()
    return out


def update_bytes(ids: torch.Tensor, delta: torch.Tensor, wire_dtype: str) -> int:
    return ids.numel() * 8 + delta.numel() * WIRE_ITEMSIZE[wire_dtype]


def push_message_bytes(batch: int, dim: int, wire_dtype: str, max_chunk_bytes: int) -> int:
    return min(batch * (8 + dim * WIRE_ITEMSIZE[wire_dtype]) + 128, max_chunk_bytes)


# -- (d) raw socket echo in another process ---------------------------------------------

def echo_server_main(port_file: str) -> int:
    """`--echo-server PORT_FILE`: echo every connection's bytes back until it closes."""
    srv = socket.create_server(("127.0.0.1", 0))
    tmp = port_file + ".tmp"
    Path(tmp).write_text(str(srv.getsockname()[1]))
    os.replace(tmp, port_file)
    while True:
        conn, _ = srv.accept()
        buf = bytearray(8 << 20)
        view = memoryview(buf)
        with conn:
            while True:
                n = conn.recv_into(view)
                if n == 0:
                    break
                conn.sendall(view[:n])


class EchoServer:
    def __init__(self, directory: Path) -> None:
        port_file = directory / "echo.port"
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()),
                                      "--echo-server", str(port_file)], cwd=REPO)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("echo server did not start")
            time.sleep(0.02)
        self.port = int(port_file.read_text())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def echo_rate(port: int, message_bytes: int, seconds: float) -> float:
    """Bytes/s out + back of a pipelined echo of `message_bytes` messages."""
    payload = memoryview(os.urandom(min(message_bytes, 1 << 20)) * max(
        1, -(-message_bytes // (1 << 20))))[:message_bytes]
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    stop = threading.Event()
    sent = [0]

    def sender() -> None:
        while not stop.is_set():
            sock.sendall(payload)
            sent[0] += message_bytes
        sock.shutdown(socket.SHUT_WR)

    buf = memoryview(bytearray(8 << 20))
    received = 0
    t = threading.Thread(target=sender, daemon=True)
    t0 = time.perf_counter()
    t.start()
    while time.perf_counter() - t0 < seconds:
        n = sock.recv_into(buf)
        if n == 0:
            break
        received += n
    elapsed = time.perf_counter() - t0
    got_at_stop = received
    stop.set()
    while sock.recv_into(buf):  # drain until the echo of what was sent has come back
        pass
    t.join()
    sock.close()
    # Out + back over the same wall time: what was echoed back counts twice.
    return 2 * got_at_stop / elapsed


# -- main -------------------------------------------------------------------------------

def table(rows: list[Row]) -> str:
    head = (f"{'transport':>9} {'dim':>4} {'batch':>6} {'wire':>5} {'msg MiB':>8} "
            f"{'kernel Mrow/s':>13} {'wire Mrow/s':>11} {'wire/kernel':>11} "
            f"{'wire GB/s':>9} {'echo GB/s':>9} {'wire/echo':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.transport:>9} {r.dim:>4} {r.batch:>6} {r.wire_dtype:>5} "
            f"{r.message_bytes / 2**20:>8.2f} {r.kernel_rows_per_s / 1e6:>13.2f} "
            f"{r.wire_rows_per_s / 1e6:>11.2f} {r.rows_ratio:>11.2f} "
            f"{r.wire_bytes_per_s / 1e9:>9.2f} {r.echo_bytes_per_s / 1e9:>9.2f} "
            f"{r.bytes_ratio:>9.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true",
                   help="dim 64, batches 4k and 64k, fp32, shorter windows")
    p.add_argument("--dims", default="64,128")
    p.add_argument("--batches", default="4096,16384,65536")
    p.add_argument("--table-rows", type=int, default=1 << 19,
                   help="rows of the table (kernel and server alike; the server holds one "
                        "partition per dim x dtype x transport)")
    p.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    p.add_argument("--window", type=int, default=2,
                   help="pushes in flight on the stream (like --staleness)")
    p.add_argument("--max-chunk-bytes", type=int, default=4 << 20,
                   help="the worker's --max-chunk-bytes")
    p.add_argument("--wire-dtype", default="fp32,bf16",
                   help="comma list of the worker's --wire-dtype values: fp32 | bf16 | fp16")
    p.add_argument("--transport", default="tcp,shm",
                   help="comma list of tcp | shm (TCP with the shared-memory data plane)")
    p.add_argument("--kernel-threads", type=int, default=0,
                   help="threads of the in-process kernel and the server's --kernel-threads "
                        "(0: the server's default)")
    p.add_argument("--server-args", default="", help="extra `python -m ps` flags")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--echo-server", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.echo_server:
        return echo_server_main(args.echo_server)
    if args.quick:
        args.dims, args.batches, args.seconds = "64", "4096,65536", 1.5
        args.wire_dtype = args.wire_dtype.split(",")[0]
    dims = [int(x) for x in args.dims.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    transports = [t.strip() for t in args.transport.split(",")]
    for t in transports:
        if t not in ("tcp", "shm"):
            raise SystemExit(f"--transport {t!r}: must be tcp or shm")
    dtypes = [d.strip() for d in args.wire_dtype.split(",")]
    for d in dtypes:
        if d not in WIRE_ITEMSIZE:
            raise SystemExit(f"--wire-dtype {d!r}: must be one of {', '.join(WIRE_ITEMSIZE)}")
    threads = args.kernel_threads or optim.default_kernel_threads()
    started = time.perf_counter()
    load_before = os.getloadavg()
    info = optim.kernel_info()
    log(f"kernel: {info}; kernel threads {threads}")
    server_extra = [*args.server_args.split(), "--kernel-threads", str(threads)]
    results: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-wire-") as tmp:
        directory = Path(tmp)
        server = Server(directory, server_extra)
        echo = EchoServer(directory)
        try:
            echo_cache: dict[int, float] = {}  # message bytes -> echo bytes/s
            for dim in dims:
                kernel = {b: kernel_rate(args.table_rows, dim, b, args.seconds, threads)
                          for b in batches}
                log(f"dim {dim} kernel rows/s: {kernel}")
                for dtype, transport in itertools.product(dtypes, transports):
                    wire = wire_rates(server.address(), args.table_rows, dim, batches,
                                      args.seconds, args.window, args.max_chunk_bytes, dtype,
                                      shm=transport == "shm")
                    log(f"dim {dim} {transport} {dtype} wire: {wire}")
                    for b in batches:
                        size = push_message_bytes(b, dim, dtype, args.max_chunk_bytes)
                        if size not in echo_cache:
                            echo_cache[size] = echo_rate(echo.port, size,
                                                         min(args.seconds, 1.5))
                        echo_bps = echo_cache[size]
                        w_rows, w_bytes, steps = wire[b]
                        results.append(Row(transport, dim, b, dtype, size, kernel[b],
                                           w_rows, w_bytes, echo_bps, steps,
                                           w_rows / kernel[b], w_bytes / echo_bps))
        finally:
            echo.close()
            server.close()
    load_after = os.getloadavg()
    elapsed = time.perf_counter() - started
    print(f"kernel: {info['kernel']} ({threads} threads); table {args.table_rows} rows; "
          f"window {args.window}; max chunk {args.max_chunk_bytes} bytes; bytes/s = out + back")
    print(table(results))
    rows_met = all(r.rows_ratio >= GOAL_ROWS for r in results)
    bytes_met = all(r.bytes_ratio >= GOAL_BYTES for r in results)
    for transport in transports:
        mine = [r for r in results if r.transport == transport]
        worst_rows, worst_bytes = (min(r.rows_ratio for r in mine),
                                   min(r.bytes_ratio for r in mine))
        print(f"{transport}: goal wire/kernel rows/s >= {GOAL_ROWS}: worst {worst_rows:.2f} "
              f"{'met' if worst_rows >= GOAL_ROWS else 'NOT met'}; goal wire/echo bytes/s "
              f">= {GOAL_BYTES}: worst {worst_bytes:.2f} "
              f"{'met' if worst_bytes >= GOAL_BYTES else 'NOT met'}")
    print(f"load average {load_before[0]:.2f} -> {load_after[0]:.2f}; {elapsed:.0f}s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "kernel": info, "kernel_threads": threads,
            "goal": {"rows_ratio": GOAL_ROWS, "bytes_ratio": GOAL_BYTES,
                     "rows_met": rows_met, "bytes_met": bytes_met},
            "results": [asdict(r) for r in results],
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                        "torch": torch.__version__, "loadavg_before": load_before,
                        "loadavg_after": load_after},
            "args": {k: str(v) for k, v in vars(args).items()},
            "elapsed_s": elapsed,
        }, indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
