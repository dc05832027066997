"""Every shell block of README.md and docs/ runs as pasted on a fresh clone, also while the
README's own server (port 50051, ps.log) still runs: each block is checked statically
(programs, flags, the files it reads, ports and logs), and the cheap ones run in a scratch
directory (tests/testing/doc_blocks.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.doc_samples import DYNAMIC_ARGS, page_sample, without_run_ids
from scripts.doc_samples import dynamic_lines as sample_lines
from tests.docs.test_readme_sample import _ignored
from tests.testing.doc_blocks import PAGES, ROOT, Block, blocks, commands, program, static_problems

# Blocks of pages this change does not mark (README.md is held under 12 KB; the others are
# other changes' pages), by (page, first command line): why the suite does not run them.
NOT_RUN_HERE = {
    ("README.md", "bash scripts/run_default_job.sh   # a shard server + 2 CPU ranks train the "
     "default job (~1-2 min)"): "1-2 min of training, then the 15-minute suite",
    ("README.md", "docker compose up --build --abort-on-container-exit --exit-code-from "
     "worker"): "builds an image",
    ("README.md", "python -m ps --port 50051 > ps.log 2>&1 &"): "three training runs",
    ("README.md", "python -m ps.admin stats --ps 127.0.0.1:50051"): "needs the README's "
     "server; --watch runs until Ctrl-C",
    ("deploy.md", "docker compose up --build --abort-on-container-exit --exit-code-from "
     "worker"): "builds an image",
    ("deploy.md", "mkdir -p runs"): "several nodes",
    ("gpu_check.md", "python gpu_check/check.py --fetch-wheels"): "downloads wheels",
    ("performance.md", "pip install -e '.[bench]' && pip install --no-deps torchrec==1.8.0"):
        "installs packages; benchmarks of half an hour",
    ("reliability.md", "python campaigns/fault_campaign.py --quick   # ~2 min: 120 damages + 1 "
     "resumed run"): "minutes; tests/system/test_fault_campaign.py runs the quick one",
    ("reliability.md", "python campaigns/server_kill_campaign.py --seed 23              # 20 "
     "kills, a 300-step run"): "minutes; tests/system/test_kill_campaign.py runs the short one",
    ("reliability.md", "python campaigns/soak.py                                        # 10 "
     "minutes"): "10 minutes; tests/system/test_soak.py runs the short one",
    ("reliability.md", "python fuzz/fuzz_proto.py --threads 4     # 100,000 messages"):
        "minutes; tests/system/test_fuzz_proto.py runs the short one",
}
_DEPLOY = ("python -m ps --host 0.0.0.0 --port 50051 --auth-token-file /etc/hybridps/token "
           "--tls-cert /etc/hybridps/server.pem --tls-key /etc/hybridps/server.key")
# What the static check finds on pages this change does not edit, by (page, problem without
# its line number); each entry must still be found, so that it goes once fixed.
NOT_FIXED_HERE = {
    # the nodes of a multi-node job, where the README's server does not run
    ("deploy.md", f"`{_DEPLOY}`: starts a server on 50051, the port of the README's server: "
     "use --port 0 --port-file FILE"),
}


def _without_line(problem: str) -> tuple[str, str]:
    where, what = problem.split(": ", 1)
    return Path(where.split(":")[0]).name, what


def _runs(block: Block) -> bool:
    return block.not_run is None and (block.page.name, block.first) not in NOT_RUN_HERE


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_block_passes_the_static_check(page: Path) -> None:
    found = [_without_line(p) for p in static_problems(blocks(page))]
    known = {entry for entry in NOT_FIXED_HERE if entry[0] == page.name}
    new = [f"{page.name}: {what}" for name, what in found if (name, what) not in known]
    assert not new, "shell blocks that do not run as pasted:\n" + "\n".join(new)
    gone = known - set(found)
    assert not gone, f"fixed now, remove from NOT_FIXED_HERE: {sorted(gone)}"


def test_what_the_blocks_write_stays_out_of_git() -> None:
    patterns = [line.strip() for line in (ROOT / ".gitignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    written: set[str] = set()
    for page in PAGES:
        page_written: set[str] = set()
        static_problems(blocks(page), made=page_written)
        given = {path for block in blocks(page) for path in block.given}
        written |= {p for p in page_written - given if not p.startswith("/")}
    assert "runs/dyn.port" in written and "model.pt" in written
    # a directory (mkdir, --checkpoint-dir) counts as ignored when what is in it is
    assert sorted(p for p in written if not _ignored(p, patterns)
                  and not _ignored(p + "/file", patterns)) == []


def test_every_block_runs_in_the_suite_or_says_why_not() -> None:
    every = [block for page in PAGES for block in blocks(page)]
    named = {(block.page.name, block.first) for block in every}
    assert not set(NOT_RUN_HERE) - named, "NOT_RUN_HERE names blocks that are gone: " + str(
        sorted(set(NOT_RUN_HERE) - named))
    marked_twice = [b.where for b in every
                    if b.not_run and (b.page.name, b.first) in NOT_RUN_HERE]
    assert not marked_twice, f"marked on the page and in NOT_RUN_HERE: {marked_twice}"
    # what the suite runs must finish in seconds: no training, no foreground server
    slow = []
    for block in filter(_runs, every):
        for cmd in commands(block.text):
            prog = program(cmd.argv)
            if prog is None:
                continue
            trains = bool(prog.launcher_args) or (prog.key == "worker.main"
                                                   and "--steps" not in prog.args)
            if trains or (prog.key == "ps" and not cmd.background) or "--watch" in prog.args:
                slow.append(f"{block.where}: {cmd.text[:70]}")
    assert not slow, ("blocks the suite would run that do not end in seconds: mark them "
                      "<!-- not run: REASON -->\n" + "\n".join(slow))


OLD_OPERATIONS = """\
python -m ps --port 0 --port-file ps.port &
torchrun --standalone --nproc_per_node 2 worker/main.py --ps 127.0.0.1:$(cat ps.port) \\
    --progress false --results runs/1k.json                        # default: 1000 steps
