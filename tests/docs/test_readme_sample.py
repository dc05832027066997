"""README.md's sample output is what the console prints (scripts/readme_sample.py), and what
the documented commands write stays out of git (.gitignore)."""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.readme_sample import (
    README,
    console_block,
    differences,
    readme_block,
    skeleton,
    with_block,
)
from tests.testing.helpers import REPO, start_ps_server

MAIN = str(REPO / "worker" / "main.py")


def test_skeletons_ignore_numbers_ids_and_column_widths() -> None:
    assert skeleton("steps 1000  loss 0.6745 -> 0.5344  samples/s 7220  train 70.9s") == \
        skeleton("steps 20  loss 0.6931 -> 0.6900  samples/s 123  train 1.0s")
    assert skeleton("815380d9  active      2       4   999    0    8000   18442    136.7") == \
        skeleton("1f0c2b7e  active  2  4  19  0  160  99  136.7")
    assert skeleton("hybridps worker: task=synthetic run_id=815380d9-2506-44c3-a2f1-"
                    "419504007366") == skeleton("hybridps worker: task=synthetic run_id=x")
    assert skeleton("server vm-25641-994190  uptime 2m03s") == skeleton(
        "server other-1-2  uptime 1h02m") == skeleton("server x  uptime 30.2s")
    assert skeleton("eval: auc 0.81  loss 0.52") != skeleton("eval: auc 0.81")  # words count


def test_the_block_is_the_runs_summary_with_relative_paths(tmp_path: Path) -> None:
    output = "\n".join(["shard server on 127.0.0.1:5 (log: x)", "hybridps worker: task=a",
                        "steps 3", f"wrote {tmp_path}/runs/r.json  {tmp_path}/runs/r.png",
                        "next: ..."])
    assert console_block(output, tmp_path) == ["hybridps worker: task=a", "steps 3",
                                               "wrote runs/r.json  runs/r.png"]
    with pytest.raises(ValueError, match="not the stdout of a worker run"):
        console_block("nothing here")
    text = README.read_text()
    lines = readme_block(text)
    assert lines[0].startswith("hybridps worker: task=synthetic mode=server world=2")
    assert lines[-1] == "wrote runs/default/results.json  runs/default/results.png"
    assert readme_block(with_block(text, ["a", "b"])) == ["a", "b"]
    assert with_block(text, lines) == text
    assert differences(lines, [*lines[:-1], "wrote elsewhere"])  # a changed line is found


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_readme_sample_output_matches_what_the_console_prints(tmp_path: Path) -> None:
    """The default job of scripts/run_default_job.sh, 20 steps instead of 1000."""
    server = start_ps_server(tmp_path / "ps")
    # the sample is a pipe's output, one line per item: no COLUMNS to wrap the summary to
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    try:
        results = tmp_path / "runs" / "default" / "results.json"
        proc = subprocess.run(
            [sys.executable, "-m", "worker.launch", "--standalone", "--nproc_per_node", "2",
             MAIN, "--ps", server.address, "--results", str(results), "--steps", "20",
             "--progress", "false"], cwd=REPO, env=env, capture_output=True, text=True,
            timeout=360, check=False)
    finally:
        server.terminate()
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = differences(readme_block(README.read_text()), console_block(proc.stdout, tmp_path))
    assert not found, ("README.md's sample output drifted from the console; run "
                       "`python scripts/readme_sample.py`:\n" + "\n".join(found))


def _ignored(path: str, patterns: list[str]) -> bool:
    parts = path.split("/")
    for pattern in patterns:
        if pattern.endswith("/"):  # a directory anywhere on the path
            if any(fnmatch.fnmatch(p, pattern[:-1]) for p in parts[:-1]):
                return True
        elif fnmatch.fnmatch(parts[-1], pattern) or fnmatch.fnmatch(path, pattern):
            return True
    return False


def test_what_the_documented_commands_write_is_ignored() -> None:
    patterns = [line.strip() for line in (REPO / ".gitignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    written = ["checkpoints/run1/step-0000000999/manifest.json", "ps.log", "ps.port",
               "ps.token", "runs/default/results.json", "runs/default/ps.log", "model.pt",
               "runs/tb/events.out.tfevents.1", ".venv/bin/python"]
    assert [p for p in written if not _ignored(p, patterns)] == []
    assert not _ignored("worker/main.py", patterns) and not _ignored("README.md", patterns)
