"""End to end: real shard server subprocess + `torchrun --nproc_per_node 2 worker/main.py`.

The equivalence test trains the synthetic task (small tables) on 2 gloo
ranks against a real server at --staleness 0 and compares the final
embedding tables and dense weights with tests/testing/reference_trainer.py (one process,
nn.Embedding(sparse=True) + SparseAdam, global-mean loss) on the same global
batches. It fails if the 1/world_size gradient scaling is removed (checked
by hand: max row error ~2e-2 instead of ~4e-7; the sgd variant
~3e-3).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from ps.admin import get_shard_stats
from tests.testing.helpers import start_ps_server
from tests.testing.reference_trainer import train_reference
from worker.config.train_config import TrainConfig

pytestmark = pytest.mark.e2e  # every test here starts processes

REPO = Path(__file__).resolve().parents[3]
MAIN = str(REPO / "worker" / "main.py")
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
SMALL = ["--num-rows", "2000", "--batch-size", "32", "--steps", "20", "--dim", "8",
         "--log-every", "5", "--eval-batches", "1", "--progress", "false"]
STEPS = 20
# The server's native kernel rounds sqrt correctly, torch's vectorized sqrt is off by an ulp
# now and then; Adam amplifies that for rows whose gradients are ~0 (m/sqrt(v) of tiny
# values), seen up to 1.6e-6 on one element of 64k after 20 steps. The bugs these tests
# catch are >= 1e-3 (no 1/W gradient scaling: 2e-2).
ROWS_ATOL = 1e-5


def run_worker(args: list[str], *, nproc: int = 2, timeout: float = 150.0,
               check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("HYBRIDPS_")}
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node", str(nproc), MAIN, *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"worker failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def small_config(**overrides: Any) -> TrainConfig:
    base: dict[str, Any] = {"local_optimizer": True, "num_rows": 2000, "batch_size": 32,
                            "steps": STEPS, "dim": 8, "staleness": 0}
    return TrainConfig.of(**{**base, **overrides})


def assert_matches_reference(dump_path: Path, cfg: TrainConfig) -> None:
    state = torch.load(dump_path)
    ref = train_reference(cfg, world_size=2)
    initial = train_reference(cfg, world_size=2, steps=0)
    assert set(state["tables"]) == set(ref.tables)
    for name, rows in state["tables"].items():
        assert not torch.equal(rows, initial.tables[name]), f"table {name} never trained"
        try:
            torch.testing.assert_close(rows, ref.tables[name], rtol=1e-5, atol=ROWS_ATOL)
        except AssertionError as exc:
            raise AssertionError(f"table {name}: {exc}") from None
    assert set(state["dense"]) == set(ref.dense)
    for key, value in state["dense"].items():
        try:
            torch.testing.assert_close(value, ref.dense[key], rtol=1e-5, atol=1e-6)
        except AssertionError as exc:
            raise AssertionError(f"dense {key}: {exc}") from None


@pytest.fixture(scope="module")
def server_run(ps_address: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("server_run")
    proc = run_worker(["--ps", ps_address, "--staleness", "0", "--run-id", "e2e-equivalence",
                       "--dump-state", str(out / "state.pt"), "--results",
                       str(out / "results.json"), *SMALL])
    return {"dir": out, "stdout": proc.stdout, "stderr": proc.stderr}


@pytest.mark.timeout(240)
def test_server_staleness0_matches_reference(server_run: dict[str, Any]) -> None:
    assert_matches_reference(server_run["dir"] / "state.pt", small_config())


@pytest.mark.timeout(240)
def test_results_json_contract(server_run: dict[str, Any]) -> None:
    res = json.loads((server_run["dir"] / "results.json").read_text())
    for key in ("config", "steps", "final_loss", "loss_curve", "samples_per_s", "wall_time_s",
                "staleness", "step_time_s", "eval", "world_size", "run_id"):
        assert key in res, key
    assert res["steps"] == STEPS and res["world_size"] == 2 and res["mode"] == "server"
    assert res["config"]["staleness"] == 0 and res["config"]["num_rows"] == 2000
    assert [p[0] for p in res["loss_curve"]] == [4, 9, 14, 19]
    assert res["final_loss"] == res["loss_curve"][-1][1] and res["samples_per_s"] > 0
    assert 0 < res["train_cpu_s"] < 20 * res["train_time_s"]  # rank 0's process, all threads
    started, ended = res["train_span_unix_s"]
    assert abs((ended - started) - res["train_time_s"]) < 0.5
    assert set(res["step_time_s"]) >= {"data", "forward", "a2a", "backward", "push", "apply"}
    assert res["staleness"]["k"] == 0 and res["staleness"]["applied_max"] == 0
    assert res["sync"]["pushes"] == STEPS * 4 and res["sync"]["updates"] == STEPS * 4
    assert "loss" in res["eval"]
    assert "shard server stats" in server_run["stdout"]


@pytest.mark.timeout(240)
def test_server_stats_report_the_run(server_run: dict[str, Any], ps_address: str) -> None:
    stats = get_shard_stats(ps_address, run_id="e2e-equivalence")
    parts = [p for p in stats.partitions if p.run_id == "e2e-equivalence"]
    assert sorted({p.rank for p in parts}) == [0, 1]
    assert sorted({p.table for p in parts}) == ["category", "item", "tag", "user"]
    assert len(parts) == 8
    for p in parts:
        assert p.pushes_applied == STEPS and p.last_step == STEPS - 1, p
        assert p.queue_depth == 0 and not dict(p.refusals)
    user_rows = sorted((p.row_start, p.row_end) for p in parts if p.table == "user")
    assert user_rows == [(0, 1000), (1000, 2000)]


@pytest.mark.timeout(240)
def test_local_optimizer_matches_reference(tmp_path: Path) -> None:
    run_worker(["--local-optimizer", "--staleness", "0", "--dump-state",
                str(tmp_path / "state.pt"), *SMALL])
    assert_matches_reference(tmp_path / "state.pt", small_config())


@pytest.mark.timeout(240)
def test_local_optimizer_sgd_matches_reference(tmp_path: Path) -> None:
    """SGD is not scale-invariant: the strictest check of the 1/W gradient scaling."""
    run_worker(["--local-optimizer", "--staleness", "0", "--optimizer", "sgd", "--lr", "0.5",
                "--dense-lr", "0.05", "--dump-state", str(tmp_path / "state.pt"), *SMALL])
    assert_matches_reference(tmp_path / "state.pt",
                             small_config(optimizer="sgd", lr=0.5, dense_lr=0.05))


STALE_JOB = ["--num-rows", "20000", "--batch-size", "64", "--steps", "150", "--log-every", "10",
             "--eval-batches", "4", "--progress", "false"]
STALENESS_MARGIN = 0.02  # eval BCE of the K=2 run within this of the synchronous run


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_staleness2_loss_close_to_synchronous(ps_address: str, tmp_path: Path) -> None:
    results = {}
    for k in (0, 2):
        path = tmp_path / f"k{k}.json"
        run_worker(["--ps", ps_address, "--staleness", str(k), "--results", str(path),
                    *STALE_JOB])
        results[k] = json.loads(path.read_text())
    sync, stale = results[0], results[2]
    assert stale["staleness"]["applied_max"] == 2 and stale["staleness"]["applied_mean"] > 1.9
    assert sync["final_loss"] < sync["first_loss"] - 0.05, "the default job must learn"
    assert stale["final_loss"] < stale["first_loss"] - 0.05
    assert abs(stale["eval"]["loss"] - sync["eval"]["loss"]) < STALENESS_MARGIN, (
        sync["eval"], stale["eval"])


class FaultProxy:
    """TCP proxy to the server that misbehaves once `after` client bytes went through.

    mode "drop": cut every connection once (the worker must reconnect);
    mode "freeze": keep the connections open but stop forwarding the server's
    bytes (the worker must time out instead of hanging).
    """

    def __init__(self, target: tuple[str, int], after: int, mode: str) -> None:
        self.target, self.after, self.mode = target, after, mode
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.forwarded = 0
        self.tripped = False
        self.lock = threading.Lock()
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            with self.lock:
                self.conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False),
                             daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        try:
            while data := src.recv(65536):
                if not from_client and self.tripped and self.mode == "freeze":
                    continue  # swallow the server's answers
                dst.sendall(data)
                if from_client:
                    with self.lock:
                        self.forwarded += len(data)
                        trip = not self.tripped and self.forwarded > self.after
                        if trip:
                            self.tripped = True
                    if trip and self.mode == "drop":
                        self.drop_all()
                        return
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()

    def drop_all(self) -> None:
        with self.lock:
            conns, self.conns = self.conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
                s.close()

    def close(self) -> None:
        self.listener.close()
        self.drop_all()


@pytest.mark.timeout(240)
def test_broken_stream_is_retried_and_results_unchanged(tmp_path: Path) -> None:
    """Cut the TCP connections mid-run: reconnect, re-Register, re-send, same final state.

    The server's 4 KiB message limit (22 rows of dim 32) also splits pushes and updates
    into chunks (inline tensors: --same-node off; over shared memory:
    tests/worker/sync/test_shm.py).
    """
    with start_ps_server(tmp_path, "--max-message-bytes", "4096") as server:
        proxy = FaultProxy((server.host, server.port), after=30_000, mode="drop")
        try:
            run_worker(["--ps", f"127.0.0.1:{proxy.port}", "--staleness", "0", "--same-node",
                        "off", "--run-id", "e2e-reconnect", "--dump-state",
                        str(tmp_path / "state.pt"), "--results", str(tmp_path / "r.json"),
                        *SMALL, "--dim", "32"])
        finally:
            proxy.close()
    assert proxy.tripped, f"proxy never cut the connection ({proxy.forwarded} bytes forwarded)"
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["sync"]["reconnects"] >= 1 and res["sync"]["registers"] >= 2
    # chunks against the pushes and updates sent (--group-tables: one a step for the 4
    # tables; `pushes` counts the tables')
    assert res["sync"]["push_chunks"] > res["sync"]["unit_pushes"], "pushes were not chunked"
    assert res["sync"]["update_chunks"] > res["sync"]["unit_updates"], \
        "updates were not chunked"
    assert_matches_reference(tmp_path / "state.pt", small_config(dim=32))


@pytest.mark.timeout(120)
def test_silent_server_times_out_naming_server_and_step(ps_address: str, tmp_path: Path) -> None:
    """The server stops answering mid-run: a clear error after --ps-timeout, not a hang."""
    host, port = ps_address.rsplit(":", 1)
    proxy = FaultProxy((host, int(port)), after=30_000, mode="freeze")
    try:
        # --same-node off: the proxy counts bytes, and shared-memory pushes are ~100-byte
        # headers.
        proc = run_worker(["--ps", f"127.0.0.1:{proxy.port}", "--staleness", "0", "--same-node",
                           "off", "--ps-timeout", "3", *SMALL], check=False, timeout=100)
    finally:
        proxy.close()
    assert proxy.tripped
    assert proc.returncode != 0
    assert f"no update from shard server 127.0.0.1:{proxy.port} for step" in proc.stderr
    assert "after 3s" in proc.stderr


@pytest.mark.timeout(120)
def test_unreachable_server_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run_worker(["--ps", f"127.0.0.1:{port}", "--ps-timeout", "2", *SMALL], check=False)
    assert proc.returncode != 0
    assert f"could not register with shard server 127.0.0.1:{port} within 2s" in proc.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("args", "message"), [
    (["--ps", "127.0.0.1:1", "--staleness", "-1"], "staleness=-1 must be >= 0"),
    (["--ps", "not-an-address"], "ps='not-an-address' is not HOST:PORT"),
    ([], "--ps HOST:PORT is required unless --local-optimizer"),
])
def test_bad_flags_exit_nonzero_naming_the_value(args: list[str], message: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    proc = subprocess.run([sys.executable, MAIN, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=False, env=env)
    assert proc.returncode == 2
    assert message in proc.stderr


@pytest.mark.timeout(90)
def test_bad_flag_under_torchrun_fails_fast() -> None:
    proc = run_worker(["--local-optimizer", "--staleness", "-1"], check=False, timeout=80)
    assert proc.returncode != 0
    assert "staleness=-1 must be >= 0" in proc.stderr