"""
OLD_DYNAMIC = """\
python -m ps --port 50051 --checkpoint-root runs > ps.log 2>&1 &
python -m worker.main --ps 127.0.0.1:50051 --task tables --steps 30
"""


def _problems(text: str, page: str = "docs/x.md") -> list[str]:
    return [p.split(": ", 1)[1] for p in
            static_problems([Block(ROOT / page, 1, text)])]


def test_the_static_check_finds_what_a_pasting_user_meets() -> None:
    race = _problems(OLD_OPERATIONS)
    assert any("reads ps.port before the server wrote it" in p for p in race), race
    assert any("log on the terminal" in p for p in race), race
    fixed = OLD_OPERATIONS.replace("ps.port &", "ps.port > x.log 2>&1 &\n"
                                   "until [ -s ps.port ]; do sleep 0.2; done")
    assert _problems(fixed) == []
    clash = _problems(OLD_DYNAMIC)
    assert any("starts a server on 50051" in p for p in clash), clash
    assert any("writes ps.log, the README's server's log" in p for p in clash), clash
    assert _problems(OLD_DYNAMIC, "README.md") == []  # the README's own server
    assert _problems("python -m worker.export --state runs/x.pt --out y.pt") == [
        "`python -m worker.export --state runs/x.pt --out y.pt`: reads runs/x.pt, which "
        "is neither in the repository nor made by an earlier block"]
    made = "python worker/main.py --local-optimizer --steps 2 --dump-state runs/x.pt\n"
    assert _problems(made + "python -m worker.export --state runs/x.pt --out y.pt") == []
    assert _problems("python -m worker.plan --world-size 2 --no-such-flag 1") == [
        "`python -m worker.plan --world-size 2 --no-such-flag 1`: worker.plan has no flag "
        "--no-such-flag"]
    launch = "hybridps-run --standalone --nprocs 2 worker/main.py --local-optimizer"
    assert _problems(launch) == [f"`{launch}`: torchrun has no flag --nprocs"]
    assert _problems("python worker/main.py --local-optimizer --optimizer adamm") == [
        "`python worker/main.py --local-optimizer --optimizer adamm`: the worker refuses it: "
        "optimizer='adamm' is not one of adam, adamw, sgd, adagrad, "
        "rowwise_adagrad, partial_rowwise_adam"]
    assert _problems("python -m worker.no_such_module") == [
        "`python -m worker.no_such_module`: no module or script 'worker.no_such_module'"]
    assert _problems("python -m ps.admin stats --ps 127.0.0.1:50051 --wide") == []


def test_the_dynamic_sample_script_runs_the_pages_example() -> None:
    block = blocks(ROOT / "docs" / "dynamic_ids.md")[0]
    run = next(c for c in commands(block.text) if c.argv[:3] == ["python", "-m", "worker.main"])
    args = run.argv[3:]
    assert args[:2] == ["--ps", "127.0.0.1:SUBST"]
    own = ["--checkpoint-dir", "runs/dyn", "--results", "runs/dyn.json"]
    assert args[2:] == [*DYNAMIC_ARGS, *own]


def _scratch_copy(tmp_path: Path) -> Path:
    """A directory that looks like a fresh clone to a block: the tracked top-level entries
    and the environment, linked; what a block writes stays here."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    for name in {path.split("/")[0] for path in tracked} | {".venv"}:
        if (ROOT / name).exists():
            (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


RUN_PAGES = [page for page in PAGES if any(_runs(block) for block in blocks(page))]


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: p.name)
def test_the_cheap_blocks_run_as_pasted(page: Path, tmp_path: Path) -> None:
    cwd = _scratch_copy(tmp_path)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("HYBRIDPS_") and k not in ("COLUMNS", "PYTHONPATH")}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    groups = []
    try:
        for block in filter(_runs, blocks(page)):
            proc = subprocess.Popen(["bash", "-e", "-c", block.text], cwd=cwd, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)
            groups.append(proc.pid)
            out, err = proc.communicate(timeout=200)
            assert proc.returncode == 0, f"{block.where} failed:\n{out[-2000:]}\n{err[-3000:]}"
            if "<!-- sample: dynamic" in page.read_text() and "worker.main" in block.text:
                got = without_run_ids(sample_lines(out))
                want = without_run_ids(page_sample(page.read_text(), "dynamic"))
                assert got == want, ("docs/dynamic_ids.md's counters drifted; run `python "
                                     "scripts/doc_samples.py dynamic`:\n" + "\n".join(got))
    finally:
        for group in groups:  # the servers a block left in the background
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGTERM)
