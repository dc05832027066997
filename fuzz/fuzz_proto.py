"""Protocol fuzzer: malformed and mutated messages against a live shard server while
healthy 2-rank runs train on the same server.

    python fuzz/fuzz_proto.py                     # 100,000 messages
    python fuzz/fuzz_proto.py --messages 2000     # tests/system/test_fuzz_proto.py
    python fuzz/fuzz_proto.py --seed 5 --json runs/fuzz.json
    python fuzz/fuzz_proto.py --messages 600 --without-healthy-runs   # seconds

Messages (plain Python generation from --seed, no hypothesis: fast enough for 10^5):
- random bytes, sent as the request of a random method;
- valid RegisterRequest (every optimizer kind of hybridps/optim_kinds.py, static and
  dynamic tables) / SyncRequest (inline pushes of registered fuzz partitions, at
  their next step) / FlushRequest / CheckpointRequest (deferred too) / CheckpointDoneRequest /
  FinishRequest / SeedRowsRequest /
  PageRequest (dynamic tables' ids paged out and in, at the partition's next seq, and
  peeks) / ShardStatsRequest / DropRunRequest (with the admin token) / ShutdownRequest
  (never with it) messages, then 0-3 mutations: a field set to an edge value of its
  type (integer limits, NaN, inf, -0.0, traversal paths, long or non-ASCII strings,
  unknown enum numbers), a field cleared, a repeated entry removed or duplicated, or,
  on the serialized bytes, bits flipped, a truncation, bytes inserted or deleted; a Page
  call also one targeted mutation (a wrong partition or table, slots out of range,
  repeated ids, wrong shapes or dtypes, shapes claiming 2^40 elements, 50,000 ids,
  non-finite rows, a seq out of order, truncated bytes).
Unary requests go one per call, Sync requests 1-4 per stream (one partition's pushes,
sometimes another's mixed in). The fuzz partitions use their own run ids (a pool of 16,
so the state they allocate stays bounded); the healthy runs' ids are never used
(guessing them is the token's business, docs/deploy.md). Calls carry what a client
holds: the partition secret its Register answered (most of the time; sometimes none or a
wrong one), and a Register its fuzz run's run secret, whose checkpoint directory the
fuzzer claimed, so pushes, checkpoints and restores get past the secret checks (the
pushes applied are counted: a campaign that applies none fails).

Meanwhile healthy runs (torchrun, 2 ranks, the shared-memory arena, checkpoints) train back to
back on the same server until the fuzz is over; each must equal the same run on a server
of its own, bitwise (rows and dense weights, and the server's m, v, steps in the final
checkpoint). Every call's status is counted by code and printed. Exit code 0 only with
zero INTERNAL and zero UNKNOWN statuses, the server alive and SERVING at the end with
no internal error in its log, every healthy run bitwise equal to the solo one, valid
calls of every optimizer kind (Register, Sync, Page, peek, Flush, GetShardStats) still
answered right after the barrage, and full coverage: every RPC of the proto services
sent, and each optimizer kind and table mode registered and pushed to, and Page calls
applied (fuzz_messages.required_coverage). --without-healthy-runs: the fuzz and these
checks alone, in seconds (tests/system/test_fuzz_proto.py).
"""

from __future__ import annotations

import argparse
import random
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

# campaign_tools: the shard server and worker commands the fault campaigns share
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "campaigns"))

import grpc
from campaign_tools import (
    REPO,
    SMALL_JOB,
    PsProcess,
    child_env,
    end_campaign,
    load_line,
    server_state_differences,
    state_differences,
    worker_cmd,
)
from fuzz_after import valid_calls_problems
from fuzz_messages import FUZZ_RUNS, SERVICES, Generator, coverage_gaps

from hybridps.admin import health_status
from hybridps.channel_options import channel_options
from hybridps.optim_kinds import KINDS
from hybridps.run_secret import claim_directory

BAD_CODES = ("INTERNAL", "UNKNOWN")
CALL_TIMEOUT_S = 2.0  # a Flush or Checkpoint asked to wait 1e300 s ends here
# A Flush or Checkpoint of a step not applied yet waits its timeout_s (0: the server's
# default): short ones keep the fuzz moving (the healthy runs send their own timeout).
# The fuzz registers dozens of runs with dynamic tables, each reserving budget /
# --run-shares at Register: many small shares, so the valid calls after it still fit.
SERVER_FLAGS = ["--max-state-bytes", str(1 << 30), "--run-shares", "64",
                "--flush-timeout-s", "0.1", "--stats-without-token"]
HEALTHY_STEPS = 150


