"""Generated samples in docs/: taken from real runs, so that they say what the code does.

    python scripts/doc_samples.py dynamic      # run docs/dynamic_ids.md's worked example
                                               # (~10 s), put its counter lines into the page
    python scripts/doc_samples.py operations   # train the default job for 1000 and 5000 steps
                                               # (~5-15 min on 2 cores), record the numbers in
                                               # docs/samples/default_job.json, write the table
                                               # of docs/operations.md from them
    python scripts/doc_samples.py plan         # docs/kge.md's sizing example (`--plan`, ~3 s)
    python scripts/doc_samples.py --check      # exit 1 when a page differs from its record

Each sample sits between `<!-- sample: NAME (scripts/doc_samples.py) -->` and
`<!-- end of sample -->`. tests/docs/test_doc_samples.py reruns the dynamic example and the
plan (cheap) and compares them with the pages, and checks that operations.md's table is the
one rendered from the record (a 5000-step run is too slow for the suite). Every server runs
on a free port, so that the runs do not meet a server already on 50051.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
DYNAMIC_PAGE = DOCS / "dynamic_ids.md"
OPERATIONS_PAGE = DOCS / "operations.md"
KGE_PAGE = DOCS / "kge.md"
RECORD = DOCS / "samples" / "default_job.json"
END_MARK = "<!-- end of sample -->"
SAMPLES = ("dynamic", "operations", "plan")

# docs/dynamic_ids.md's worked example (the page's block runs the same flags)
DYNAMIC_ARGS = ["--task", "tables", "--num-rows", "300", "--dim", "8",
                "--tables", "user:40:dynamic:lfu:expire=6,ad:30:3:dynamic:threshold=2,s:50",
                "--staleness", "2", "--steps", "30", "--batch-size", "32",
                "--checkpoint-every", "10"]
# docs/operations.md's table: steps -> the flags beyond the default job's
OPERATIONS_RUNS = {1000: [], 5000: ["--eval-every", "250"]}
# docs/kge.md's sizing example: a Wikidata5M-sized table on 2 ranks of one node; the host's
# memory given, so that the plan is the same on every machine. A line of the page each.
PLAN_ENV = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
PLAN_ARGS = [["--plan", "--task", "kge_planted"],
             ["--num-rows", "4600000", "--dim", "128", "--ps", "127.0.0.1:1", "--neg-ratio",
              "64", "--batch-size", "1024", "--host-memory-gb", "32"]]
RUN_ID = re.compile(r"\brun-[0-9a-f]+\b|\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-"
                    r"[0-9a-f]{12}\b")


def begin_mark(name: str) -> str:
    return f"<!-- sample: {name} (scripts/doc_samples.py) -->"


def page_sample(text: str, name: str) -> list[str]:
    """The lines between sample `name`'s markers (code fences dropped)."""
    mark = begin_mark(name)
    if mark not in text or END_MARK not in text.split(mark, 1)[1]:
        raise ValueError(f"no sample {name!r}: the page lacks {mark!r} ... {END_MARK!r}")
    inner = text.split(mark, 1)[1].split(END_MARK, 1)[0].strip().splitlines()
    return [line for line in inner if not line.startswith("```")]


def with_sample(text: str, name: str, lines: Sequence[str], fence: bool) -> str:
    """`text` with sample `name` replaced by `lines` (in a code fence when `fence`)."""
    mark = begin_mark(name)
    head, rest = text.split(mark, 1)
    tail = rest.split(END_MARK, 1)[1]
    body = "\n".join(["```", *lines, "```"] if fence else lines)
    return head + mark + "\n" + body + "\n" + END_MARK + tail


def without_run_ids(lines: Sequence[str]) -> list[str]:
    return [RUN_ID.sub("RUN", line) for line in lines]


def dynamic_lines(output: str) -> list[str]:
    """The server report's dynamic-table lines of a run's stdout (a line and its
    continuation), trailing spaces dropped."""
    out: list[str] = []
    after_dynamic = False  # the line before was a dynamic line's first part
    for line in output.splitlines():
        if line.startswith("dynamic ") or (after_dynamic and line.startswith("  ")):
            out.append(line.rstrip())
        after_dynamic = line.startswith("dynamic ")
    if not out:
        raise ValueError("no 'dynamic ...' line in the run's output: not a dynamic-table run")
    return out


class Server:
    """A shard server on a free port in `directory`, its checkpoint root there."""

    def __init__(self, directory: Path) -> None:
        port_file = directory / "ps.port"
        self.log = directory / "ps.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ps", "--port", "0", "--port-file", str(port_file),
                 "--checkpoint-root", str(directory),
                 # the docs' budget: each table's quota in the sample is the same everywhere
                 "--memory-budget-mb", "1024"], cwd=ROOT, stdout=log,
                stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the shard server did not start: {self.log.read_text()}")
            time.sleep(0.1)
        self.address = "127.0.0.1:" + port_file.read_text().strip()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _env() -> dict[str, str]:
    # a pipe's output, one line per item as off a terminal: no COLUMNS to wrap to
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_dynamic(directory: Path) -> list[str]:
    """Run the worked example against a fresh server; its dynamic-table lines."""
    server = Server(directory)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "worker.main", "--ps", server.address, *DYNAMIC_ARGS,
             "--checkpoint-dir", str(directory / "dyn"), "--results",
             str(directory / "dyn.json"), "--progress", "false"],
            cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600, check=False)
    finally:
        server.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"the dynamic example failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    return dynamic_lines(proc.stdout)


