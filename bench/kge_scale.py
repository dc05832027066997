"""KGE scale check: a planted graph of millions of entities (--task kge_planted) on 2 ranks +
a shard server: samples/s, peak memory per rank and of the server, evaluation time over all
entities, and the test MRR against the planted ceiling.

    python bench/kge_scale.py --entities 5000000 --dim 64 --steps 1500 --out runs/kge_scale

Starts `python -m ps` on a free port and `torchrun --nproc_per_node 2 worker/main.py --task
kge_planted`, samples VmHWM/VmRSS of the server and of both ranks every second, and prints one
JSON line plus a markdown row. Rows: N x D x 4 bytes over the ranks; Adam state (m, v):
2 x that on the server (`worker/main.py --plan` prints the same sizing before anything runs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def _status_kb(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


class PeakSampler(threading.Thread):
    """Peak resident memory of named processes (VmHWM, kept after a process exits)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.pids: dict[str, int] = {}
        self.peak_kb: dict[str, int] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            for name, pid in list(self.pids.items()):
                hwm = max(_status_kb(pid, "VmHWM"), _status_kb(pid, "VmRSS"))
                self.peak_kb[name] = max(self.peak_kb.get(name, 0), hwm)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--entities", type=int, default=5_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch-size", type=int, default=4096, help="per rank")
    ap.add_argument("--neg-ratio", type=int, default=16)
    ap.add_argument("--model", default="distmult")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--community", type=int, default=8, help="--planted-community")
    ap.add_argument("--relations", type=int, default=16, help="--planted-relations")
    ap.add_argument("--test", type=int, default=1000, help="--planted-test triples")
    ap.add_argument("--out", default="runs/kge_scale")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port_file = out / "ps.port"
    port_file.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    sampler = PeakSampler()
    sampler.start()
    server = subprocess.Popen([sys.executable, "-m", "ps", "--host", "127.0.0.1", "--port", "0",
                               "--port-file", str(port_file)], cwd=REPO, env=env,
                              stdout=(out / "ps.log").open("w"), stderr=subprocess.STDOUT)
    sampler.pids["server"] = server.pid
    try:
        for _ in range(300):
            if port_file.exists() and port_file.read_text().strip():
                break
            time.sleep(0.1)
        address = f"127.0.0.1:{port_file.read_text().strip()}"
        results = out / "results.json"
        cmd = [TORCHRUN, "--standalone", "--nproc_per_node", "2", str(REPO / "worker/main.py"),
               "--ps", address, "--task", "kge_planted", "--num-rows", str(args.entities),
               "--dim", str(args.dim), "--steps", str(args.steps), "--batch-size",
               str(args.batch_size), "--neg-ratio", str(args.neg_ratio), "--model", args.model,
               "--lr", str(args.lr), "--dense-lr", str(args.lr), "--init-std", "0.1",
               "--staleness", "1", "--log-every", "50", "--progress", "false",
               "--planted-community", str(args.community), "--planted-relations",
               str(args.relations), "--planted-test", str(args.test), "--keep-best", "false",
               "--results", str(results)]
        t0 = time.perf_counter()
        worker = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=(out / "worker.log").open("w"),
                                  stderr=subprocess.STDOUT)
        while worker.poll() is None:
            ranks = _children(worker.pid)
            for i, pid in enumerate(ranks[:2]):
                sampler.pids.setdefault(f"rank{i}", pid)
            time.sleep(0.5)
        wall = time.perf_counter() - t0
        if worker.returncode != 0:
            raise SystemExit(f"worker failed ({worker.returncode}): see {out / 'worker.log'}")
    finally:
        time.sleep(1.5)
        sampler.stop.set()
        server.terminate()
        server.wait(30)
    res = json.loads(results.read_text())
    task = res["task"]
    report = {
        "entities": task["entities"], "dim": args.dim, "steps": res["steps"],
        "samples_per_s": round(res["samples_per_s"]), "train_s": round(res["train_time_s"], 1),
        "wall_s": round(wall, 1), "eval_s": round(res["final_eval_time_s"], 1),
        "test_mrr": res["eval"]["test_mrr"], "test_hits@10": res["eval"]["test_hits@10"],
        "mrr_ceiling": task["mrr_ceiling"], "mrr_chance": task["mrr_chance"],
        "peak_rss_gib": {k: round(v / 2**20, 2) for k, v in sampler.peak_kb.items()},
        "load_avg": os.getloadavg(),
    }
    (out / "scale.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    print("| entities | dim | steps | samples/s | train s | eval s | test MRR (ceiling) | "
          "peak GiB rank0 / rank1 / server |")
    peaks = report["peak_rss_gib"]
    print(f"| {report['entities']:,} | {args.dim} | {report['steps']} | "
          f"{report['samples_per_s']} | {report['train_s']} | {report['eval_s']} | "
          f"{report['test_mrr']:.3f} ({report['mrr_ceiling']:.3f}) | "
          f"{peaks.get('rank0')} / {peaks.get('rank1')} / {peaks.get('server')} |")


if __name__ == "__main__":
    main()
