"""Graceful lifecycle: SIGTERM on the server and on workers, Finish / --exit-after-run.

- server SIGTERM during a stream of pushes: health NOT_SERVING, the pushes it
  received are applied AND answered, the stream ends UNAVAILABLE, exit 0 within
  the grace period; every answered push is in the final state it logs;
- --exit-after-run: the server stops once every rank sent Finish, or after an
  aborted rank once no stream of the run is open, or when the run is abandoned;
- worker SIGTERM (via torchrun): every rank stops after the same step, flushes,
  sends Finish(aborted), exits 143; the server holds exactly that step;
- server SIGTERM under a training run (the Sync stream, with the arena or inline): every
  rank learns at once that the server is shutting down and exits 1 with one line saying
  so, instead of re-registering for the whole --ps-timeout; a dynamic-table run too,
  whose ranks meet the stop in a Page call (a refused connection after the server said
  it stops is that stop, not a reason to retry).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hybridps.v1 import shard_pb2, shard_pb2_grpc
from ps.admin import get_shard_stats
from ps.core.lifecycle import RunTracker
from tests.testing.grpc_helpers import open_channel, push_messages, register, shard_stub, table
from tests.testing.helpers import REPO, PsServer, start_ps_server

MAIN = str(REPO / "worker" / "main.py")
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def final_state(stderr: str) -> dict[tuple[int, str], tuple[int, int]]:
    """(rank, table) -> (last_step, pushes_applied) from the server's event=final_state lines."""
    out = {}
    for m in re.finditer(r"event=final_state run=\S+ rank=(\d+) table=(\S+) last_step=(-?\d+) "
                         r"pushes_applied=(\d+)", stderr):
        out[(int(m[1]), m[2])] = (int(m[3]), int(m[4]))
    return out


# -- logs ----------------------------------------------------------------------------------

@pytest.mark.e2e
def test_log_lines_and_levels(tmp_path: Path) -> None:
    import io
    import logging

    from hybridps.logs import kv, set_log_fields, setup_logging

    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    stream = io.StringIO()
    try:
        setup_logging("warning", stream, rank=3)
        logging.getLogger("worker.x").info(kv("hidden"))
        logging.getLogger("worker.x").warning(kv("stopping", step=7, reason="a b"))
        set_log_fields(server="s1")
        logging.getLogger("ps.x").error(kv("boom"))
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].endswith('WARNING worker.x rank=3 event=stopping step=7 reason="a b"')
    assert lines[1].endswith("ERROR ps.x rank=3 server=s1 event=boom")
    for program in (["-m", "ps"], [str(MAIN), "--local-optimizer"]):
        bad = subprocess.run([sys.executable, *program, "--log-level", "loud"], cwd=REPO,
                             capture_output=True, text=True, timeout=60, check=False)
        assert bad.returncode == 2 and "loud" in bad.stderr, bad.stderr


# -- RunTracker (no server) ---------------------------------------------------------------

def test_run_tracker_rules() -> None:
    over: list[tuple[str, str]] = []
    now = [0.0]
    tracker = RunTracker(lambda run, why: over.append((run, why)), clock=lambda: now[0])
    for rank in (0, 1):
        tracker.registered("a", rank)
        tracker.stream_opened("a", rank)
    assert tracker.finish("a", 0, 9, False, "done") == (2, 1, False)
    assert tracker.finish("a", 1, 9, False, "done") == (2, 2, True)
    assert over == [("a", "every rank finished")]
    # An aborted rank ends the run once no other rank has a stream open.
    for rank in (0, 1):
        tracker.registered("b", rank)
        tracker.stream_opened("b", rank)
    tracker.stream_closed("b", 0)
    assert tracker.finish("b", 0, 3, True, "SIGTERM")[2] is False  # rank 1 still streams
    tracker.stream_closed("b", 1)
    assert over[-1][0] == "a"  # not yet: rank 1 gets a grace to send its own Finish
    now[0] += tracker.abort_grace_s
    tracker.recheck("b")
    assert over[-1][0] == "b" and "aborted by ranks [0]" in over[-1][1]
    # Abandoned: streams closed long enough, nobody finished.
    tracker.registered("c", 0)
    tracker.stream_opened("c", 0)
    tracker.stream_closed("c", 0)
    now[0] = 5.0
    tracker.check_idle(10.0)
    assert over[-1][0] == "b"
    tracker.stream_opened("c", 0)  # reconnected at t=5: idle again from then on
    tracker.stream_closed("c", 0)
    now[0] = 12.0
    tracker.check_idle(10.0)
    assert over[-1][0] == "b"
    now[0] = 15.5
    tracker.check_idle(10.0)
    assert over[-1][0] == "c" and "abandoned" in over[-1][1]
    assert len(over) == 3  # each run once


