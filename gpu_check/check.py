"""The GPU check: one command on a machine with one NVIDIA GPU (docs/gpu_check.md).

    python gpu_check/check.py --out DIR              # on the GPU machine (~9-10 min)
    python gpu_check/check.py --dry-run --out DIR    # every stage on the CPU, tiny sizes
    python gpu_check/check.py --only sync_debug,nccl --out DIR   # a rerun of some stages
    python gpu_check/check.py --fetch-wheels         # here: the wheels to carry (.whl/)

Each stage runs in a process of its own with its own time limit (gpu_check/gpu_stages.py), so a
hang or a CUDA crash costs that stage only; DIR/gpu_check.json (a `stages` map: each
stage's name -> ok, seconds, figures, error), DIR/gpu_check.md (the same as tables, and
the GPU check's goals as met / missed with their margins) and DIR/gpu_check.log are rewritten
after every stage, so a check stopped from outside still returns what it measured.
Wheels in REPO/.whl (--fetch-wheels) are installed first into a folder of the work
directory and put on the stages' PYTHONPATH: the project's grpcio, protobuf and gRPC
health/reflection, which the device's python may lack or hold at other versions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpu_common import REPO, clean_env, log
from gpu_report import goals, markdown

STAGES_PY = Path(__file__).with_name("gpu_stages.py")
# name -> (what it answers, time limit on the GPU in s, the least time worth starting it with)
STAGES: dict[str, tuple[str, int, int]] = {
    "prepare": ("the python, its packages, the native kernel built in place", 120, 20),
    "pytest_gpu": ("a. pytest -m gpu: the exactness tests on the device", 170, 60),
    "default_job": ("b. the default job: samples/s, wait, GPU bytes per element", 150, 40),
    "sync_debug": ("1. the loop under CUDA's sync debug mode", 90, 30),
    "table_budget": ("c. the largest table in an 8 GiB budget", 60, 15),
    "server_threads": ("d. the server's kernel at 1-16 threads vs a GPU step", 100, 30),
    "nccl": ("e. a one-rank NCCL group; the default job through torchrun", 90, 30),
    "production_job": ("f. the production-sized job under a 40 GiB cap (sub-stages a-g)",
                       330, 60),
}
WHEELS = {"grpcio": "grpc", "protobuf": "google.protobuf",
          "grpcio-health-checking": "grpc_health", "grpcio-reflection": "grpc_reflection"}
WHEEL_PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                   "manylinux2014_x86_64", "manylinux1_x86_64"]


def fetch_wheels(python_version: str) -> int:
    """Download the wheels of this environment's versions of WHEELS into REPO/.whl (for
    the device's python `python_version`), replacing what is there."""
    import importlib.metadata

    target = REPO / ".whl"
    target.mkdir(exist_ok=True)
    for old in target.glob("*.whl"):
        old.unlink()
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp",
           *[a for p in WHEEL_PLATFORMS for a in ("--platform", p)], "-d", str(target), *pins]
    log(" ".join(cmd))
    rc = subprocess.run(cmd, check=False).returncode
    size = sum(f.stat().st_size for f in target.glob("*.whl"))
    log(f"{target}: {', '.join(sorted(f.name for f in target.glob('*.whl')))} "
        f"({size / 2**20:.1f} MiB)")
    return rc


def install_wheels(work: Path) -> dict[str, Any]:
    wheels = sorted((REPO / ".whl").glob("*.whl"))
    if not wheels:
        return {"installed": [], "note": "no REPO/.whl: the device's own packages"}
    site = work / "site"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
           "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site),
           *map(str, wheels)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    out: dict[str, Any] = {"installed": [w.name for w in wheels], "site": str(site)}
    if proc.returncode != 0:
        out["error"] = f"pip install exit {proc.returncode}: {proc.stderr[-800:]}"
    return out


