"""What a user sees: a 2-rank run on a pseudo-terminal (like a shell) and on pipes (like a log
file or CI). Log lines go around rank 0's progress bar, the default `--log-level auto` keeps a
terminal to one line per phase, and every checkpoint written gets a log line and a summary
entry (where, how big, how long) also in the results JSON."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Any

import pytest

from tests.testing.helpers import REPO
from worker.report.console import (
    bar_layout,
    bar_postfix,
    checkpoint_lines,
    end_bar,
    human_bytes,
    optimizer_line,
    run_extent,
)

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (?P<level>[A-Z]+) (?P<logger>\S+) "
                  r"rank=(?P<rank>\d+) (?P<message>.*)$")


def _command(tmp_path: Path, ps: str, *extra: str) -> list[str]:
    return [TORCHRUN, "--standalone", "--nproc_per_node", "2", str(REPO / "worker" / "main.py"),
            "--ps", ps, "--num-rows", "4000", "--batch-size", "32", "--dim", "8",
            "--steps", "60", "--log-every", "5", "--eval-every", "20",
            "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "20",
            "--results", str(tmp_path / "run.json"), *extra]


def _env(columns: int = 150) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", COLUMNS=str(columns))
    return env


def run_on_terminal(cmd: list[str], timeout: float = 200, columns: int = 150
                    ) -> tuple[int, str]:
    """Run with stdout and stderr on a `columns`x40 pseudo-terminal; returns (exit code,
    output)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(columns), stdin=subprocess.DEVNULL,
                            stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every writer closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return code, b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")