# -- server SIGTERM during pushes -----------------------------------------------------------

@pytest.mark.e2e
def test_sigterm_during_pushes_answers_what_it_received_and_loses_nothing(tmp_path: Path
                                                                          ) -> None:
    server = start_ps_server(tmp_path, "--grace-s", "5")
    answered: list[int] = []
    errors: list[grpc.RpcError] = []
    try:
        with open_channel(server.address) as ch:
            stub = shard_stub(ch)
            register(stub, "term", [table("emb", 1000, 16, 0, 1000)])
            stop_pushing = threading.Event()

            def pushes() -> Iterator[shard_pb2.SyncRequest]:
                for step in range(100_000):
                    if stop_pushing.is_set():
                        return
                    ids = torch.randperm(1000)[:200]
                    yield from push_messages("term", step, "emb", ids, torch.randn(200, 16))
                    time.sleep(0.002)

            def consume() -> None:
                try:
                    for response in stub.Sync(pushes(), timeout=60):
                        answered.append(response.update.step)
                except grpc.RpcError as exc:
                    errors.append(exc)

            thread = threading.Thread(target=consume)
            thread.start()
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(),
                                                          timeout=60)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            deadline = time.monotonic() + 30
            while len(answered) < 50 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(answered) >= 50, "pushes were not answered"
            start = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            code = server.proc.wait(20)
            elapsed = time.monotonic() - start
            thread.join(30)
            stop_pushing.set()
        assert code == 0, server.stderr()
        assert elapsed < 5 + 3, elapsed  # within the grace period (+ process exit)
        assert errors and errors[0].code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in (errors[0].details() or "")
        assert answered == list(range(len(answered))), "answers out of order or missing"
        state = final_state(server.stderr())
        # Every answered push is applied, and nothing was applied without an answer.
        assert state[(0, "emb")] == (answered[-1], answered[-1] + 1), (state, answered[-1])
    finally:
        server.terminate()


# -- Finish and --exit-after-run ------------------------------------------------------------

def one_push(stub: shard_pb2_grpc.ShardServiceStub, run: str, rank: int, step: int,
             start: int) -> None:
    msgs = push_messages(run, step, "emb", torch.tensor([start]), torch.ones(1, 4), rank=rank)
    assert [r.update.step for r in stub.Sync(iter(msgs), timeout=30)] == [step]


@pytest.mark.e2e
def test_exit_after_run_stops_once_every_rank_finished(tmp_path: Path) -> None:
    server = start_ps_server(tmp_path, "--exit-after-run")
    try:
        with open_channel(server.address) as ch:
            stub = shard_stub(ch)
            for rank in (0, 1):
                register(stub, "job", [table("emb", 10, 4, 5 * rank, 5 * rank + 5)],
                         rank=rank, world_size=2)
                one_push(stub, "job", rank, 0, 5 * rank)
            with pytest.raises(grpc.RpcError) as info:  # step 3 was never applied
                stub.Finish(shard_pb2.FinishRequest(run_id="job", rank=0, last_step=3),
                            timeout=10)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            with pytest.raises(grpc.RpcError) as info:
                stub.Finish(shard_pb2.FinishRequest(run_id="nope", rank=0), timeout=10)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            first = stub.Finish(shard_pb2.FinishRequest(run_id="job", rank=0, last_step=0),
                                timeout=10)
            assert (first.ranks_registered, first.ranks_finished) == (2, 1)
            assert not first.server_stopping
            time.sleep(0.5)
            assert server.proc.poll() is None, "stopped before every rank finished"
            last = stub.Finish(shard_pb2.FinishRequest(run_id="job", rank=1, last_step=0),
                               timeout=10)
            assert last.server_stopping and last.ranks_finished == 2
        assert server.proc.wait(20) == 0
        err = server.stderr()
        assert "event=run_over run=job" in err and "every rank finished" in err
        assert final_state(err) == {(0, "emb"): (0, 1), (1, "emb"): (0, 1)}
    finally:
        server.terminate()