class Check:
    """The stages run so far, written out after each."""

    def __init__(self, out: Path, work: Path, dry_run: bool, budget_s: float) -> None:
        self.out, self.work, self.dry_run = out, work, dry_run
        self.started = time.time()
        self.deadline = time.monotonic() + budget_s
        self.data: dict[str, Any] = {"dry_run": dry_run, "budget_s": budget_s,
                                     "started_unix_s": self.started, "stages": {},
                                     "goals": [], "work_dir": str(work)}
        self.env = clean_env()
        self.log_path = out / "gpu_check.log"
        self.log_path.write_text("")

    def prepare_env(self) -> None:
        wheels = install_wheels(self.work)
        self.data["wheels"] = wheels
        paths = [wheels["site"]] if "site" in wheels and "error" not in wheels else []
        self.env["PYTHONPATH"] = os.pathsep.join(
            [*paths, str(REPO), *filter(None, [os.environ.get("PYTHONPATH", "")])])
        self.write()

    def run(self, name: str, later: list[str]) -> None:
        what, limit, least = STAGES[name]
        reserved = sum(STAGES[n][2] for n in later)
        left = self.deadline - time.monotonic()
        allowed = min(limit * (3 if self.dry_run else 1), left - reserved)
        if allowed < least:
            self.data["stages"][name] = {
                "ok": False, "what": what, "seconds": 0.0, "figures": {},
                "error": f"not run: {left:.0f}s of the budget left, {reserved}s kept for "
                         "the stages after it"}
            self.write()
            log(f"[{name}] skipped: budget")
            return
        log(f"[{name}] {what} (limit {allowed:.0f}s)")
        result_path = self.work / f"{name}.json"
        result_path.unlink(missing_ok=True)
        stage_log = self.work / f"{name}.log"
        cmd = [sys.executable, str(STAGES_PY), name, "--work", str(self.work),
               "--limit-s", str(int(allowed))]
        if self.dry_run:
            cmd.append("--dry-run")
        t0 = time.monotonic()
        timed_out, code = False, None
        with open(stage_log, "wb") as sink:
            proc = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=sink,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = proc.wait(timeout=allowed)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _stop_group(proc)
        seconds = time.monotonic() - t0
        got = _read_json(result_path)
        text = stage_log.read_text(errors="replace")
        ok = bool(got.get("ok")) and code == 0 and not timed_out
        error = got.get("error")
        if timed_out:
            error = f"timed out after {allowed:.0f}s" + (f"; {error}" if error else "")
        elif not ok and not error:
            error = f"exit {code}: " + " | ".join(text.strip().splitlines()[-3:])[-800:]
        self.data["stages"][name] = {"ok": ok, "what": what, "seconds": round(seconds, 1),
                                     "figures": got.get("figures", {}), "error": error,
                                     "exit_code": code, "log_tail": text[-4000:]}
        with open(self.log_path, "a") as f:
            f.write(f"\n===== {name} ({seconds:.1f}s, {'ok' if ok else 'FAILED'}) =====\n")
            f.write(text[-200_000:])
        log(f"[{name}] {'ok' if ok else 'FAILED'} in {seconds:.1f}s"
            + (f": {error}" if error and not ok else ""))
        self.write()

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.time() - self.started, 1)
        self.data["goals"] = goals(self.data["stages"], self.dry_run)
        tmp = self.out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        tmp.replace(self.out / "gpu_check.json")
        (self.out / "gpu_check.md").write_text(markdown(self.data))


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """End what is left of the stage's process group (its server, its torchrun ranks):
    TERM, up to 10 s, then KILL."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return  # nothing left: the stage closed everything it started
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    time.sleep(1.0)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--out", type=Path, help="where gpu_check.json, .md and .log go")
    p.add_argument("--dry-run", action="store_true",
                   help="every stage on the CPU with tiny sizes (gloo instead of NCCL)")
    p.add_argument("--only", default="", help=f"comma list of stages ({', '.join(STAGES)}); "
                   "prepare always runs")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="the whole check's time (default 570 s; dry run 1800 s)")
    p.add_argument("--work", type=Path, help="the stages' files (default: a temporary folder)")
    p.add_argument("--fetch-wheels", action="store_true",
                   help="download the wheels the device needs into .whl/ and stop")
    p.add_argument("--python-version", default="3.12",
                   help="--fetch-wheels: the device's python (default 3.12)")
    args = p.parse_args(argv)
    if args.fetch_wheels:
        return fetch_wheels(args.python_version)
    if args.out is None:
        p.error("--out DIR is required")
    names = [n for n in args.only.split(",") if n]
    for n in names:
        if n not in STAGES:
            p.error(f"--only: {n!r} is not one of {', '.join(STAGES)}")
    chosen = [n for n in STAGES if n == "prepare" or not names or n in names]
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu_check-"))
    work.mkdir(parents=True, exist_ok=True)
    budget = args.budget_s or (1800.0 if args.dry_run else 570.0)
    check = Check(args.out, work, args.dry_run, budget)
    check.prepare_env()
    for i, name in enumerate(chosen):
        check.run(name, chosen[i + 1:])
    check.write()
    print(markdown(check.data), flush=True)
    return 0 if all(s["ok"] for s in check.data["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
