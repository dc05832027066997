"""Every benchmark of bench/, one after the other, and one table of every goal.

    python bench/run_all.py                      # full runs
    python bench/run_all.py --quick              # --quick passed through to each
    python bench/run_all.py --train-repeats 1    # bench_train.py --repeats (default 3)
    python bench/run_all.py --out-dir runs/bench --only kernel,train

Each benchmark runs as its own process (`python bench/bench_<name>.py [--quick] --json
OUT/<name>.json`), one at a time so they do not share the machine; its output is shown
and kept in OUT/<name>.txt. A benchmark whose file does not exist is listed as skipped,
and so is the TorchRec comparison (bench_vs_torchrec.py) when TorchRec is not
importable (an optional extra: docs/performance.md says how to install it).
Then the summary: per goal, the ratio each benchmark measured, its target
and met / NOT met (the worst case where a benchmark measures several configurations),
written to OUT/summary.json too. Exit code 1 if a benchmark failed to run (a missed goal
is a result, not a failure).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

Goal = dict[str, Any]  # {"goal": n, "what": str, "ratio": float, "target": str, "met": bool}


def _goal(number: int, what: str, ratio: float, target: str, met: bool) -> Goal:
    return {"goal": number, "what": what, "ratio": ratio, "target": target, "met": met}


def kernel_goals(res: dict[str, Any]) -> list[Goal]:
    """Goal 1: the native kernel's worst fraction of the bandwidth ceiling and x SparseAdam."""
    goal = res["goal"]
    out = []
    for impl in sorted({r["impl"] for r in res["results"] if r["impl"].startswith("native")}):
        rows = [r for r in res["results"] if r["impl"] == impl]
        frac = min(r["fraction_of_ceiling"] for r in rows)
        speed = min(r["vs_sparse_adam"] for r in rows)
        out.append(_goal(1, f"kernel {impl}: worst fraction of bandwidth ceiling", frac,
                         f">= {goal['fraction_of_ceiling']:g}",
                         frac >= goal["fraction_of_ceiling"]))
        out.append(_goal(1, f"kernel {impl}: worst speed-up over SparseAdam", speed,
                         f">= {goal['vs_sparse_adam']:g}", speed >= goal["vs_sparse_adam"]))
    return out


def wire_goals(res: dict[str, Any]) -> list[Goal]:
    """Goal 2, per transport (tcp, shm): the worst wire/kernel rows ratio and
    wire/echo bytes ratio over the configurations."""
    goal, out = res["goal"], []
    for transport in sorted({r["transport"] for r in res["results"]}):
        rows = [r for r in res["results"] if r["transport"] == transport]
        rows_ratio = min(r["rows_ratio"] for r in rows)
        bytes_ratio = min(r["bytes_ratio"] for r in rows)
        out += [_goal(2, f"wire {transport}: worst rows/s over the wire / in-process kernel",
                      rows_ratio, f">= {goal['rows_ratio']:g}",
                      rows_ratio >= goal["rows_ratio"]),
                _goal(2, f"wire {transport}: worst bytes/s over the wire / raw TCP echo",
                      bytes_ratio, f">= {goal['bytes_ratio']:g}",
                      bytes_ratio >= goal["bytes_ratio"])]
    return out


def memory_goals(res: dict[str, Any]) -> list[Goal]:
    """Goal 5: device bytes per element of fp32 and bf16 rows (the worst over dims)."""
    goal = res["goal"]
    out = []
    for name, target in goal["device_bytes_per_elem"].items():
        got = [r["device_bytes_per_elem"] for r in res["results"]
               if r["config"].startswith(f"hybridps {name} rows")]
        if got:
            worst = max(got)
            out.append(_goal(5, f"memory: device bytes per element, {name} rows", worst,
                             f"= {target:g}", all(g == target for g in got)))
    return out


def listed_goals(res: dict[str, Any]) -> list[Goal]:
    """A benchmark that lists its goals itself (bench_train.py)."""
    return list(res["goals"])


def no_goals(res: dict[str, Any]) -> list[Goal]:
    """A measurement without a goal (bench_checkpoint.py: seconds per GiB;
    bench_push_cpu.py: the server's CPU per batch push)."""
    return []


BENCHES: dict[str, tuple[str, Callable[[dict[str, Any]], list[Goal]]]] = {
    "kernel": ("bench/bench_kernel.py", kernel_goals),
    "wire": ("bench/bench_wire.py", wire_goals),
    "memory": ("bench/bench_memory.py", memory_goals),
    "train": ("bench/bench_train.py", listed_goals),
    "checkpoint": ("bench/bench_checkpoint.py", no_goals),
    "push_cpu": ("bench/bench_push_cpu.py", no_goals),
    "vs_torchrec": ("bench/bench_vs_torchrec.py", listed_goals),
}
# benchmark -> (module it needs, how to get it): skipped with that line when not importable
OPTIONAL = {"vs_torchrec": ("torchrec", "pip install -e '.[bench]' && "
                                       "pip install --no-deps torchrec==1.8.0")}


