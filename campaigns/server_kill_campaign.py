"""Server kill campaign: SIGKILL the shard server many times during one training run.

    python campaigns/server_kill_campaign.py                       # 20 kills in a 300-step run
    python campaigns/server_kill_campaign.py --kills 3 --steps 60  # the test's short run
    python campaigns/server_kill_campaign.py --seed 7 --json runs/kills.json

One 2-rank run under `torchrun --max-restarts` (checkpoints every --checkpoint-every
steps, --resume), against a shard server that a supervisor (this script) SIGKILLs at
random steps (drawn from --seed, printed first) and starts again, empty, on the same
port, as a process manager would. After each kill the ranks find the state gone and
fail, torchrun restarts them, they resume from the newest intact checkpoint (the new
server loads its part: Register.restore) and train on; the next kill waits until that
recovery is done. Printed per kill: the step aimed at, the step the server had applied
when it died, and the checkpoint the ranks resumed from, with the time it took.

At the end the run must exit 0 and equal an uninterrupted run of the same flags on a
server of its own, bitwise: the rows and dense weights (--dump-state) and the servers'
optimizer state (m, v, Adam step of every partition, in both runs' final checkpoint).
Exit code 0 only then.
"""

from __future__ import annotations

import argparse
import random
import re
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
    ProcessTree,
    PsProcess,
    child_env,
    end_campaign,
    load_line,
    min_last_step,
    server_state_differences,
    state_differences,
    worker_cmd,
)

RESUMED = re.compile(r"rank 0: resumed from \S+ \(step (\d+)")
RECOVERY_TIMEOUT_S = 300.0
# How long the run trains between two looks at the server's stats (a few of its steps).
RUN_SLICE_S = 0.01


def _job(args: argparse.Namespace, run_id: str, ck: Path, dump: Path) -> list[str]:
    return [*SMALL_JOB, "--staleness", "1", "--steps", str(args.steps),
            "--checkpoint-every", str(args.checkpoint_every), "--checkpoint-dir", str(ck),
            "--run-id", run_id, "--dump-state", str(dump), "--ps-timeout",
            str(args.ps_timeout)]


def _wait_for_step(server: PsProcess, run_id: str, step: int, workers: subprocess.Popen[Any],
                   tree: ProcessTree, deadline: float) -> int:
    """Let the run go on in slices until every partition of the run applied `step`; the
    step seen. Returns with the run paused (the caller kills the server, then resumes it)."""
    while True:
        tree.pause()
        try:
            seen = min_last_step(server.stats(run_id))
        except Exception:
            seen = None
        if seen is not None and seen >= step:
            return seen
        tree.resume()
        if workers.poll() is not None:
            raise RuntimeError(f"the run ended (exit {workers.returncode}) before step {step}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the run did not reach step {step} in time")
        time.sleep(RUN_SLICE_S)