@pytest.mark.e2e
def test_exit_after_run_when_aborted_or_abandoned(tmp_path: Path) -> None:
    """An aborted rank ends the run when the other's stream closes (after --abort-grace-s:
    here 1 s instead of the restart window); no Finish at all: idle."""
    aborted = start_ps_server(tmp_path / "a", "--exit-after-run", "--abort-grace-s", "1")
    idle = start_ps_server(tmp_path / "b", "--exit-after-run", "--run-idle-timeout-s", "1")
    try:
        with open_channel(aborted.address) as ch:
            stub = shard_stub(ch)
            for rank in (0, 1):
                register(stub, "job", [table("emb", 10, 4, 5 * rank, 5 * rank + 5)],
                         rank=rank, world_size=2)
            gate = threading.Event()

            def rank1_pushes() -> Iterator[shard_pb2.SyncRequest]:
                yield from push_messages("job", 0, "emb", torch.tensor([5]), torch.ones(1, 4),
                                         rank=1)
                gate.wait(30)

            stream = stub.Sync(rank1_pushes(), timeout=30)
            assert next(stream).update.step == 0  # rank 1's stream is open
            reply = stub.Finish(shard_pb2.FinishRequest(run_id="job", rank=0, last_step=-1,
                                                        aborted=True, reason="test"),
                                timeout=10)
            assert not reply.server_stopping
            time.sleep(0.5)
            assert aborted.proc.poll() is None
            gate.set()  # rank 1's stream ends: the run is over
            list(stream)
        assert aborted.proc.wait(20) == 0
        assert "aborted by ranks [0]" in aborted.stderr()

        with open_channel(idle.address) as ch:
            stub = shard_stub(ch)
            register(stub, "lost", [table("emb", 10, 4, 0, 10)])
            one_push(stub, "lost", 0, 0, 3)
        assert idle.proc.wait(20) == 0
        assert "abandoned" in idle.stderr()
    finally:
        aborted.terminate()
        idle.terminate()


# -- worker SIGTERM ------------------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_worker_sigterm_finishes_the_step_flushes_and_exits(tmp_path: Path) -> None:
    # Both ranks abort: the run is over once none registers again within --abort-grace-s
    # (torchrun might be restarting them); 2 s here instead of the restart window.
    server: PsServer = start_ps_server(tmp_path, "--exit-after-run", "--abort-grace-s", "2")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node", "2", MAIN, "--ps", server.address,
           "--run-id", "sigterm", "--num-rows", "2000", "--batch-size", "32", "--dim", "8",
           "--steps", "100000", "--log-every", "5", "--progress", "false"]
    out, err = tmp_path / "w.out", tmp_path / "w.err"
    try:
        with open(out, "w") as fo, open(err, "w") as fe:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fo, stderr=fe)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                stats = get_shard_stats(server.address, run_id="sigterm", timeout=5)
                if stats.partitions and min(p.last_step for p in stats.partitions) >= 20:
                    break
            except grpc.RpcError:
                pass
            assert proc.poll() is None, err.read_text()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # like `docker stop`: torchrun forwards it
        proc.wait(90)
        text = err.read_text()
        stopped = [int(m) for m in re.findall(r"event=stopped step=(\d+)", text)]
        assert len(stopped) == 2 and stopped[0] == stopped[1], text[-3000:]
        step = stopped[0]
        assert (step + 1) % 5 == 0  # at an agreement step (--log-every)
        assert text.count("exit_code=143") == 2
        finished = re.findall(rf"event=finished \S+ last_step={step} aborted=True", text)
        assert len(finished) == 2, "\n".join(
            line for line in (text + server.stderr()).splitlines() if "event=" in line)
        assert "[rank0]: Traceback" not in text and "[rank1]: Traceback" not in text
        assert re.search(r"INFO worker rank=1 event=start ps=", text)  # structured lines
        # Both ranks finished (aborted): the --exit-after-run server stops by itself.
        assert server.proc.wait(30) == 0
        state = final_state(server.stderr())
        assert re.search(r"INFO ps.service server=\S+ event=finish run=sigterm rank=0",
                         server.stderr())
        assert len(state) == 8 and {v[0] for v in state.values()} == {step}, state
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        server.terminate()


def sigterm_server_mid_run(tmp_path: Path, run_id: str, *args: str) -> tuple[int, float, str]:
    """A 2-rank run on a real server (--grace-s 5) until every partition applied step 20,
    then SIGTERM to the server: (the ranks' exit code, seconds they took, their log)."""
    server: PsServer = start_ps_server(tmp_path, "--grace-s", "5")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node", "2", MAIN, "--ps", server.address,
           "--run-id", run_id, "--batch-size", "32", "--dim", "8", "--steps", "100000",
           "--log-every", "5", "--progress", "false", "--log-level", "info", *args]
    log_path = tmp_path / "w.log"
    try:
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log,
                                    stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                stats = get_shard_stats(server.address, run_id=run_id, timeout=5)
                if stats.partitions and min(p.last_step for p in stats.partitions) >= 20:
                    break
            except grpc.RpcError:
                pass
            assert proc.poll() is None, log_path.read_text()[-4000:]
            time.sleep(0.2)
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        returncode = proc.wait(120)
        elapsed = time.monotonic() - start
        assert server.proc.wait(10) == 0, server.stderr()
        return returncode, elapsed, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        server.terminate()