def run_bench(name: str, script: Path, out_dir: Path, quick: bool,
              extra: list[str]) -> tuple[int, float]:
    """Run one benchmark, echoing and saving its output; (exit code, seconds)."""
    cmd = [sys.executable, str(script), *(["--quick"] if quick else []), *extra,
           "--json", str(out_dir / f"{name}.json")]
    print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    with open(out_dir / f"{name}.txt", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        code = proc.wait()
    return code, time.perf_counter() - t0


def summary_table(rows: list[tuple[str, Goal]]) -> str:
    head = f"{'goal':>4}  {'bench':<11} {'what':<58} {'ratio':>8}  {'target':<8} result"
    lines = [head, "-" * len(head)]
    for bench, g in sorted(rows, key=lambda r: r[1]["goal"]):
        ratio = g["ratio"]
        cell = f"{ratio:>8.3f}" if isinstance(ratio, float) and math.isfinite(ratio) else \
            f"{ratio!s:>8}"
        lines.append(f"{g['goal']:>4}  {bench:<11} {g['what']:<58} {cell}  {g['target']:<8} "
                     f"{'met' if g['met'] else 'NOT met'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
    p.add_argument("--out-dir", type=Path, default=REPO / "runs" / "bench",
                   help="where every benchmark writes <name>.json and <name>.txt")
    p.add_argument("--only", default="", help=f"comma list of {','.join(BENCHES)}")
    p.add_argument("--train-repeats", type=int, default=3,
                   help="bench_train.py --repeats: goal 4's server/local ratio of a single "
                        "repeat varies a lot on a shared machine (docs/performance-log.md); "
                        "the median of 3 interleaved repeats is a steadier verdict")
    args = p.parse_args(argv)
    if args.train_repeats < 1:
        p.error(f"--train-repeats must be >= 1, got {args.train_repeats}")
    extra_args = {"train": ["--repeats", str(args.train_repeats)],
                  "vs_torchrec": ["--repeats", str(max(args.train_repeats, 3))]}
    names = [n for n in args.only.split(",") if n] or list(BENCHES)
    for n in names:
        if n not in BENCHES:
            p.error(f"--only: {n!r} is not one of {', '.join(BENCHES)}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    load_before = os.getloadavg()
    goals: list[tuple[str, Goal]] = []
    status: dict[str, str] = {}
    failed = False
    for name in names:
        rel, extract = BENCHES[name]
        script = REPO / rel
        if not script.exists():
            status[name] = f"skipped ({rel} does not exist)"
            continue
        if name in OPTIONAL and importlib.util.find_spec(OPTIONAL[name][0]) is None:
            status[name] = f"skipped ({OPTIONAL[name][0]} is not installed: {OPTIONAL[name][1]})"
            print(f"\n=== {name}: {status[name]}", flush=True)
            continue
        result = args.out_dir / f"{name}.json"
        result.unlink(missing_ok=True)  # a JSON from an earlier run is not this run's
        code, seconds = run_bench(name, script, args.out_dir, args.quick,
                                  extra_args.get(name, []))
        # a missed goal may exit non-zero (bench_memory) but still writes the JSON
        if not result.exists():
            status[name] = f"FAILED (exit {code}, no JSON; see {name}.txt)"
            failed = True
            continue
        try:
            got = extract(json.loads(result.read_text()))
        except (KeyError, TypeError, ValueError) as exc:
            status[name] = f"ran (exit {code}) but its JSON is not understood: {exc!r}"
            failed = True
            continue
        goals += [(name, g) for g in got]
        status[name] = f"exit {code}, {seconds:.0f}s"
    load_after = os.getloadavg()
    print("\n=== summary (" + ("quick" if args.quick else "full") + f" runs, {args.out_dir})")
    for name in names:
        print(f"  {name:<11} {status[name]}")
    print(summary_table(goals))
    print(f"load average {load_before[0]:.2f} -> {load_after[0]:.2f}; "
          f"{time.perf_counter() - started:.0f}s")
    (args.out_dir / "summary.json").write_text(json.dumps({
        "quick": args.quick, "status": status,
        "goals": [{"bench": b, **g} for b, g in goals],
        "loadavg_before": load_before, "loadavg_after": load_after,
    }, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