def _wait_for_recovery(server: PsProcess, run_id: str, partitions: int, log: Path,
                       resumes_before: int, workers: subprocess.Popen[Any],
                       tree: ProcessTree) -> int:
    """Until the restarted ranks registered on the new server and trained a step past
    their checkpoint; returns the checkpoint step they resumed from, with the run paused
    (once they resumed they train in slices, so the next kill still finds the run on)."""
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while True:
        resumed = RESUMED.findall(log.read_text(errors="replace"))
        if len(resumed) > resumes_before:
            step = int(resumed[resumes_before])
            tree.pause()
            try:
                stats = server.stats(run_id)
            except Exception:
                stats = None
            if (stats is not None and len(stats.partitions) == partitions
                    and (min_last_step(stats) or -1) > step):
                return step
            tree.resume()
        if workers.poll() is not None:
            raise RuntimeError(f"the run ended (exit {workers.returncode}) while recovering")
        if time.monotonic() > deadline:
            raise RuntimeError("no recovery within the timeout")
        time.sleep(RUN_SLICE_S if len(resumed) > resumes_before else 0.05)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--ps-timeout", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=None,
                        help="of the kill steps (default: a random one, printed)")
    parser.add_argument("--dir", default="", help="work directory (default: a temp dir)")
    parser.add_argument("--json", default="", help="write the figures here")
    args = parser.parse_args(argv)
    if args.steps % args.checkpoint_every:
        parser.error("--steps must be a multiple of --checkpoint-every (a final checkpoint)")
    # From just after the first checkpoint (a kill before it would restart from step 0,
    # with no checkpoint to name) to 10 steps before the end (the run must still be on).
    first, last = args.checkpoint_every + 1, args.steps - 10
    if args.kills > last - first:
        parser.error(f"--kills {args.kills}: only steps {first}..{last - 1} to kill at")
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    rng = random.Random(seed)
    kill_steps = sorted(rng.sample(range(first, last), args.kills))
    print(f"server kill campaign: seed {seed}; {args.kills} kills at steps {kill_steps} of a "
          f"{args.steps}-step run (checkpoints every {args.checkpoint_every})", flush=True)
    work = Path(args.dir or tempfile.mkdtemp(prefix="hybridps-kills-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    failures: list[str] = []
    kills: list[dict[str, Any]] = []
    run_id = "kills-run"

    ref_server = PsProcess(work / "ps-straight", "--checkpoint-root", str(work))
    try:
        ref = subprocess.run(
            worker_cmd(["--ps", ref_server.address,
                        *_job(args, "kills-straight", work / "straight", work / "straight.pt")]),
            cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=900,
            check=False)
        (work / "straight.log").write_text(ref.stdout + ref.stderr)
        if ref.returncode != 0:
            print(ref.stderr[-4000:], file=sys.stderr)
            return 1
    finally:
        ref_server.stop()

    servers = [PsProcess(work / "ps-0", "--checkpoint-root", str(work))]
    port = servers[0].port
    log_path = work / "killed.log"
    returncode = None
    with open(log_path, "w") as log:
        workers = subprocess.Popen(
            worker_cmd(["--ps", servers[0].address, "--resume",
                        *_job(args, run_id, work / "killed", work / "killed.pt")],
                       max_restarts=args.kills + 5),
            cwd=REPO, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
        tree = ProcessTree(workers.pid)
        try:
            for n, target in enumerate(kill_steps, start=1):
                seen = _wait_for_step(servers[-1], run_id, target, workers, tree,
                                      time.monotonic() + RECOVERY_TIMEOUT_S)
                servers[-1].kill()
                t_kill = time.monotonic()
                tree.resume()
                servers.append(PsProcess(work / f"ps-{n}", "--checkpoint-root", str(work),
                                         port=port))
                resumed = _wait_for_recovery(servers[-1], run_id, 8, log_path, n - 1,
                                             workers, tree)
                tree.resume()
                took = time.monotonic() - t_kill
                kills.append({"kill": n, "target_step": target, "server_step": seen,
                              "resumed_from": resumed, "recovery_s": round(took, 1)})
                print(f"  kill {n:2d}/{args.kills}: target step {target:3d}, server had "
                      f"applied step {seen:3d} -> SIGKILL, restarted on port {port}; ranks "
                      f"restarted and resumed from checkpoint step {resumed} in {took:.1f}s",
                      flush=True)
            returncode = workers.wait(900)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            failures.append(f"after {len(kills)} kills: {exc}")
        finally:
            tree.resume()
            if workers.poll() is None:
                workers.kill()
                workers.wait()
    try:
        final = servers[-1].stats(run_id)
        final_steps = sorted({p.last_step for p in final.partitions})
    except Exception as exc:
        final_steps, failures = [], [*failures, f"final stats: {exc}"]
    finally:
        for server in servers:
            if server.alive():
                server.stop()

    text = log_path.read_text(errors="replace")
    if returncode != 0:
        failures.append(f"the killed run exited {returncode}:\n{text[-4000:]}")
    restarts = len(RESUMED.findall(text))
    equal_rows = equal_server = False
    if not failures:
        rows = state_differences(work / "straight.pt", work / "killed.pt")
        server_side = server_state_differences(work / "straight", work / "killed",
                                               args.steps - 1)
        equal_rows, equal_server = not rows, not server_side
        failures += [f"rows/dense differ: {d}" for d in rows[:10]]
        failures += [f"server state differs: {d}" for d in server_side[:10]]
        if final_steps != [args.steps - 1]:
            failures.append(f"the last server holds steps {final_steps}, not {args.steps - 1}")
    elapsed = time.perf_counter() - started
    figures = {"seed": seed, "kills_planned": args.kills, "kills": kills,
               "steps": args.steps, "checkpoint_every": args.checkpoint_every,
               "resumes_in_log": restarts, "exit_code": returncode,
               "bitwise_equal_rows_dense": equal_rows, "bitwise_equal_server_state": equal_server,
               "failures": failures, "seconds": round(elapsed, 1), "load": load_line()}
    print(f"  {len(kills)}/{args.kills} kills recovered; run exit code {returncode}; "
          f"{restarts} resumes in the log")
    print(f"  final state vs the uninterrupted run: rows+dense "
          f"{'bitwise equal' if equal_rows else 'NOT equal'}, server m/v/step "
          f"{'bitwise equal' if equal_server else 'NOT equal'}")
    print(f"  {len(failures)} failures; {elapsed:.0f}s; {load_line()}")
    return end_campaign(failures, figures, args.json, work, bool(args.dir))


if __name__ == "__main__":
    sys.exit(main())