class Fuzzer:
    """Sends the generator's messages on one channel from `threads` threads; counts."""

    def __init__(self, address: str, messages: int, seed: int, threads: int,
                 checkpoint_dirs: list[str], run_secrets: dict[str, str],
                 run_dirs: dict[str, str], admin_token: str) -> None:
        self.channel = grpc.insecure_channel(address, options=channel_options())
        grpc.channel_ready_future(self.channel).result(timeout=30)
        # every unary RPC of the services, raw bytes both ways (Sync: the stream)
        self.unary = {
            m.name: self.channel.unary_unary(f"/{svc.full_name}/{m.name}",
                                             request_serializer=_raw,
                                             response_deserializer=_raw)
            for svc in SERVICES for m in svc.methods if not m.client_streaming}
        self.sync = self.channel.stream_stream("/hybridps.v1.ShardService/Sync",
                                               request_serializer=_raw,
                                               response_deserializer=_raw)
        self.messages = messages
        # the warm-up: each kind with static tables, then with a dynamic one (spread over
        # the threads, so that no two race for one partition)
        warm = FUZZ_RUNS[:2 * len(KINDS)]
        self.generators = [Generator(random.Random(seed * 1000 + i), checkpoint_dirs,
                                     run_secrets, run_dirs, admin_token, warm[i::threads])
                           for i in range(threads)]
        self.lock = threading.Lock()
        self.sent = 0
        self.calls = 0
        self.answers = 0  # SyncResponses received
        self.applied = 0  # pushes answered as applied (not duplicates)
        self.duplicates = 0
        self.codes: Counter[str] = Counter()
        self.by_method: Counter[str] = Counter()
        self.covered_sent: Counter[str] = Counter()  # built calls by coverage label
        self.covered_ok: Counter[str] = Counter()  # of those, answered OK
        self.seconds: dict[str, float] = defaultdict(float)  # per method, over calls
        self.bad: list[str] = []
        self.generator_errors: list[str] = []
        self.done = threading.Event()
        self.ended = 0.0  # perf_counter() when the last message went

    def run(self) -> None:
        threads = [threading.Thread(target=self._loop, args=(g,), daemon=True)
                   for g in self.generators]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.ended = time.perf_counter()
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
                method, requests, sent, metadata, built = gen.item()
                labels = gen.labels(method, requests) if built else []
            except Exception as exc:  # the generator's own bug: counted as a failure
                with self.lock:
                    self.generator_errors.append(f"{type(exc).__name__}: {exc}")
                if not self._take(1):  # counted as a message, so a broken generator ends
                    return
                continue
            if not self._take(len(requests)):
                return
            code, details = "OK", ""
            t0 = time.perf_counter()
            try:
                if method == "Sync":
                    for response in self.sync(iter(requests), timeout=CALL_TIMEOUT_S,
                                              metadata=metadata):
                        applied, duplicates = gen.answered(sent, response)
                        with self.lock:
                            self.answers += 1
                            self.applied += applied
                            self.duplicates += duplicates
                else:
                    reply = self.unary[method](requests[0], timeout=CALL_TIMEOUT_S,
                                               metadata=metadata)
                    gen.learn(method, requests[0], reply)
            except grpc.RpcError as exc:
                code = exc.code().name if exc.code() is not None else "UNKNOWN"
                details = exc.details() or ""
                gen.refused(method, requests[0], details)
            took = time.perf_counter() - t0
            with self.lock:
                self.seconds[method] += took
                self.codes[code] += 1
                self.by_method[f"{method} {code}"] += 1
                self.covered_sent.update(labels)
                if code == "OK":
                    self.covered_ok.update(labels)
                if code in BAD_CODES and len(self.bad) < 50:
                    self.bad.append(f"{method} {code}: {details[:300]} (request "
                                    f"{requests[0][:60].hex()})")


