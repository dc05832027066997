"""Soak: one training run against one shard server for minutes, with its Sync connections
cut every few steps and its ranks killed now and then; the server's RSS must not grow.

    python campaigns/soak.py                          # 10 minutes (2 of warm-up)
    python campaigns/soak.py --minutes 0.25 --json x  # tests/system/test_soak.py (a generous bound)

A 2-rank run (staleness 1, checkpoints every --checkpoint-every steps, --resume) under
`torchrun --max-restarts`, with HYBRIDPS_FAULT_CUT=EVERY (worker/runtime/faults.py): every rank
breaks its Sync connection (cancels its gRPC Sync stream) right after the push of
every EVERY-th step, so the server sees a stream end mid-run and the ranks re-register,
reconnect and re-send, hundreds of times a minute.
Every --kill-every-s seconds one rank (chosen by --seed) is SIGKILLed: torchrun restarts
both, they resume from the newest checkpoint (the server replaces the partitions:
Register.restore) with new shared-memory arenas. The server's RSS (VmRSS, and its
anonymous and shared-memory parts) is sampled every --sample-s seconds and printed.

The time counts from the run's first step on the server (after torchrun's start-up).
Growth = the median of the last 5 samples over the median of the first 5 after the
warm-up (--warmup-fraction of the time, counted from the run's first step on the
server), minus 1. No rank is killed in the last --warmup-fraction of the time either,
so the last samples do not hold a dead rank's arena (the server keeps it mapped until
the restarted rank registers: a transient). Exit code 0 when it is under
--max-growth (5%), the run kept training, the server answered to the end and logged
no internal error.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from campaign_tools import (
    REPO,
    SMALL_JOB,
    PsProcess,
    child_env,
    children,
    end_campaign,
    load_line,
    min_last_step,
    worker_cmd,
)

RUN_ID = "soak"
STARTUP_TIMEOUT_S = 300.0


def _ranks(agent_pid: int) -> list[int]:
    """The worker processes torchrun's agent started (its children)."""
    return children(agent_pid)


