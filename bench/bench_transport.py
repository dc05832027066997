"""End-to-end training throughput with and without the shared-memory arena.

    python bench/bench_transport.py                      # 3 interleaved repeats (~5 min)
    python bench/bench_transport.py --repeats 5 --steps 400 --json runs/bench/transport.json
    python bench/bench_transport.py --root . --root ../other-checkout   # two checkouts

The "20-ids job" (`--task tables --tables t0:1000000:20 --dim 64 --batch-size 1024
--staleness 1`: one 1M x 64 table, 20 ids a sample, batch 1024 per rank) on 2 gloo ranks
(torchrun, OMP_NUM_THREADS=1 each) against a fresh `python -m ps` per run, once per
variant, the Sync messages on the gRPC stream in both:
  shm:    the tensors in the shared-memory arena, the messages carry references
          (--same-node require);
  inline: no shared memory, the tensors inside the gRPC messages (--same-node off).
The variants run interleaved (shm, inline, shm, ...) so that a change in
the machine's load hits them alike; the table gives each variant's median samples/s
(the worker's `samples_per_s`: training steps only, set-up excluded), its spread and
the ratios of the medians, with the load average before and after. With several
--root, every checkout runs every variant, interleaved too (a before/after comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
JOB = ["--task", "tables", "--tables", "t0:1000000:20", "--dim", "64", "--batch-size", "1024",
       "--staleness", "1"]
# The worker flags of each variant (the same-node flags of worker/config/train_config.py).
VARIANTS: dict[str, list[str]] = {
    "shm": ["--same-node", "require"],
    "inline": ["--same-node", "off"],
}
WORLD = 2
STARTUP_TIMEOUT_S = 60.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def start_server(root: Path, directory: Path, env: dict[str, str]
                 ) -> tuple[subprocess.Popen[bytes], str]:
    port_file = directory / "ps.port"
    port_file.unlink(missing_ok=True)
    with open(directory / "ps.log", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ps", "--host", "127.0.0.1",
                                 "--port", "0", "--port-file", str(port_file)],
                                cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not port_file.exists() or not port_file.read_text().strip():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError(f"shard server did not start; see {directory / 'ps.log'}")
        time.sleep(0.05)
    return proc, f"127.0.0.1:{port_file.read_text().strip()}"


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_once(root: Path, variant: str, steps: int, directory: Path,
             extra: list[str]) -> dict[str, Any]:
    directory.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(root))
    server, address = start_server(root, directory, env)
    results = directory / "results.json"
    try:
        cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone",
               "--nproc_per_node", str(WORLD), str(root / "worker" / "main.py"),
               "--ps", address, *JOB, *VARIANTS[variant], "--steps", str(steps),
               "--progress", "false", "--eval-batches", "1", "--log-every", "100",
               "--results", str(results), *extra]
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                              check=False, timeout=1800)
        (directory / "worker.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise RuntimeError(f"{variant} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    finally:
        stop(server)
    res = json.loads(results.read_text())
    sync = res.get("sync", {})
    if variant != "inline" and sync.get("shm") != "on":
        raise RuntimeError(f"{variant}: shared memory was not used ({sync.get('shm')})")
    if sync.get("transport", "stream") != "stream":
        raise RuntimeError(f"{variant}: ran over {sync.get('transport')}, not the stream")
    return {"samples_per_s": float(res["samples_per_s"]),
            "step_ms": res["train_time_s"] / res["steps"] * 1000}


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True,
                              check=False).stdout.strip()
    except OSError:
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--root", type=Path, action="append",
                   help="a checkout whose worker and server run (default: this one); "
                        "repeat to compare checkouts")
    p.add_argument("--json", type=Path, help="write the runs here")
    p.add_argument("worker_args", nargs="*", help="extra worker flags, after --")
    args = p.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in VARIANTS:
            p.error(f"--variants: {v!r} is not one of {', '.join(VARIANTS)}")
    if args.repeats < 1 or args.steps < 1:
        p.error("--repeats and --steps must be >= 1")
    roots = [r.resolve() for r in (args.root or [REPO])]
    labels = {root: f"r{i}" if len(roots) > 1 else "" for i, root in enumerate(roots)}
    cells = [(root, v) for v in variants for root in roots]
    names = {cell: f"{labels[cell[0]]}:{cell[1]}".lstrip(":") for cell in cells}
    load_before = uptime()
    log(f"before: {load_before}")
    runs: dict[str, list[dict[str, Any]]] = {names[c]: [] for c in cells}
    with tempfile.TemporaryDirectory(prefix="bench_transport-") as tmp:
        for repeat in range(args.repeats):
            for root, v in cells:
                name = names[(root, v)]
                got = run_once(root, v, args.steps,
                               Path(tmp) / f"{name.replace(':', '-')}-{repeat}",
                               args.worker_args)
                log(f"repeat {repeat + 1} {name}: {got['samples_per_s']:.0f} samples/s")
                runs[name].append(got)
    load_after = uptime()
    medians = {n: statistics.median(r["samples_per_s"] for r in runs[n]) for n in runs}
    print(f"20-ids job, {args.steps} steps, {args.repeats} interleaved repeats")
    for root in roots:
        print(f"  {labels[root] or 'root'}: {root}")
    print(f"{'variant':<10} {'median samples/s':>17} {'min':>8} {'max':>8} {'step ms':>8}")
    for name, done in runs.items():
        rates = [r["samples_per_s"] for r in done]
        step_ms = statistics.median(r["step_ms"] for r in done)
        print(f"{name:<10} {medians[name]:>17.0f} {min(rates):>8.0f} {max(rates):>8.0f} "
              f"{step_ms:>8.2f}")
    for root in roots:
        base = names[(root, variants[-1])]
        for v in variants[:-1]:
            name = names[(root, v)]
            print(f"{name} / {base}: {medians[name] / medians[base]:.3f}")
    print(f"load before: {load_before}")
    print(f"load after:  {load_after}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"roots": [str(r) for r in roots],
                                         "steps": args.steps,
                                         "runs": runs, "medians": medians,
                                         "load_before": load_before,
                                         "load_after": load_after}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