def _raw(data: bytes) -> bytes:
    return data


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
    parser.add_argument("--without-healthy-runs", action="store_true",
                        help="only the fuzz and the checks after it (no torchrun runs)")
    args = parser.parse_args(argv)
    work = Path(args.dir or tempfile.mkdtemp(prefix="hybridps-fuzz-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    failures: list[str] = []
    beside = ("alone" if args.without_healthy_runs
              else f"beside healthy {HEALTHY_STEPS}-step runs")
    print(f"fuzz: {args.messages} messages, seed {args.seed}, {args.threads} threads, "
          f"{beside}; {load_line()}", flush=True)

    if not args.without_healthy_runs:
        solo_server = PsProcess(work / "ps-solo", "--checkpoint-root", str(work),
                                *SERVER_FLAGS)
        try:
            rc, solo_ck, solo_dump, err = _healthy(solo_server.address, "healthy-solo", work)
        finally:
            solo_server.stop()
        if rc != 0:
            print(f"the solo run failed ({rc}):\n{err}", file=sys.stderr)
            return 1

    # DropRun reaches the servicer with the admin token; Shutdown never carries it
    admin_token = secrets.token_hex(24)
    token_file = work / "admin.token"
    token_file.touch(mode=0o600)
    token_file.write_text(admin_token + "\n")
    server = PsProcess(work / "ps", "--checkpoint-root", str(work), *SERVER_FLAGS,
                       "--admin-token-file", str(token_file))
    # Each fuzz run's secret and the directory claimed with it (hybridps/run_secret.py),
    # as the worker's rank 0 claims its --checkpoint-dir.
    secrets_rng = random.Random(args.seed)
    run_secrets = {run: secrets_rng.randbytes(32).hex() for run in FUZZ_RUNS}
    run_dirs = {run: f"fuzz-runs/{run}" for run in FUZZ_RUNS}
    for run, directory in run_dirs.items():
        claim_directory(work / directory, prefer=run_secrets[run])
    checkpoint_dirs = [f"fuzz/c{i}" for i in range(3)] + [
        f"fuzz-runs/{run}/step-0000000003" for run in FUZZ_RUNS[:3]] + [
        "healthy-solo/step-0000000049", "healthy-solo", "../outside", "/", "",
        "fuzz/../../x", "fuzz-runs"]
    fuzzer = Fuzzer(server.address, args.messages, args.seed, args.threads, checkpoint_dirs,
                    run_secrets, run_dirs, admin_token)
    fuzz_thread = threading.Thread(target=fuzzer.run, daemon=True)
    healthy: list[dict[str, Any]] = []
    fuzz_start = time.perf_counter()
    fuzz_thread.start()
    after: list[str] = []
    try:
        n = 0
        while not args.without_healthy_runs and (not fuzzer.done.is_set() or n == 0):
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
        if server.alive():  # valid calls still work after the barrage
            after = valid_calls_problems(server.address)
    finally:
        fuzz_s = (fuzzer.ended or time.perf_counter()) - fuzz_start
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
    if fuzzer.applied == 0:
        failures.append("no fuzz push was applied: the push path was not reached")
    gaps = coverage_gaps(fuzzer.covered_sent, fuzzer.covered_ok)
    failures += [f"coverage: {gap}" for gap in gaps]
    failures += [f"after the fuzz: {problem}" for problem in after]
    elapsed = time.perf_counter() - started
    figures = {"messages": fuzzer.sent, "calls": fuzzer.calls, "seed": args.seed,
               "sync_answers": fuzzer.answers, "pushes_applied": fuzzer.applied,
               "pushes_duplicate": fuzzer.duplicates,
               "threads": args.threads, "codes": dict(fuzzer.codes),
               "by_method": dict(sorted(fuzzer.by_method.items())),
               "seconds_by_method": {k: round(v, 1) for k, v in fuzzer.seconds.items()},
               "bad_examples": fuzzer.bad, "healthy_runs": healthy,
               "coverage": {"sent": dict(sorted(fuzzer.covered_sent.items())),
                            "ok": dict(sorted(fuzzer.covered_ok.items())), "gaps": gaps},
               "after_fuzz_problems": after,
               "generator_errors": fuzzer.generator_errors[:50],
               "server_alive": alive, "health": health, "fuzz_seconds": round(fuzz_s, 1),
               "seconds": round(elapsed, 1), "failures": failures, "load": load_line()}
    codes = ", ".join(f"{c} {n}" for c, n in fuzzer.codes.most_common())
    print(f"  {fuzzer.sent} messages in {fuzzer.calls} calls in {fuzz_s:.0f}s "
          f"({fuzzer.sent / max(fuzz_s, 1e-9):.0f} messages/s), {fuzzer.answers} Sync "
          f"answers received: {fuzzer.applied} pushes applied, {fuzzer.duplicates} answered "
          f"as duplicates; statuses of the calls by code: {codes}")
    methods: dict[str, Counter[str]] = {}
    for key, count in fuzzer.by_method.items():
        method, code = key.split(" ")
        methods.setdefault(method, Counter())[code] += count
    for method, counts in sorted(methods.items()):
        mean_ms = 1e3 * fuzzer.seconds[method] / max(1, sum(counts.values()))
        print(f"    {method:13s} " + ", ".join(f"{c} {n}" for c, n in counts.most_common())
              + f" (mean {mean_ms:.1f} ms a call)")
    print(f"  coverage: {len(fuzzer.covered_ok)} of {len(fuzzer.covered_sent)} labels "
          f"answered OK at least once; gaps: {'; '.join(gaps) or 'none'}")
    print(f"  valid calls after the fuzz: {'; '.join(after) or 'all answered right'}")
    equal = sum(1 for h in healthy if h.get("bitwise_equal"))
    print(f"  INTERNAL/UNKNOWN: {bad}; server alive: {alive}, health {health}; healthy runs "
          f"bitwise equal to the solo run: {equal}/{len(healthy)}")
    print(f"  {len(failures)} failures; {elapsed:.0f}s; {load_line()}")
    for example in fuzzer.bad[:10]:
        print(f"  BAD {example}")
    return end_campaign(failures, figures, args.json, work, bool(args.dir))


if __name__ == "__main__":
    sys.exit(main())
