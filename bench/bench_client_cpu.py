"""CPU a rank's ShardClient and its shard server spend per step, with and without the arena.

    python bench/bench_client_cpu.py                       # this checkout, ~1 min
    python bench/bench_client_cpu.py --root . --root ../other-checkout --repeats 2

One ShardClient (1 table of 1M x 64 rows, 10k unique rows a push, fp32) against a fresh
`python -m ps`, pushing and taking like the staleness window at K=1 with a 10 ms pause
a step (a step's compute), once per mode: shm (the tensors in the shared-memory arena,
their references on the gRPC Sync stream), inline (tensors in the gRPC messages). Prints
the client's CPU (every thread of this process: time.process_time) and the server's
(/proc) per step; the client runs in a child process per measurement so that each
checkout's code is imported alone. Several --root: the same, interleaved, per checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = {"shm": {"shm": "on"},
         "inline": {"shm": "off"}}


def child(root: Path, mode: str, steps: int) -> dict[str, float | str]:
    """Run in the child: the measurement itself, with `root`'s code."""
    sys.path.insert(0, str(root))
    import torch

    from hybridps.optim import OptimizerSpec
    from worker.embedding.rows import TableConfig
    from worker.sync.client import ShardClient

    torch.set_num_threads(1)  # like a torchrun rank (OMP_NUM_THREADS=1)

    def cpu_s(pid: int) -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    tmp = Path(tempfile.mkdtemp(prefix="bench_client_cpu-"))
    port_file = tmp / "ps.port"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    env["PYTHONPATH"] = str(root)
    server = subprocess.Popen([sys.executable, "-m", "ps", "--port", "0", "--port-file",
                               str(port_file), "--log-level", "WARNING"], cwd=root, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text().strip():
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("shard server did not start")
            time.sleep(0.05)
        client = ShardClient(f"127.0.0.1:{port_file.read_text().strip()}", run_id="bench",
                             rank=0, world_size=1, tables=[TableConfig("t0", 1_000_000, 64)],
                             ranges={"t0": (0, 1_000_000)}, optimizer=OptimizerSpec(),
                             timeout_s=60.0, max_chunk_bytes=4 << 20,
                             shm_bytes=256 << 20, **MODES[mode])  # type: ignore[arg-type]
        client.start()
        g = torch.Generator().manual_seed(0)
        pool = [(torch.randperm(1_000_000, generator=g)[:10_000].sort().values,
                 torch.randn(10_000, 64, generator=g)) for _ in range(8)]

        def step(s: int) -> None:
            ids, grads = pool[s % len(pool)]
            client.push(s, {"t0": (ids, grads)})
            if s >= 1:
                client.take(s - 1)

        warmup = 20
        for s in range(warmup):
            step(s)
        c0, s0, w0 = time.process_time(), cpu_s(server.pid), time.perf_counter()
        for s in range(warmup, warmup + steps):
            step(s)
            time.sleep(0.01)
        c1, s1, w1 = time.process_time(), cpu_s(server.pid), time.perf_counter()
        client.take(warmup + steps - 1)
        client.close()
        return {"client_ms": (c1 - c0) / steps * 1e3, "server_ms": (s1 - s0) / steps * 1e3,
                "wall_ms": (w1 - w0) / steps * 1e3 - 10.0,
                "transport": client.stats.transport}
    finally:
        server.terminate()
        server.wait(30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--root", type=Path, action="append",
                   help="a checkout to measure (default: this one); repeat to compare")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        root, mode = args.child
        print(json.dumps(child(Path(root), mode, args.steps)))
        return 0
    roots = [r.resolve() for r in (args.root or [REPO])]
    print(f"{'root':<28} {'mode':<7} {'client CPU ms':>14} {'server CPU ms':>14} "
          f"{'wall ms':>8}  (per step, {args.steps} steps)")
    for _ in range(args.repeats):
        for mode in MODES:
            for root in roots:
                out = subprocess.run([sys.executable, __file__, "--steps", str(args.steps),
                                      "--child", str(root), mode], capture_output=True,
                                     text=True, check=True, cwd=root)
                r = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"{str(root)[-28:]:<28} {mode:<7} {r['client_ms']:>14.2f} "
                      f"{r['server_ms']:>14.2f} {r['wall_ms']:>8.2f}", flush=True)
    print("load: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