def _step(server: PsProcess) -> int | None:
    try:
        return min_last_step(server.stats(RUN_ID))
    except Exception:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--warmup-fraction", type=float, default=0.2)
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--cut-every", type=int, default=20, help="steps between cuts")
    parser.add_argument("--kill-every-s", type=float, default=120.0,
                        help="seconds between rank kills (0: none)")
    parser.add_argument("--checkpoint-every", type=int, default=200)
    parser.add_argument("--same-node", default="auto", help="the worker's --same-node")
    parser.add_argument("--max-growth", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=23)
    parser.add_argument("--dir", default="", help="work directory (default: a temp dir)")
    parser.add_argument("--json", default="", help="write the figures here")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    work = Path(args.dir or tempfile.mkdtemp(prefix="hybridps-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    duration = args.minutes * 60.0
    warmup = duration * args.warmup_fraction
    failures: list[str] = []
    samples: list[dict[str, Any]] = []
    kills: list[dict[str, Any]] = []
    print(f"soak: {args.minutes:g} min (warm-up {warmup:.0f}s), cut every {args.cut_every} "
          f"steps, a rank SIGKILLed every {args.kill_every_s:g}s, --same-node "
          f"{args.same_node}, seed {args.seed}; {load_line()}", flush=True)

    server = PsProcess(work / "ps", "--checkpoint-root", str(work))
    log_path = work / "workers.log"
    job = [*SMALL_JOB, "--staleness", "1", "--steps", "100000000", "--run-id", RUN_ID,
           "--checkpoint-every", str(args.checkpoint_every), "--checkpoint-dir",
           str(work / "ck"), "--resume", "--same-node", args.same_node,
           "--ps", server.address]
    env = child_env(HYBRIDPS_FAULT_CUT=str(args.cut_every))
    workers_rc = None
    with open(log_path, "w") as log:
        workers = subprocess.Popen(worker_cmd(job, max_restarts=10_000), cwd=REPO, env=env,
                                   stdout=log, stderr=subprocess.STDOUT)
        try:
            start = time.monotonic()
            trained: float | None = None  # when the server first held a step of the run
            next_sample, next_kill = start, math.inf
            while trained is None or time.monotonic() < trained + duration:
                now = time.monotonic()
                if trained is None and now > start + STARTUP_TIMEOUT_S:
                    failures.append(f"the run did not start training in {STARTUP_TIMEOUT_S:g}s")
                    break
                if workers.poll() is not None:
                    failures.append(f"the run ended (exit {workers.returncode}) at "
                                    f"{now - start:.0f}s")
                    break
                if not server.alive():
                    failures.append(f"the server died at {now - start:.0f}s")
                    break
                if now >= next_sample:
                    rss = server.rss_kib()
                    sample = {"t": round(now - start, 1), "step": _step(server),
                              **{k: round(v / 1024, 1) for k, v in rss.items()}}
                    samples.append(sample)
                    if trained is None and sample["step"] is not None:
                        trained = now
                        next_kill = now + args.kill_every_s
                    print(f"  t={sample['t']:6.1f}s step={sample['step']} RSS "
                          f"{sample['VmRSS']:.1f} MiB (anon {sample['RssAnon']:.1f}, shmem "
                          f"{sample['RssShmem']:.1f})", flush=True)
                    next_sample += args.sample_s
                if (args.kill_every_s > 0 and trained is not None and now >= next_kill
                        and now < trained + duration - warmup):
                    ranks = _ranks(workers.pid)
                    if ranks:
                        victim = rng.choice(ranks)
                        with_step = _step(server)
                        os.kill(victim, signal.SIGKILL)
                        kills.append({"t": round(now - start, 1), "pid": victim,
                                      "step": with_step})
                        print(f"  t={now - start:6.1f}s SIGKILL rank process {victim} at "
                              f"step {with_step}", flush=True)
                    next_kill += args.kill_every_s
                time.sleep(0.2)
            final_step = _step(server)
        finally:
            if workers.poll() is None:
                workers.send_signal(signal.SIGTERM)  # the ranks stop after a step
                try:
                    workers.wait(120)
                except subprocess.TimeoutExpired:
                    workers.kill()
                    workers.wait()
            workers_rc = workers.returncode
    answered = _step(server) is not None
    server_rc = server.stop()
    text = log_path.read_text(errors="replace")
    server_log = server.log_path.read_text(errors="replace")
    reconnects = text.count("event=reconnect")
    resumes = text.count("rank 0: resumed from")

    training = [s["t"] for s in samples if s["step"] is not None]
    measured = [s for s in samples if training and s["t"] >= training[0] + warmup]
    growth = None
    if len(measured) >= 10:
        base = statistics.median(s["VmRSS"] for s in measured[:5])
        end = statistics.median(s["VmRSS"] for s in measured[-5:])
        growth = end / base - 1.0
        if growth >= args.max_growth:
            failures.append(f"server RSS grew {growth:+.1%} after the warm-up ({base:.1f} -> "
                            f"{end:.1f} MiB), over {args.max_growth:.0%}")
    else:
        failures.append(f"only {len(measured)} samples after the warm-up: too short to tell")
    if not answered:
        failures.append("the server did not answer at the end")
    if "internal_error" in server_log or "Traceback" in server_log:
        failures.append("the server logged an internal error or a traceback")
    if final_step is None or final_step < 10:
        failures.append(f"the run did not train (server at step {final_step})")
    if reconnects == 0:
        failures.append("no reconnect happened: the cuts did not fire")
    figures = {"minutes": args.minutes, "warmup_s": warmup, "cut_every": args.cut_every,
               "kill_every_s": args.kill_every_s, "same_node": args.same_node,
               "seed": args.seed, "samples": samples, "kills": kills,
               "reconnects_logged": reconnects, "resumes": resumes, "final_step": final_step,
               "rss_growth": growth, "max_growth": args.max_growth,
               "workers_exit": workers_rc, "server_exit": server_rc, "failures": failures,
               "load": load_line()}
    peak = max((s["VmRSS"] for s in measured), default=float("nan"))
    print(f"  run reached step {final_step}; {reconnects} reconnects (cut every "
          f"{args.cut_every} steps), {len(kills)} rank kills, {resumes} resumes")
    if growth is not None:
        print(f"  server RSS after the warm-up: first {measured[0]['VmRSS']:.1f} MiB, last "
              f"{measured[-1]['VmRSS']:.1f} MiB, peak {peak:.1f} MiB; growth (median of the "
              f"last 5 / first 5 samples) {growth:+.2%} (limit {args.max_growth:.0%})")
    print(f"  {len(failures)} failures; {load_line()}")
    return end_campaign(failures, figures, args.json, work, bool(args.dir))


if __name__ == "__main__":
    sys.exit(main())
