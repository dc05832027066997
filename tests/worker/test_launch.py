"""`hybridps-run` (worker/launch.py): every ending's last line is ours, with the right exit
code and no traceback; the checks before any rank starts (worker/config/preflight.py); under a
bare torchrun, one copy of a known error.

Unit: the worker's arguments found among torchrun's, the stop and failure lines, the data
directory's line, a rank's error reported once, a misspelled flag's suggestion.
End to end (real processes): a misspelled flag, `--task kge` without data, a bad
`--data-dir`, a wrong `--ps`, a SIGTERM stop of a training run (exit 0), a double Ctrl-C (cut
short, exit 130) and a Ctrl-C after the last line (its exit code stays), and the same errors
under a bare torchrun. An error file is written whole or not at all (unit).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from hybridps.cli import parse_config
from hybridps.datasets import data_dir_problem
from hybridps.security import ClientSecurity
from tests.testing.helpers import REPO, start_ps_server
from worker import launch
from worker.config.preflight import data_problem, server_problem
from worker.config.train_config import TrainConfig

MAIN = str(REPO / "worker" / "main.py")
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
LAUNCH = [sys.executable, "-m", "worker.launch", "--standalone", "--nproc_per_node", "2"]
FAST_S = 25.0  # a preflight failure on a loaded 2-core machine (torch is never imported)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("HYBRIDPS_") and k not in ("LOGLEVEL", "OMP_NUM_THREADS")}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def _run(cmd: list[str], timeout: float = 150) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=timeout, check=False)
    return proc, time.monotonic() - started


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _free_port() -> int:
    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _assert_quiet(text: str) -> None:
    for noise in ("Traceback", "ChildFailedError", "Failures:", "=====", "OMP_NUM_THREADS",
                  "closing signal"):
        assert noise not in text, f"{noise!r} in\n{text[-4000:]}"


# -- unit ---------------------------------------------------------------------------------

def test_the_worker_arguments_are_found_after_its_script() -> None:
    split = launch.split_worker_args
    assert split(["--standalone", "--nproc_per_node", "2", "worker/main.py", "--ps", "a:1"]) \
        == ["--ps", "a:1"]
    assert split(["--nnodes", "1", MAIN, "--steps", "3"]) == ["--steps", "3"]
    assert split(["--standalone", "-m", "worker.main", "--steps", "3"]) == ["--steps", "3"]
    assert split(["--standalone", "other/main.py", "--steps", "3"]) is None  # not ours
    assert split(["--standalone", "train.py"]) is None


def test_a_clean_stop_exits_0_unless_told_and_an_unclean_one_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(launch.STOP_EXIT_ENV, raising=False)
    notes = [{"rank": r, "step": 41, "steps": 1000, "flushed": True, "reason": "SIGTERM"}
             for r in (0, 1)]
    line, code = launch.stop_line(signal.SIGTERM, notes, 2)
    assert code == 0
    assert line == ("hybridps-run: stopped by SIGTERM after step 41 of 1000: every rank "
                    "finished the step, flushed its updates and told the server")
    monkeypatch.setenv(launch.STOP_EXIT_ENV, "signal")
    assert launch.stop_line(signal.SIGINT, notes, 2)[1] == 130
    monkeypatch.delenv(launch.STOP_EXIT_ENV)
    line, code = launch.stop_line(signal.SIGINT, notes[:1], 2)  # one rank never noted
    assert code == 130 and "1 of 2 ranks did not report a clean stop" in line
    unflushed = [notes[0], {**notes[1], "flushed": False}]
    line, code = launch.stop_line(signal.SIGTERM, unflushed, 2)
    assert code == 143 and "could not flush" in line


def test_a_stop_signal_hidden_behind_torchs_timer_still_reads_as_a_stop(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """torch's metrics wrapper reads its timer in a `finally`: a SIGTERM taken before the
    timer was set reaches the launcher as an UnboundLocalError whose context is the
    SignalException. The ranks had stopped cleanly; the launcher says so, not 'error'."""
    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def torchrun_main(_args: list[str]) -> None:
        for rank in (0, 1):  # what each rank notes on a clean stop
            monkeypatch.setenv("RANK", str(rank))
            launch.note_stop(289, 100000, True, "SIGTERM")

        def timed() -> None:
            try:
                raise SignalException("got signal: SIGTERM", sigval=signal.SIGTERM)
                start = 0.0  # never reached, as in torch's wrapper
            finally:
                print(start)

        timed()

    monkeypatch.setattr(torch.distributed.run, "main", torchrun_main)
    monkeypatch.setattr(launch.StopSignals, "install", lambda _self: True)
    monkeypatch.setenv(launch.STOP_EXIT_ENV, "signal")
    code = launch.main(["--nproc-per-node", "2", "some_script.py"])
    err = capsys.readouterr().err
    assert code == 143, err
    assert "stopped by SIGTERM after step 289 of 100000: every rank finished" in err, err
    assert "UnboundLocalError" not in err


def test_after_a_second_signal_the_line_says_which_ranks_flushed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(launch.STOP_EXIT_ENV, raising=False)
    rank0 = {"rank": 0, "step": 41, "steps": 1000, "flushed": True, "reason": "SIGINT"}
    line, code = launch.stop_line(signal.SIGINT, [rank0], 2, signal.SIGINT, [0, 1])
    assert code == 130
    assert line == ("hybridps-run: stopped by SIGINT, cut short by a second SIGINT: rank 0 "
                    "finished step 41 and flushed; rank 1 stopped at once, without flushing "
                    "(--resume goes on from the last checkpoint)")
    line, code = launch.stop_line(signal.SIGINT, [], 2, signal.SIGINT, [0, 1])
    assert code == 130 and "flushed" not in line.replace("without flushing", "")
    assert "ranks 0, 1 stopped at once, without flushing" in line
    line, _ = launch.stop_line(signal.SIGTERM, [{**rank0, "flushed": False}], 3,
                               signal.SIGINT, [0])
    assert "rank 0 could not flush" in line and "2 of 3 ranks had not started" in line
    # every rank had flushed when the second came: that is what the line says, and exit 0
    both = [rank0, {**rank0, "rank": 1}]
    line, code = launch.stop_line(signal.SIGINT, both, 2, signal.SIGINT, [0, 1])
    assert code == 0 and "every rank finished the step, flushed its updates" in line


def test_a_second_stop_signal_kills_the_ranks_not_stopped_yet(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.api import SignalException

    # torchrun's process context installs this name as its signal handler: a torch that
    # renamed it would leave a double Ctrl-C waiting 30 s again
    monkeypatch.setattr(api, "_terminate_process_handler", api._terminate_process_handler)
    signals = launch.StopSignals(str(tmp_path))
    assert signals.install() and api._terminate_process_handler is signals
    for rank, pid in ((0, 4242), (1, 4343)):
        (tmp_path / f"started-{rank}.json").write_text(json.dumps({"rank": rank, "pid": pid}))
    (tmp_path / "stopped-0.json").write_text(json.dumps(
        {"rank": 0, "step": 3, "steps": 9, "flushed": True, "reason": "SIGINT"}))
    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append((pid, sig)))
    with pytest.raises(SignalException) as first:
        signals(signal.SIGINT, None)  # the first: torchrun's agent stops the ranks
    assert first.value.sigval == signal.SIGINT and killed == []
    signals(signal.SIGTERM, None)  # the second: no exception, the rank still running dies
    assert killed == [(4343, signal.SIGKILL)]
    assert signals.second == signal.SIGTERM and sorted(signals.started) == [0, 1]


def test_an_error_file_is_never_seen_half_written(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    # torchrun, or a rank waiting for rank 0's record, reads the file as soon as it exists:
    # an empty or partial one crashed torchrun with a JSONDecodeError
    monkeypatch.delenv(launch.LAUNCHER_DIR_ENV, raising=False)
    monkeypatch.setenv("RANK", "0")
    target = tmp_path / "error.json"
    monkeypatch.setenv(launch.ERROR_FILE_ENV, str(target))
    seen: list[str] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            try:
                text = target.read_text()
            except FileNotFoundError:
                continue
            try:
                json.loads(text)
            except ValueError:
                seen.append(text)

    reader = threading.Thread(target=read)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the reader runs between any two steps of the writer
    reader.start()
    try:
        for i in range(400):
            launch.report_error(f"hybridps worker: error: boom {i} " + "x" * 2000)
            if i % 2:
                target.unlink()  # a file created afresh, and one replaced
    finally:
        done.set()
        reader.join()
        sys.setswitchinterval(switch)
    assert seen == [], f"{len(seen)} partial reads, e.g. {seen[0][:80]!r}"
    assert [p.name for p in tmp_path.iterdir()] in ([], ["error.json"])  # no temporary left


def _failure(exitcode: int, timestamp: int, message: object, sig: str = "") -> SimpleNamespace:
    return SimpleNamespace(exitcode=exitcode, timestamp=timestamp, message=message,
                           signal_name=lambda: sig)


def test_a_failure_ends_on_the_recorded_line_or_names_the_rank() -> None:
    ours = {"message": "hybridps worker: error: no checkpoint",
            "extraInfo": {"timestamp": "5", launch.MARK: True}}
    later = {"message": "hybridps worker: error: later", "extraInfo": {"timestamp": "9",
                                                                        launch.MARK: True}}
    assert launch.failure_line({0: _failure(-15, 9, later), 1: _failure(2, 5, ours)}) == (
        "hybridps worker: error: no checkpoint", 2)
    crash = {"message": "To enable traceback see: ...", "extraInfo": {"timestamp": "3"}}
    assert launch.failure_line({1: _failure(1, 3, crash)}) == (
        "hybridps-run: error: rank 1 exited with code 1 (its output above says why)", 1)
    line, code = launch.failure_line({0: _failure(-9, 3, "Signal 9", "SIGKILL")})
    assert code == 137 and line.startswith("hybridps-run: error: rank 0 was killed by SIGKILL")
    # rank 1 killed, rank 0 then stopped by torchrun in the same second: rank 1 is named
    line, code = launch.failure_line({0: _failure(-15, 3, "Signal 15", "SIGTERM"),
                                      1: _failure(-9, 3, "Signal 9", "SIGKILL")})
    assert code == 137 and line.startswith("hybridps-run: error: rank 1 was killed by SIGKILL")


def test_a_rank_error_is_printed_by_rank_0_only_and_recorded_by_every_rank(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    monkeypatch.delenv(launch.LAUNCHER_DIR_ENV, raising=False)
    monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS", raising=False)
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv(launch.ERROR_FILE_ENV, str(tmp_path / f"error-{rank}.json"))
        launch.report_error(f"hybridps worker: error: boom {rank}")
        record = json.loads((tmp_path / f"error-{rank}.json").read_text())["message"]
        assert record["message"] == f"hybridps worker: error: boom {rank}"
        assert record["extraInfo"][launch.MARK] is True
    assert capsys.readouterr().err == "hybridps worker: error: boom 0\n"
    monkeypatch.setenv(launch.LAUNCHER_DIR_ENV, str(tmp_path))  # the launcher prints it
    monkeypatch.setenv("RANK", "0")
    launch.report_error("hybridps worker: error: quiet")
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")  # said as it happens, restarts ahead
    launch.report_error("hybridps worker: error: restarting")
    assert capsys.readouterr().err == "hybridps worker: error: restarting\n"


def test_a_bad_flag_is_said_by_rank_0_and_the_other_ranks_wait_for_its_record(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    # torchrun's layout: <attempt dir>/<local rank>/error.json. Rank 1 meets the bad flag
    # first; it must not exit (torchrun would then stop rank 0 before it names the value)
    # until rank 0's record is there, and it prints nothing itself.
    monkeypatch.delenv(launch.LAUNCHER_DIR_ENV, raising=False)
    monkeypatch.delenv("GROUP_RANK", raising=False)
    bad = ["--local-optimizer", "--staleness", "-1"]
    for rank in (0, 1):
        (tmp_path / str(rank)).mkdir()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv(launch.ERROR_FILE_ENV, str(tmp_path / "1" / "error.json"))
    rank0_record = tmp_path / "0" / "error.json"
    late = threading.Timer(0.6, rank0_record.write_text, args=("{}",))
    late.start()
    started = time.monotonic()
    with pytest.raises(SystemExit) as failed, launch.flag_errors(1):
        parse_config(TrainConfig, bad)
    waited = time.monotonic() - started
    late.join()
    assert failed.value.code == 2 and 0.5 < waited < launch.PEER_GRACE_S
    assert capsys.readouterr() == ("", "")
    line = json.loads((tmp_path / "1" / "error.json").read_text())["message"]["message"]
    assert "staleness=-1 must be >= 0" in line
    rank0_record.unlink()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(launch.ERROR_FILE_ENV, str(rank0_record))
    with pytest.raises(SystemExit), launch.flag_errors(0):
        parse_config(TrainConfig, bad)
    err = capsys.readouterr().err
    assert err.startswith("usage:") and "staleness=-1 must be >= 0" in err
    assert "staleness=-1" in json.loads(rank0_record.read_text())["message"]["message"]
    with launch.flag_errors(0):  # good flags: nothing said, nothing recorded
        parse_config(TrainConfig, ["--local-optimizer"])
    assert capsys.readouterr() == ("", "")


def test_a_bad_data_dir_gets_one_line_with_the_known_names(tmp_path: Path) -> None:
    line = data_dir_problem("umsl")
    assert line is not None and line.startswith("--data-dir 'umsl': no such directory")
    assert "did you mean --data-dir umls?" in line and "kinship, umls" in line
    assert data_dir_problem("umls") is None and data_dir_problem("Kinships") is None
    assert "has no train.txt" in str(data_dir_problem(str(tmp_path)))
    (tmp_path / "train.txt").write_text("a\tr\tb\n")
    assert data_dir_problem(str(tmp_path)) is None
    missing = data_dir_problem(str(tmp_path / "nope"))
    assert missing is not None and "did you mean" not in missing
    cfg = parse_config(TrainConfig, ["--task", "kge", "--data-dir", "umsl",
                                     "--local-optimizer"])
    assert data_problem(cfg) == line


def test_a_server_nobody_answers_at_is_named_after_the_window() -> None:
    address = f"127.0.0.1:{_free_port()}"
    clock = [0.0]
    line = server_problem(address, ClientSecurity(), 1.0,
                          sleep=lambda s: clock.__setitem__(0, clock[0] + s),
                          clock=lambda: clock[0])
    assert line is not None and line.startswith(
        f"could not register with shard server {address} within 1s (")
    assert "connection refused" in line


def test_a_misspelled_flag_is_named_with_the_flag_meant(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_config(TrainConfig, ["--local-optimizer", "--stepz", "3"], prog="worker/main.py")
    assert exc.value.code == 2
    assert _last_line(capsys.readouterr().err) == (
        "worker/main.py: error: unrecognized arguments: --stepz 3 (did you mean --steps?)")


# -- end to end: the launcher --------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.timeout(200)
@pytest.mark.parametrize(("args", "code", "last"), [
    (["--local-optimizer", "--stepz", "3"], 2,
     "worker/main.py: error: unrecognized arguments: --stepz 3 (did you mean --steps?)"),
    (["--local-optimizer", "--task", "kge"], 2,
     "worker/main.py: error: task='kge' needs --data-dir DIR"),
    (["--local-optimizer", "--task", "kge", "--data-dir", "umsl"], 2,
     "hybridps-run: error: --data-dir 'umsl': no such directory, and not a set shipped with "
     "hybridps: did you mean --data-dir umls?"),
    (["--ps", "127.0.0.1:{port}"], 1,
     "hybridps-run: error: could not register with shard server 127.0.0.1:{port} within 5s"),
], ids=["misspelled-flag", "kge-without-data", "bad-data-dir", "wrong-ps"])
def test_launcher_errors_end_on_our_line_before_any_rank(args: list[str], code: int,
                                                          last: str) -> None:
    port = str(_free_port())
    proc, seconds = _run([*LAUNCH, MAIN, *[a.replace("{port}", port) for a in args]])
    assert proc.returncode == code, proc.stderr[-4000:]
    assert _last_line(proc.stderr).startswith(last.replace("{port}", port)), proc.stderr[-4000:]
    assert "rank=" not in proc.stderr  # no rank was started
    _assert_quiet(proc.stderr)
    assert seconds < FAST_S, f"took {seconds:.1f}s"


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_sigterm_stops_cleanly_exits_0_and_says_so_last(tmp_path: Path) -> None:
    server = start_ps_server(tmp_path)
    cmd = [*LAUNCH, MAIN, "--ps", server.address, "--run-id", "launch-stop", "--num-rows",
           "2000", "--batch-size", "32", "--dim", "8", "--steps", "100000", "--log-every", "5",
           "--progress", "false"]
    err = tmp_path / "w.err"
    try:
        with open(err, "w") as fe:
            proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
                                    stderr=fe)
        deadline = time.monotonic() + 150
        while "event=ready" not in err.read_text():  # rank 0 is training
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.3)
        time.sleep(2)
        proc.send_signal(signal.SIGTERM)  # `docker stop`, a scheduler, kill
        code = proc.wait(120)
        text = err.read_text()
        assert code == 0, text[-4000:]
        stopped = re.findall(r"event=stopped step=(\d+) reason=SIGTERM flushed=True", text)
        assert len(stopped) == 2, text[-4000:]
        assert _last_line(text) == (
            f"hybridps-run: stopped by SIGTERM after step {stopped[0]} of 100000: every rank "
            "finished the step, flushed its updates and told the server")
        _assert_quiet(text)
    finally:
        if "proc" in locals() and proc.poll() is None:
            proc.kill()
            proc.wait()
        server.terminate()


def _training(cmd: list[str], err: Path) -> subprocess.Popen[bytes]:
    """`cmd` started, once rank 0 is training (its stderr in `err`)."""
    with open(err, "w") as fe:
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
                                stderr=fe)
    deadline = time.monotonic() + 150
    while "event=ready" not in err.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
        time.sleep(0.3)
    return proc


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_second_ctrl_c_stops_at_once_and_the_line_says_no_rank_flushed(
        tmp_path: Path) -> None:
    # --log-every far away: the ranks' clean stop waits for a step that never comes in time
    cmd = [*LAUNCH, MAIN, "--local-optimizer", "--num-rows", "2000", "--batch-size", "32",
           "--dim", "8", "--steps", "100000", "--log-every", "100000", "--progress", "false"]
    err = tmp_path / "w.err"
    proc = _training(cmd, err)
    try:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: the terminal signals the launcher only
        time.sleep(1)
        proc.send_signal(signal.SIGINT)
        second = time.monotonic()
        code = proc.wait(60)
        text = err.read_text()
        assert time.monotonic() - second < 15, text[-3000:]  # not torchrun's 30 s wait
        assert code == 130, text[-4000:]
        assert _last_line(text) == (
            "hybridps-run: stopped by SIGINT, cut short by a second SIGINT: ranks 0, 1 "
            "stopped at once, without flushing (--resume goes on from the last checkpoint)")
        _assert_quiet(text)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_ctrl_c_after_the_last_line_keeps_the_exit_code_it_tells(tmp_path: Path) -> None:
    cmd = [*LAUNCH, MAIN, "--local-optimizer", "--num-rows", "2000", "--batch-size", "32",
           "--dim", "8", "--steps", "100000", "--log-every", "5", "--progress", "false"]
    err = tmp_path / "w.err"
    proc = _training(cmd, err)
    try:
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 60
        while "hybridps-run: stopped" not in err.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)  # the second Ctrl-C, as the launcher exits
        code = proc.wait(60)
        text = err.read_text()
        assert _last_line(text).startswith("hybridps-run: stopped by SIGINT after step "), text
        assert code == 0, text[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- end to end: a bare torchrun ------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.timeout(200)
@pytest.mark.parametrize(("args", "code", "line"), [
    (["--local-optimizer", "--stepz", "3"], 2, "worker/main.py: error: unrecognized arguments"),
    (["--local-optimizer", "--task", "kge", "--data-dir", "umsl"], 2,
     "hybridps worker: error: --data-dir 'umsl'"),
], ids=["misspelled-flag", "bad-data-dir"])
def test_bare_torchrun_prints_a_known_error_once(args: list[str], code: int, line: str
                                                 ) -> None:
    proc, _ = _run([TORCHRUN, "--standalone", "--nproc_per_node", "2", MAIN, *args])
    assert proc.returncode != 0
    mine = [x for x in proc.stderr.splitlines() if x.startswith(line)]
    assert len(mine) == 1, proc.stderr[-4000:]  # rank 0's; rank 1 exits quietly
    assert f'File "{REPO / "worker"}' not in proc.stderr  # torchrun's traceback only
    assert f"exitcode: {code}" in proc.stderr or f"exitcode  : {code}" in proc.stderr


@pytest.mark.e2e
def test_every_rank_exits_with_the_code_of_a_bad_flag() -> None:
    for rank in ("0", "1"):
        env = {**_env(), "RANK": rank}
        proc = subprocess.run([sys.executable, MAIN, "--local-optimizer", "--stepz", "3"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
                              check=False)
        assert proc.returncode == 2
        assert bool(proc.stderr) == (rank == "0"), proc.stderr


@pytest.mark.e2e
def test_grpc_is_imported_lazily_by_the_preflight() -> None:
    # the launcher's checks must not pay for torch; grpc comes only with a server to check
    code = ("import sys; import worker.launch, worker.config.preflight; "
            "print('torch' in sys.modules, 'grpc' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    assert out == ["False", "False"]
    assert grpc is not None


def test_a_ctrl_c_before_any_rank_started_ends_on_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C while the launcher still checks the flags and the server (before torchrun
    takes the signals over): one line and 130, not Python's interrupt traceback."""
    def interrupted(worker_argv: list[str]) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "preflight", interrupted)
    code = launch.main(["--standalone", "--nproc_per_node", "2", "worker/main.py",
                        "--local-optimizer"])
    assert code == 130
    assert capsys.readouterr().err == "hybridps-run: interrupted before any rank started\n"


def test_the_launcher_leaves_no_variable_behind_in_its_caller(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks see the scratch directory and an error file inside it; once the launcher
    returns they are gone, and so is the caller's copy of them: a process the caller starts
    next would otherwise be told to write its error file into a deleted directory."""
    names = (launch.ERROR_FILE_ENV, launch.LAUNCHER_DIR_ENV, launch.LAUNCHER_PID_ENV)
    for name in names:
        monkeypatch.delenv(name, raising=False)
    seen: dict[str, str | None] = {}
    import torch.distributed.run

    def torchrun_main(args: list[str]) -> None:
        seen.update({name: os.environ.get(name) for name in names})

    monkeypatch.setattr(torch.distributed.run, "main", torchrun_main)
    monkeypatch.setattr(launch.StopSignals, "install", lambda _self: True)
    assert launch.main(["--nproc-per-node", "2", "some_script.py"]) == 0
    assert all(seen[name] for name in names), seen
    assert str(seen[launch.ERROR_FILE_ENV]).startswith(str(seen[launch.LAUNCHER_DIR_ENV]))
    assert {name: os.environ.get(name) for name in names} == dict.fromkeys(names)