def plan_command() -> list[str]:
    """The plan's command as docs/kge.md shows it: a shell prompt, continuation lines."""
    env = " ".join(f"{k}={v}" for k, v in PLAN_ENV.items())
    first, *rest = PLAN_ARGS
    lines = [f"$ {env} python worker/main.py {' '.join(first)}"]
    lines += [f"      {' '.join(args)}" for args in rest]
    return [line + " \\" for line in lines[:-1]] + lines[-1:]


def run_plan() -> list[str]:
    """docs/kge.md's sample: the plan's command, then what it prints."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "worker" / "main.py"), *(a for a_s in PLAN_ARGS for a in a_s)],
        cwd=ROOT, env={**_env(), **PLAN_ENV}, capture_output=True, text=True, timeout=300,
        check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the plan failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return [*plan_command(), *(line.rstrip() for line in proc.stdout.splitlines())]


def run_default_job(directory: Path, steps: int, extra: Sequence[str]) -> dict[str, Any]:
    """Train the default job on 2 ranks for `steps`; the table row's numbers."""
    server = Server(directory)
    results = directory / f"{steps}.json"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "worker.launch", "--standalone", "--nproc_per_node", "2",
             str(ROOT / "worker" / "main.py"), "--ps", server.address, "--steps", str(steps),
             *extra, "--progress", "false", "--results", str(results)],
            cwd=ROOT, env=_env(), capture_output=True, text=True, check=False)
    finally:
        server.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"the {steps}-step job failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    data = json.loads(results.read_text())
    final = data["eval"]
    return {"steps": steps, "flags": list(extra), "eval_loss": final["loss"],
            "planted_loss": final["planted_loss"], "auc": final["auc"],
            "planted_auc": final["planted_auc"], "first_loss": data["loss_curve"][0][1],
            "last_loss": data["loss_curve"][-1][1]}


def operations_table(record: dict[str, Any]) -> list[str]:
    """docs/operations.md's table from the record."""
    lines = ["| steps | held-out loss | planted model's loss | AUC | planted model's AUC "
             "| train loss first -> last window |", "|---|---|---|---|---|---|"]
    for row in record["rows"]:
        label = f"{row['steps']} (the default)" if row["steps"] == 1000 else str(row["steps"])
        lines.append(f"| {label} | {row['eval_loss']:.4f} | {row['planted_loss']:.4f} | "
                     f"{row['auc']:.4f} | {row['planted_auc']:.4f} | "
                     f"{row['first_loss']:.4f} -> {row['last_loss']:.4f} |")
    return lines


def _commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    return proc.stdout.strip() or "unknown"


def check() -> list[str]:
    """What differs between the pages and their records ([] when none)."""
    found = []
    record = json.loads(RECORD.read_text())
    if page_sample(OPERATIONS_PAGE.read_text(), "operations") != operations_table(record):
        found.append(f"docs/operations.md's table differs from {RECORD.relative_to(ROOT)}")
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # no argparse `choices`: with nargs="*", Python 3.11 checks the empty default against
    # them and refuses a bare --check
    parser.add_argument("sample", nargs="*", metavar="SAMPLE",
                        help=f"the samples to regenerate: {', '.join(SAMPLES)}")
    parser.add_argument("--check", action="store_true",
                        help="compare the pages with the records instead of running")
    args = parser.parse_args(argv)
    if args.check:
        found = check()
        print("\n".join(found) or "the samples match their records", file=sys.stderr)
        return 1 if found else 0
    unknown = [name for name in args.sample if name not in SAMPLES]
    if unknown:
        parser.error(f"no sample {unknown[0]!r}: the samples are {', '.join(SAMPLES)}")
    if not args.sample:
        parser.error(f"name a sample to regenerate ({', '.join(SAMPLES)}) or give --check")
    with tempfile.TemporaryDirectory(prefix="doc-samples-") as tmp:
        if "dynamic" in args.sample:
            lines = run_dynamic(Path(tmp))
            DYNAMIC_PAGE.write_text(with_sample(DYNAMIC_PAGE.read_text(), "dynamic", lines,
                                                fence=True))
            print(f"docs/dynamic_ids.md: {len(lines)} counter lines", file=sys.stderr)
        if "plan" in args.sample:
            lines = run_plan()
            KGE_PAGE.write_text(with_sample(KGE_PAGE.read_text(), "plan", lines, fence=True))
            print(f"docs/kge.md: the plan's {len(lines)} lines", file=sys.stderr)
        if "operations" in args.sample:
            rows = []
            for steps, extra in OPERATIONS_RUNS.items():
                run_dir = Path(tmp) / f"job{steps}"
                run_dir.mkdir()
                rows.append(run_default_job(run_dir, steps, extra))
            record = {"date": time.strftime("%Y-%m-%d"), "commit": _commit(), "rows": rows}
            RECORD.parent.mkdir(exist_ok=True)
            RECORD.write_text(json.dumps(record, indent=1) + "\n")
            OPERATIONS_PAGE.write_text(with_sample(OPERATIONS_PAGE.read_text(), "operations",
                                                   operations_table(record), fence=False))
            print(f"docs/operations.md: the table of {RECORD.relative_to(ROOT)}",
                  file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
