"""Fault campaign: torn and bit-flipped checkpoints at many files and offsets.

    python campaigns/fault_campaign.py --quick            # ~2 min: 120 damages, 1 resumed run
    python campaigns/fault_campaign.py                    # 1000 damages, 4 resumed runs
    python campaigns/fault_campaign.py --json runs/fault_campaign.json

A real run writes the checkpoints: a shard server (port 0) and 2 torchrun ranks, 15
steps with a checkpoint every 5 (steps 4, 9, 14), plus an uninterrupted 20-step run
whose final state is the reference. Then each trial damages ONE file of the newest
checkpoint (step 14), chosen at random among every file its manifest lists and the
manifest itself, in one of these ways, at a random offset:
  flip      1 to 64 bits flipped (the size stays the same)
  torn      truncated (a write that stopped part way)
  zeros     a range overwritten with zeros (a lost page)
  missing   the file removed (the manifest removed: a torn checkpoint, skipped unnamed)
and checks both sides:
  worker    the resume selection (every file against the manifest, as
            worker/checkpoint/resume.py resume_target does) must pick step 9, the previous
            intact checkpoint, and name the damaged file;
  server    a Register with restore of step 14 for each rank must either be refused with
            the partition exactly as before (its m, v, counters), or succeed only when
            the damaged file is one the server does not read (rows, pending, dense).
A trial that loads anything from a damaged file, or leaves a partition changed after a
refusal, is a failure ("mixed state"). Finally a few trials resume the workers for real
(`--resume`, 2 ranks) from a damaged copy and compare the final rows and dense weights
with the uninterrupted run, bitwise. Exit code 0 only when every trial passed.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from campaign_tools import end_campaign  # noqa: E402  (campaigns/ is sys.path[0])

from hybridps.checkpoint import (  # noqa: E402
    MANIFEST,
    complete_checkpoints,
    manifest_entries,
    read_manifest,
    step_dir,
    verify_files,
)
from hybridps.errors import ShardError  # noqa: E402
from hybridps.optim import OptimizerSpec  # noqa: E402
from hybridps.run_secret import read_secret  # noqa: E402
from ps.core.partition import TableSpec  # noqa: E402
from ps.core.store import Store  # noqa: E402

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
MAIN = str(ROOT / "worker" / "main.py")
COMMON = ["--num-rows", "2000", "--dim", "8", "--log-every", "5", "--eval-batches", "1",
          "--progress", "false", "--staleness", "1", "--batch-size", "48",
          "--checkpoint-every", "5"]
DAMAGES = ("flip", "torn", "zeros", "missing")
SERVER_READS = ("optim/", MANIFEST)  # what a server restore reads (fp32 rows: no rows/)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


class Server:
    def __init__(self, work: Path) -> None:
        port_file = work / "ps.port"
        self.log = open(work / "ps.log", "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ps", "--host", "127.0.0.1", "--port", "0", "--port-file",
             str(port_file), "--checkpoint-root", str(work)], cwd=ROOT, env=_env(),
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {(work / 'ps.log').read_text()}")
            time.sleep(0.05)
        self.address = f"127.0.0.1:{port_file.read_text().strip()}"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def _worker(args: list[str], log: Path) -> subprocess.CompletedProcess[str]:
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node", "2", MAIN, *COMMON, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=600, check=False)
    log.write_text(proc.stdout + proc.stderr)
    return proc


def _damage(path: Path, kind: str, rng: random.Random) -> str:
    size = path.stat().st_size
    if kind == "missing":
        path.unlink()
        return "removed"
    data = bytearray(path.read_bytes())
    if kind == "torn":
        cut = rng.randrange(0, size)
        path.write_bytes(bytes(data[:cut]))
        return f"truncated at {cut} of {size}"
    if kind == "zeros":
        at = rng.randrange(0, size)
        n = rng.randint(1, 4096)
        before = bytes(data[at:at + n])
        data[at:at + n] = bytes(len(before))
        if bytes(data[at:at + n]) == before:  # already zeros: flip one bit instead
            data[at] ^= 1
        path.write_bytes(bytes(data))
        return f"zeros at {at}+{len(before)}"
    at = rng.randrange(0, size)
    bits = rng.randint(1, 64)
    for _ in range(bits):
        pos = min(size - 1, at + rng.randrange(0, 8))
        data[pos] ^= 1 << rng.randrange(8)
    if bytes(data) == path.read_bytes():  # flips cancelled out
        data[at] ^= 1
    path.write_bytes(bytes(data))
    return f"{bits} bits flipped near {at}"


def _select(root: Path) -> tuple[int | None, str]:
    """The resume selection of worker/checkpoint/resume.py, in one process: newest intact."""
    problems = []
    for step, directory in reversed(complete_checkpoints(root)):
        try:
            verify_files(directory, read_manifest(directory))
        except (ShardError, OSError, ValueError) as exc:
            problems.append(str(exc))
            continue
        return step, "; ".join(problems)
    return None, "; ".join(problems)


def _reads_same(directory: Path, manifest: dict[str, Any]) -> bool:
    """The damaged manifest still reads as the same content (a benign change)."""
    try:
        return read_manifest(directory) == manifest
    except (ShardError, OSError, ValueError):
        return False


def _snapshot(store: Store, run: str) -> list[tuple[Any, ...]]:
    out = []
    for p in sorted(store.partitions(), key=lambda p: p.rank):
        if p.run_id != run:
            continue
        for name, t in sorted(p.tables.items()):
            out.append((p.rank, p.incarnation, name, t.adam_step, t.last_step,
                        None if t.m is None else t.m.clone(),
                        None if t.v is None else t.v.clone()))
    return out


def _same(a: list[tuple[Any, ...]], b: list[tuple[Any, ...]]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x[:5] != y[:5] or not all(
                (p is None and q is None) or (p is not None and q is not None
                                              and torch.equal(p, q))
                for p, q in zip(x[5:], y[5:], strict=True)):
            return False
    return True


def _server_side(trial: Path, damaged: str, manifest: dict[str, Any],
                 store: Store, run: str, secret: str) -> str:
    """Restore step 14 for every rank from the damaged copy on a store that holds the
    run at step 9: 'refused', 'restored' (the damaged file is not the server's) or a
    failure description."""
    spec = OptimizerSpec(**manifest["optimizer"])
    reads = damaged.startswith(SERVER_READS)
    for rank in range(int(manifest["world_size"])):
        tables = [TableSpec(name, int(t["num_rows"]), int(t["dim"]),
                            int(t["shards"][rank]["row_start"]),
                            int(t["shards"][rank]["row_end"]))
                  for name, t in manifest["tables"].items()]
        before = _snapshot(store, run)
        incarnation = 1000 + rank
        try:
            store.register(run, rank, int(manifest["world_size"]), incarnation, tables, spec,
                           restore=(str(trial), 14), run_secret=secret)
        except ShardError:
            if not _same(before, _snapshot(store, run)):
                return "MIXED: a refused restore changed the partitions"
            continue
        if reads and damaged.startswith("optim/") and f".r{rank:05d}." in damaged:
            return f"LOADED a damaged file: {damaged}"
        if damaged == MANIFEST:
            return "LOADED from a damaged manifest"
    return "refused" if reads else "restored"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="120 damages, 1 resumed run")
    parser.add_argument("--trials", type=int, default=0, help="damages (default 1000)")
    parser.add_argument("--resumes", type=int, default=0, help="resumed runs (default 4)")
    parser.add_argument("--seed", type=int, default=23)
    parser.add_argument("--dir", default="", help="work directory (default: a temp dir)")
    parser.add_argument("--json", default="", help="write the figures here")
    args = parser.parse_args(argv)
    trials = args.trials or (120 if args.quick else 1000)
    resumes = args.resumes or (1 if args.quick else 4)
    rng = random.Random(args.seed)
    work = Path(args.dir or tempfile.mkdtemp(prefix="hybridps-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    server = Server(work)
    try:
        for name, steps, extra in (("straight", 20, ["--dump-state", str(work / "ref.pt")]),
                                   ("first", 15, [])):
            proc = _worker(["--ps", server.address, "--run-id", f"faults-{name}",
                            "--steps", str(steps), "--checkpoint-dir", str(work / name),
                            *extra], work / f"{name}.log")
            if proc.returncode != 0:
                print(proc.stderr[-4000:], file=sys.stderr)
                return 1
        source = work / "first"
        assert [s for s, _ in complete_checkpoints(source)] == [4, 9, 14]
        newest = step_dir(source, 14)
        manifest = read_manifest(newest)
        files = [str(e["file"]) for e in manifest_entries(manifest)] + [MANIFEST]

        # A store holding the run at step 9, as a server would after a crash-restart; the
        # run's proof is the run secret its workers keep with the checkpoints.
        store = Store(checkpoint_root=work)
        secret = read_secret(source) or ""
        spec = OptimizerSpec(**manifest["optimizer"])
        run = "faults-campaign"
        for rank in range(int(manifest["world_size"])):
            tables = [TableSpec(name, int(t["num_rows"]), int(t["dim"]),
                                int(t["shards"][rank]["row_start"]),
                                int(t["shards"][rank]["row_end"]))
                      for name, t in manifest["tables"].items()]
            store.register(run, rank, 2, 0, tables, spec,
                           restore=(str(step_dir(source, 9)), 9), run_secret=secret)

        outcomes: Counter[str] = Counter()
        by_kind: Counter[str] = Counter()
        failures: list[str] = []
        for i in range(trials):
            trial_root = work / "trial"
            shutil.rmtree(trial_root, ignore_errors=True)
            shutil.copytree(source, trial_root)
            trial = step_dir(trial_root, 14)
            rel = rng.choice(files)
            kind = rng.choice(DAMAGES)
            how = _damage(trial / rel, kind, rng)
            by_kind[kind] += 1
            if rel == MANIFEST and _reads_same(trial, manifest):
                outcomes["benign"] += 1  # e.g. whitespace became other whitespace
                continue
            chosen, why = _select(trial_root)
            torn = rel == MANIFEST and kind == "missing"  # a torn checkpoint: never listed
            named = torn or rel in why
            if chosen != 9 or not named:
                failures.append(f"trial {i} {rel} {how}: resume chose {chosen} ({why[:200]})")
                outcomes["worker_wrong"] += 1
            else:
                outcomes["worker_previous_intact"] += 1
            server_side = _server_side(trial, rel, manifest, store, run, secret)
            outcomes[f"server_{server_side.split(':')[0].lower()}"] += 1
            if server_side not in ("refused", "restored"):
                failures.append(f"trial {i} {rel} {how}: server {server_side}")

        resumed_equal = 0
        for i in range(resumes):
            trial_root = work / f"resume{i}"
            shutil.rmtree(trial_root, ignore_errors=True)
            shutil.copytree(source, trial_root)
            rel = rng.choice([f for f in files if f != MANIFEST])
            kind = rng.choice(("flip", "torn"))
            how = _damage(step_dir(trial_root, 14) / rel, kind, rng)
            proc = _worker(["--ps", server.address, "--run-id", f"faults-resume{i}",
                            "--steps", "20", "--checkpoint-dir", str(trial_root), "--resume",
                            "--dump-state", str(trial_root / "final.pt")],
                           work / f"resume{i}.log")
            ok = proc.returncode == 0 and "is damaged, skipped" in proc.stderr
            if ok:
                ref, got = torch.load(work / "ref.pt"), torch.load(trial_root / "final.pt")
                ok = all(torch.equal(ref[part][k], got[part][k])
                         for part in ("tables", "dense") for k in ref[part])
            if ok:
                resumed_equal += 1
            else:
                failures.append(f"resume {i} {rel} {how}: exit {proc.returncode}, not equal "
                                "to the uninterrupted run")
    finally:
        server.close()

    elapsed = time.perf_counter() - started
    figures = {"trials": trials, "damages": dict(by_kind), "outcomes": dict(outcomes),
               "files_in_checkpoint": len(files), "resumed_runs": resumes,
               "resumed_bitwise_equal": resumed_equal, "failures": failures,
               "seconds": round(elapsed, 1), "seed": args.seed,
               "load_average": os.getloadavg()[0]}
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(by_kind.items()))
    print(f"fault campaign: {trials} damaged checkpoints ({kinds}) over {len(files)} files")
    print(f"  worker resume selection: {outcomes['worker_previous_intact']} chose the previous "
          f"intact checkpoint and named the file, {outcomes['worker_wrong']} did not")
    bad_server = (trials - outcomes["benign"] - outcomes["server_refused"]
                  - outcomes["server_restored"])
    print(f"  server restore: {outcomes['server_refused']} refused with nothing changed, "
          f"{outcomes['server_restored']} restored (damage in a file the server does not "
          f"read), {bad_server} mixed or loaded damaged data; {outcomes['benign']} damages "
          "left the manifest's content as it was")
    print(f"  resumed runs: {resumed_equal}/{resumes} bitwise equal to the uninterrupted run")
    print(f"  {len(failures)} failures; {elapsed:.0f}s; load average {figures['load_average']:.1f}")
    return end_campaign(failures, figures, args.json, work, bool(args.dir))


if __name__ == "__main__":
    sys.exit(main())
