"""A bad output path is refused before the first step, with one line naming it:
worker/config/output_paths.py, run by worker/config/preflight.py in the launcher and
in every rank before its torch imports; the shard server's --checkpoint-root and --port-file
before it binds (ps/config.py ensure_checkpoint_root, port_file_problem).

End to end: `python worker/main.py` (and hybridps-run, python -m worker.export,
python -m ps) as a user runs them with the bad path: exit 2 at once with the one line
last, no traceback, and no step run (the worker logs `event=ready` once set up, before
its first step). Unit: what user nobody may not write (a test as root forks a child of
that user: tests/testing/other_user.py), and the names this module shares with torch modules.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hybridps.path_checks import directory_problem, file_problem
from tests.testing.other_user import nobody, run_as
from worker.config.output_paths import STEP_DIR_NAME, id_maps_path

REPO = Path(__file__).resolve().parents[3]
MAIN = str(REPO / "worker" / "main.py")
SMALL = ["--local-optimizer", "--num-rows", "200", "--dim", "4", "--batch-size", "8",
         "--steps", "3", "--progress", "false", "--log-level", "INFO"]
# The checks import no torch: the worker exits within seconds even on a loaded 2-core box
# (a run that reached its first step takes longer, and says `event=ready`).
FAST_S = 30.0
NOBODY = nobody()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _run(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=120, check=False)
    return proc, time.monotonic() - started


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _assert_refused(proc: subprocess.CompletedProcess[str], seconds: float, prefix: str,
                    *parts: str) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-4000:]
    assert seconds < FAST_S, f"took {seconds:.1f}s\n{out[-4000:]}"
    assert "Traceback" not in out, out[-4000:]
    assert "event=ready" not in out and "event=progress" not in out, "a step ran"
    last = _last_line(proc.stderr)
    assert last.startswith(prefix), out[-4000:]
    for part in parts:
        assert part in last, last
    return last


def _results_dir(tmp: Path) -> list[str]:
    (tmp / "out").mkdir()
    return ["--results", str(tmp / "out")]


def _results_under_a_file(tmp: Path) -> list[str]:
    (tmp / "runs").write_text("")
    return ["--results", str(tmp / "runs" / "r1.json")]


def _plot_is_a_directory(tmp: Path) -> list[str]:
    (tmp / "r1.png").mkdir()
    return ["--results", str(tmp / "r1.json")]


def _dump_state_dir(tmp: Path) -> list[str]:
    (tmp / "state").mkdir()
    return ["--dump-state", str(tmp / "state")]


def _checkpoint_dir_is_a_file(tmp: Path) -> list[str]:
    (tmp / "ckpt").write_text("")
    return ["--checkpoint-dir", str(tmp / "ckpt"), "--checkpoint-every", "1"]


def _step_named_file(tmp: Path) -> list[str]:
    (tmp / "ckpt").mkdir()
    (tmp / "ckpt" / "step-0000000001").write_text("")
    return ["--checkpoint-dir", str(tmp / "ckpt"), "--checkpoint-every", "2"]


def _tensorboard_is_a_file(tmp: Path) -> list[str]:
    pytest.importorskip("tensorboard")
    (tmp / "tb").write_text("")
    return ["--tensorboard", str(tmp / "tb")]


CASES: dict[str, tuple[Callable[[Path], list[str]], str, str]] = {
    # case: (its flags, the path the line names (relative to tmp_path), what it says)
    "results is a directory": (_results_dir, "out", "is a directory, where a file is "
                               "written: give a file path"),
    "results below a file": (_results_under_a_file, "runs/r1.json", "cannot be created: "),
    "its plot is a directory": (_plot_is_a_directory, "r1.png", "(its loss plot) is a "
                                "directory"),
    "dump-state is a directory": (_dump_state_dir, "state", "is a directory, where a file "
                                  "is written"),
    "checkpoint dir is a file": (_checkpoint_dir_is_a_file, "ckpt", "is a file, not a "
                                 "directory"),
    "a file named like a step directory": (_step_named_file, "ckpt", "holds "
                                           "'step-0000000001', which is a file, not a step "
                                           "directory"),
    "tensorboard is a file": (_tensorboard_is_a_file, "tb", "is a file, not a directory"),
}


@pytest.mark.e2e
@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_output_path_is_refused_before_the_first_step(case: str, tmp_path: Path
                                                            ) -> None:
    make, named, says = CASES[case]
    flags = make(tmp_path)
    proc, seconds = _run(MAIN, *SMALL, *flags)
    last = _assert_refused(proc, seconds, "hybridps worker: error: --", repr(str(tmp_path / named)),
                           says)
    assert last.startswith(f"hybridps worker: error: {flags[0]} "), last


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_the_launcher_refuses_it_before_any_rank_starts(tmp_path: Path) -> None:
    flags = _results_dir(tmp_path)
    proc, seconds = _run("-m", "worker.launch", "--standalone", "--nproc_per_node", "2", MAIN,
                         *SMALL, *flags)
    _assert_refused(proc, seconds, "hybridps-run: error: --results ",
                    repr(str(tmp_path / "out")), "is a directory")
    assert "rank" not in proc.stderr, proc.stderr[-4000:]  # no rank was started


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_export_refuses_a_directory_as_its_out_before_reading(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    proc, seconds = _run("-m", "worker.export", "--state", str(tmp_path / "absent.pt"),
                         "--out", str(tmp_path / "model"))
    _assert_refused(proc, seconds, "worker.export: error: --out ",
                    repr(str(tmp_path / "model")), "is a directory")


def _server(tmp: Path, root: Path, port_file: Path | None = None
            ) -> tuple[subprocess.CompletedProcess[str], float, Path]:
    port_file = port_file or tmp / "ps.port"
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ps", "--host", "127.0.0.1", "--port", "0",
                           "--port-file", str(port_file), "--checkpoint-root", str(root)],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60,
                          check=False)
    return proc, time.monotonic() - started, port_file


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["missing", "a file"])
def test_the_server_refuses_a_checkpoint_root_it_cannot_use_before_binding(
        kind: str, tmp_path: Path) -> None:
    root = tmp_path / "absent" / "root"  # missing, and so is its parent
    if kind == "a file":
        root = tmp_path / "root"
        root.write_text("")
    proc, seconds, port_file = _server(tmp_path, root)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert seconds < FAST_S and not port_file.exists(), "the server bound its port"
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr  # one line
    says = "does not exist, nor does its parent" if kind == "missing" else "is not a directory"
    assert proc.stderr.startswith(f"python -m ps: error: --checkpoint-root {str(root)!r} "
                                  f"{says}"), proc.stderr


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["a directory", "below a file"])
def test_the_server_refuses_a_port_file_it_cannot_write_before_binding(
        kind: str, tmp_path: Path) -> None:
    """It used to bind, serve, then end on an IsADirectoryError traceback."""
    if kind == "a directory":
        port_file = tmp_path / "ps.port"
        port_file.mkdir()
        says = (f"is a directory, where a file is written: give a file path (e.g. "
                f"{str(port_file / 'ps.port')!r})")
    else:
        (tmp_path / "runs").write_text("")
        port_file = tmp_path / "runs" / "ps.port"
        says = f"cannot be created: {str(tmp_path / 'runs')!r} is not a directory"
    proc, seconds, _ = _server(tmp_path, tmp_path / "ck", port_file)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert seconds < FAST_S and "listening" not in proc.stdout, "the server bound its port"
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr  # one line
    assert proc.stderr.startswith(f"python -m ps: error: --port-file {str(port_file)!r} "
                                  f"{says}"), proc.stderr


def test_a_port_file_in_missing_directories_is_written(tmp_path: Path) -> None:
    from ps.config import port_file_problem
    from ps.edge.server import write_port_file

    target = tmp_path / "runs" / "a" / "ps.port"
    assert port_file_problem(str(target)) is None and port_file_problem("") is None
    write_port_file(str(target), 4711)
    assert target.read_text() == "4711\n" and sorted(os.listdir(target.parent)) == ["ps.port"]


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_a_missing_root_in_an_existing_directory_is_created_and_served(tmp_path: Path
                                                                      ) -> None:
    """The default `checkpoints` of a fresh working directory, a fresh volume's
    /data/checkpoints (Dockerfile): the server creates it and serves."""
    from tests.testing.helpers import start_ps_server

    root = tmp_path / "fresh"
    with start_ps_server(tmp_path, "--checkpoint-root", str(root)) as server:
        assert root.is_dir()
        assert server.proc.poll() is None


def test_the_names_agree_with_the_modules_that_write_them() -> None:
    from hybridps.checkpoint import STEP_DIR
    from worker.tasks.kge.task import id_maps_dir

    assert STEP_DIR_NAME.pattern == STEP_DIR.pattern
    assert Path(id_maps_path("runs/r1.json")) == id_maps_dir("runs/r1.json")


@pytest.mark.skipif(os.geteuid() != 0 or NOBODY is None,
                    reason="needs root (to act as user nobody) and user nobody")
def test_a_directory_this_user_cannot_write_is_named() -> None:
    base = Path(tempfile.mkdtemp(prefix="hybridps-paths-"))  # pytest's is root's, 0700
    try:
        base.chmod(0o755)
        locked = base / "locked"
        locked.mkdir(mode=0o755)  # root's: nobody may read it, not write into it
        (base / "r1.json").write_text("")  # root's, 0644
        assert NOBODY is not None
        found = run_as(NOBODY, lambda: [
            file_problem("--results", str(locked / "sub" / "r1.json")),
            directory_problem("--checkpoint-dir", str(locked)),
            file_problem("--results", str(base / "r1.json")),
        ])
        assert found[0] == (f"--results {str(locked / 'sub' / 'r1.json')!r} cannot be "
                            f"created: directory {str(locked)!r} is not writable by this "
                            "user; give a path in a writable directory")
        assert found[1] == (f"--checkpoint-dir {str(locked)!r} is a directory not writable "
                            "by this user: fix its mode or give another directory")
        assert found[2] == (f"--results {str(base / 'r1.json')!r} is not writable by this "
                            "user: fix its mode or give another path")
        assert file_problem("--results", str(locked / "sub" / "r1.json")) is None  # root's
    finally:
        shutil.rmtree(base, ignore_errors=True)