def screen_lines(output: str) -> list[str]:
    """Each line as a terminal leaves it: a carriage return starts the line over."""
    return [segment.split("\r")[-1] for segment in output.split("\n")]


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_terminal_shows_phases_bar_and_checkpoints_without_interleaving(
        tmp_path: Path, ps_server: str) -> None:
    code, output = run_on_terminal(_command(tmp_path, ps_server))
    assert code == 0, output[-4000:]
    lines = screen_lines(output)
    # No log line inside the progress bar: a row shows either the bar or a log line.
    mixed = [line for line in lines if "%|" in line and (
        " INFO " in line or " WARNING " in line or LINE.search(line.split("|")[-1]))]
    assert not mixed, mixed
    logs = [m for m in (LINE.match(line) for line in lines) if m]
    # --log-level auto on a terminal: rank 0 INFO without the per-connection detail (shm
    # arena, gRPC channel, process group, Finish), rank 1 only warnings (none here): start,
    # ready, one line per checkpoint.
    assert {m["rank"] for m in logs} == {"0"}, [m.group(0) for m in logs]
    events = [re.match(r"(event=\S+|checkpoint step \d+)", m["message"]) for m in logs]
    assert [e.group(1) if e else m["message"] for e, m in zip(events, logs, strict=True)] == [
        "event=start", "event=ready", "checkpoint step 19", "checkpoint step 39",
        "checkpoint step 59"]
    kinds = [re.search(r"-> \S+step-00000000\d9: [\d.]+ (KiB|MiB) (full|incremental) in "
                       r"[\d.]+s", m["message"]) for m in logs[2:]]
    # the first checkpoint of a run is full, the next ones are links of its chain
    assert [k.group(2) if k else None for k in kinds] == ["full", "incremental", "incremental"]
    assert any("%|" in line and "loss=" in line for line in lines)  # the bar was there
    # the summary lists every checkpoint: where, how big, how long
    summary = [line for line in lines if line.startswith("  step ")]
    assert len(summary) == 3 and all(str(tmp_path / "ck") in line for line in summary)
    assert re.search(r"checkpoints: 3 written \([\d.]+ MiB, [\d.]+s\)", output)
    written = json.loads((tmp_path / "run.json").read_text())["checkpoint"]["written"]
    assert [w["step"] for w in written] == [19, 39, 59]
    for w in written:
        path = Path(w["path"])
        assert path.is_dir() and w["seconds"] > 0
        assert w["bytes"] == sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_an_80_column_terminal_gets_a_bar_that_fits_and_the_rest_as_a_log_line(
        tmp_path: Path, ps_server: str) -> None:
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node", "2", str(REPO / "worker" / "main.py"),
           "--ps", ps_server, "--num-rows", "4000", "--batch-size", "32", "--dim", "8",
           "--steps", "60", "--log-every", "5", "--eval-every", "20"]
    code, output = run_on_terminal(cmd, columns=80)
    assert code == 0, output[-4000:]
    bars = [line for line in screen_lines(output) if "%|" in line]
    assert bars and any("loss=" in line for line in bars), output[-3000:]
    assert all(len(line.rstrip()) <= 80 for line in bars), [len(b) for b in bars]
    # what did not fit (speed and staleness at least) is on the progress line
    progress = [line for line in screen_lines(output) if "event=progress step=49 " in line]
    assert len(progress) == 1, output[-3000:]
    assert " sps=" in progress[0] and " waits=" in progress[0], progress[0]
    # the summary and the shard server's stats are cut between fields to fit
    screen = screen_lines(output)
    start = next(i for i, line in enumerate(screen) if line.startswith("hybridps worker: "))
    report = [line for line in screen[start:] if line.strip() and not LINE.match(line)]
    assert any(line.startswith("optimizer adam lr ") for line in report), report
    assert any(line.startswith("run ") for line in report), report  # the stats table
    assert all(len(line.rstrip()) <= 80 for line in report), [
        line for line in report if len(line.rstrip()) > 80]


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_pipes_keep_every_ranks_info_lines(tmp_path: Path, ps_server: str) -> None:
    """Off a terminal (a log file, CI, a container) `auto` keeps the complete record."""
    proc = subprocess.run(_command(tmp_path, ps_server, "--progress", "false"), cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert re.search(r"INFO worker rank=1 event=start ", proc.stderr)
    assert re.search(r"INFO worker\.rendezvous rank=1 ", proc.stderr)
    assert re.search(r"INFO worker\.sync rank=0 event=finished ", proc.stderr)
    assert proc.stderr.count("INFO worker.checkpoint rank=0 checkpoint step") == 3


def test_bar_fields_and_checkpoint_summary_lines() -> None:
    fields = bar_postfix(0.51234, {"loss": 0.5, "auc": 0.75, "planted_auc": 0.8}, 1234.5, 1,
                         0.5, 0)
    assert list(fields) == ["loss", "eval_loss", "auc", "sps", "stale", "lag", "waits"]
    assert fields["loss"] == "0.5123" and fields["eval_loss"] == "0.5000"
    written = [{"step": s, "path": f"ck/step-{s}", "bytes": 3 << 20, "seconds": 0.5}
               for s in range(12)]
    lines = checkpoint_lines(written)
    assert lines[0] == "checkpoints: 12 written (36.0 MiB, 6.00s)"
    assert lines[1] == "  step 0: ck/step-0  3.0 MiB  0.50s" and len(lines) == 12
    assert lines[-1].startswith("  ... 2 more")
    assert checkpoint_lines([]) == []
    assert [human_bytes(n) for n in (5, 2048, 5 << 30)] == ["5 B", "2.0 KiB", "5.0 GiB"]


def test_the_summary_says_how_far_training_went() -> None:
    """`steps N` counts the steps; a step named is numbered from 0, as in the log lines,
    the checkpoints and the results JSON."""
    done = {"steps": 1000, "last_step": 999, "hooks": None}
    assert run_extent(done) == "steps 1000"
    assert run_extent({"steps": 1000}) == "steps 1000"  # results without last_step
    early: dict[str, Any] = {"steps": 4100, "last_step": 573,
                             "hooks": {"stopped_early": True, "best_step": 409,
                                       "restored_best": True}}
    assert run_extent(early) == ("stopped early after step 573 (574 of 4100 steps; "
                                 "best step 409, restored)")
    kept_last = {**early, "hooks": {**early["hooks"], "restored_best": False}}
    assert run_extent(kept_last).endswith("(574 of 4100 steps; best step 409)")
    budget = {"steps": 4100, "last_step": 573, "hooks": None}  # a time budget, SIGTERM
    assert run_extent(budget) == "stopped after step 573 (574 of 4100 steps)"


def test_the_summary_names_the_optimizers() -> None:
    res = {"optimizer": {"rows": {"kind": "adam", "lr": 0.01, "weight_decay": 0.0},
                         "dense": {"kind": "adam", "lr": 0.003, "weight_decay": 0.0}}}
    assert optimizer_line(res) == "optimizer adam lr 0.01  dense adam lr 0.003"
    decayed = {"optimizer": {"rows": {"kind": "adamw", "lr": 0.1, "weight_decay": 1e-05},
                             "dense": {"kind": "adamw", "lr": 0.1, "weight_decay": 1e-05}}}
    assert optimizer_line(decayed).startswith("optimizer adamw lr 0.1 weight_decay 1e-05  ")


def test_a_stopped_run_ends_its_bar_full_saying_why() -> None:
    import io

    from tqdm import tqdm

    sink = io.StringIO()
    bar = tqdm(total=4100, desc="train", file=sink, ncols=80, mininterval=0,
               bar_format=bar_layout()["bar_format"])
    bar.update(574)
    bar.set_postfix_str("loss=0.5000, valid_mrr=0.8000, sps=1234")
    end_bar(bar, "stopped early", 4100)
    bar.close()
    last = sink.getvalue().split("\r")[-1].strip()
    assert last.startswith("train (stopped early; 4100 planned): 100%|"), last
    assert "| 574/574 " in last and len(last) <= 80, last
    off = tqdm(total=10, disable=True)
    end_bar(off, "stopped early", 10)  # --progress false: nothing to end