def assert_stopped_at_once(returncode: int, elapsed: float, text: str, limit_s: float) -> None:
    """Every rank's error line says the server is shutting down, none waited for it."""
    assert returncode != 0, text[-4000:]
    # The first rank to fail says why (rank 0 on the console, any rank in torchrun's
    # failure report); torchrun then SIGTERMs the other, which may stop on that signal
    # instead of reaching its own line.
    lines = [line for line in text.splitlines() if "hybridps worker: error" in line]
    assert lines, text[-6000:]
    for line in lines:
        assert "is shutting down" in line, line
    assert "unreachable for" not in text, text[-6000:]
    assert elapsed < limit_s, f"the ranks took {elapsed:.0f}s to stop\n{text[-4000:]}"


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("same_node", ["auto", "off"])  # the stream with the arena, inline
def test_server_sigterm_stops_the_ranks_at_once_with_a_clear_line(tmp_path: Path,
                                                                   same_node: str) -> None:
    """The default --ps-timeout (60 s): the ranks must not spend it re-registering with a
    server that said it is going away with their optimizer state."""
    returncode, elapsed, text = sigterm_server_mid_run(
        tmp_path, f"server-term-{same_node}", "--num-rows", "2000", "--same-node", same_node)
    assert ("event=shm " in text) == (same_node == "auto"), "not that same-node mode"
    assert_stopped_at_once(returncode, elapsed, text, 30.0)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_server_sigterm_stops_a_dynamic_table_run_at_once(tmp_path: Path) -> None:
    """Dynamic tables call Page at most steps (evictions, page-ins): a Page call that meets
    the stopping server, or the gone one, fails at once with the same line as the Sync
    stream does, well inside --ps-timeout."""
    returncode, elapsed, text = sigterm_server_mid_run(
        tmp_path, "server-term-dynamic", "--task", "tables", "--num-rows", "300",
        "--tables", "user:40:dynamic:lfu:expire=6,ad:30:3:dynamic:threshold=2,s:50",
        "--staleness", "1", "--ps-timeout", "60")
    assert_stopped_at_once(returncode, elapsed, text, 20.0)


@pytest.mark.timeout(60)
def test_a_call_that_fails_after_the_server_said_it_stops_is_the_shutdown() -> None:
    """A refused connection is retryable, until the rank was told the server is stopping
    (its Sync stream ended so): then it is that shutdown, not a reason to wait."""
    import socket

    from hybridps.errors import SHUTTING_DOWN
    from hybridps.security import ClientSecurity
    from worker.sync.grpc_client import ShardRpc
    from worker.sync.transport import TransportRetryable, TransportShutdown

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    rpc = ShardRpc(f"127.0.0.1:{port}", ClientSecurity(), 1 << 20)
    rpc.start()
    try:
        request = shard_pb2.PageRequest(run_id="r", rank=0, table="t", seq=1)
        with pytest.raises(TransportRetryable) as before:
            rpc.call("Page", request, 5.0)
        rpc.stopping_seen(TransportShutdown("UNAVAILABLE", SHUTTING_DOWN))
        with pytest.raises(TransportShutdown, match="server shutting down") as after:
            rpc.call("Page", request, 5.0)
        assert before.value.code in after.value.details  # what the call met, kept
    finally:
        rpc.close()


@pytest.mark.e2e
def test_exit_process_keeps_the_code_and_flushes_what_was_written() -> None:
    """No interpreter teardown, but the exit code, buffered stdout and the logs survive."""
    script = ("import logging, sys\n"
              "from worker.runtime.lifecycle import exit_process\n"
              "logging.basicConfig(stream=sys.stderr)\n"
              "sys.stdout.write('buffered, no newline')\n"
              "logging.getLogger('t').warning('logged before the exit')\n"
              "exit_process(3)\n"
              "print('never')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout buffered
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env=env)
    assert done.returncode == 3
    assert done.stdout == "buffered, no newline"
    assert "logged before the exit" in done.stderr


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_an_aborted_finish_reports_the_step_reached(tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed after pushing step 6 of 40 (no restarts): rank 0 fails in its
    next collective and sends Finish(aborted) with the last step it pushed, not 39."""
    server: PsServer = start_ps_server(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HYBRIDPS_FAULT_KILL="1:6")
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node", "2", MAIN, "--ps", server.address,
           "--run-id", "aborted-step", "--num-rows", "2000", "--batch-size", "32", "--dim", "8",
           "--steps", "40", "--progress", "false"]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=240, check=False)
        assert proc.returncode != 0
        finishes = re.findall(r"event=finish run=aborted-step rank=0 last_step=(-?\d+) "
                              r"aborted=True", server.stderr())
        assert len(finishes) == 1, proc.stderr[-3000:] + server.stderr()[-3000:]
        assert 6 <= int(finishes[0]) <= 8, finishes  # the step it reached, not 39
    finally:
        server.terminate()
