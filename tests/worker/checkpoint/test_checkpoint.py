"""Checkpoints: file format + re-sharding (unit), and end to end with real servers/torchrun.

(a) deterministic resume: 2 ranks x 20 steps straight == 10 steps, stop, --resume, 10 more
    (rows, server m/v/step count of the step-19 checkpoints, dense weights: bitwise);
(b) re-shard: the 2-rank checkpoint resumed at 3 ranks and at 1 rank (same global batch)
    equals the straight 2-rank run (float rounding);
(c) torn checkpoints: a rank os._exit()s at each phase of a checkpoint; --resume loads the
    previous complete one and the result equals the uninterrupted run;
(d) crash: kill -9 the shard server twice at random moments, restart it; the workers
    fail, `torchrun --max-restarts` restarts them, they come back from the last checkpoint
    and end bitwise equal to the uninterrupted run (a worker kill:
    tests/worker/checkpoint/test_restart.py);
(e) export: `python -m worker.export` gives a plain state_dict that loads into the
    un-sharded reference model and reproduces the sharded model's eval metrics.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridps.checkpoint import (
    Manifest,
    ShardInfo,
    complete_checkpoints,
    load_optim_state,
    load_rows,
    owning_tensors,
    read_shard,
    save_shard,
    save_torch,
    step_dir,
    write_manifest,
)
from hybridps.errors import Conflict, InvalidArgument
from hybridps.optim import OptimizerSpec
from hybridps.run_secret import OWNER_FILE, SECRET_FILE
from ps.core.checkpoint import save_partition
from ps.core.partition import PushChunk, TableSpec
from ps.core.store import Store
from tests.testing.helpers import PsServer, start_ps_server
from worker.runtime.faults import FAULT_ENV, FAULT_EXIT_CODE, fault_point

REPO = Path(__file__).resolve().parents[3]
MAIN = str(REPO / "worker" / "main.py")
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
COMMON = ["--num-rows", "2000", "--dim", "8", "--log-every", "5", "--eval-batches", "1",
          "--progress", "false", "--staleness", "0"]
GLOBAL_BATCH = 96  # 2 x 48 = 3 x 32 = 1 x 96: the same global batches at every world size


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(extra or {})})
    return env


def worker_cmd(args: list[str], nproc: int, max_restarts: int = 0) -> list[str]:
    if nproc == 1 and not max_restarts:
        return [sys.executable, "-m", "worker.main", *args]
    return [TORCHRUN, "--standalone", "--nproc_per_node", str(nproc),
            "--max-restarts", str(max_restarts), MAIN, *args]


def run(args: list[str], *, nproc: int = 2, expect: int = 0,
        env: dict[str, str] | None = None, timeout: float = 180.0
        ) -> subprocess.CompletedProcess[str]:
    batch = ["--batch-size", str(GLOBAL_BATCH // nproc)]
    proc = subprocess.run(worker_cmd([*COMMON, *batch, *args], nproc), cwd=REPO,
                          env=_env(env), capture_output=True, text=True, timeout=timeout,
                          check=False)
    ok = proc.returncode == 0 if expect == 0 else proc.returncode != 0
    if not ok:
        raise AssertionError(f"worker exit {proc.returncode} (expected "
                             f"{'0' if expect == 0 else 'failure'}):\n{proc.stdout}\n"
                             f"{proc.stderr[-6000:]}")
    return proc


def assert_states(a_path: Path, b_path: Path, *, exact: bool, atol: float = 1e-5) -> None:
    a, b = torch.load(a_path), torch.load(b_path)
    for part in ("tables", "dense"):
        assert set(a[part]) == set(b[part])
        for key in a[part]:
            if exact:
                assert torch.equal(a[part][key], b[part][key]), f"{part} {key} differs"
            else:
                try:
                    torch.testing.assert_close(a[part][key], b[part][key], rtol=1e-4,
                                               atol=atol)
                except AssertionError as exc:
                    raise AssertionError(f"{part} {key}: {exc}") from None


# -- unit: format and re-sharding -------------------------------------------------------

def _shards(tmp: Path, bounds: list[int], full: torch.Tensor) -> list[ShardInfo]:
    out = []
    for rank, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        out.append(save_shard(tmp, f"rows/t.r{rank:05d}.pt", kind="rows", table="t",
                              rank=rank, num_rows=full.shape[0], dim=full.shape[1],
                              row_start=lo, row_end=hi, tensors={"weight": full[lo:hi]}))
    return out


def test_load_rows_reshards_any_range(tmp_path: Path) -> None:
    full = torch.randn(10, 3)
    shards = _shards(tmp_path, [0, 3, 3, 7, 10], full)  # incl. an empty range
    assert not list(tmp_path.rglob("*.tmp-*"))
    for lo, hi in [(0, 10), (2, 8), (3, 3), (9, 10), (0, 1)]:
        got, _ = load_rows(tmp_path, "t", 10, 3, shards, lo, hi, ["weight"])
        weight = got["weight"]
        assert weight is not None and torch.equal(weight, full[lo:hi])
    with pytest.raises(InvalidArgument, match="do not tile"):
        load_rows(tmp_path, "t", 10, 3, shards[:2] + shards[3:], 0, 10, ["weight"])
    with pytest.raises(Conflict, match="manifest says"):
        load_rows(tmp_path, "t", 11, 3, [*shards[:-1], ShardInfo("t", 3, 7, 11,
                                                                 shards[-1].file)],
                  0, 11, ["weight"])


def _push(store: Store, rank: int, step: int, ids: list[int]) -> None:
    session = store.open_session()
    gen = torch.Generator().manual_seed(step * 10 + rank)
    grads = torch.randn(len(ids), 4, generator=gen)
    session.feed(PushChunk("run", rank, 0, step, "t", torch.tensor(ids), grads))


def test_server_partitions_restore_at_another_world_size(tmp_path: Path) -> None:
    opt = OptimizerSpec()
    old = Store()
    for rank, (lo, hi) in enumerate([(0, 5), (5, 10)]):
        old.register("run", rank, 2, 0, [TableSpec("t", 10, 4, lo, hi)], opt)
    for step in range(3):
        _push(old, 0, step, [0, 3, 4][: step + 1])
        _push(old, 1, step, [9, 5][: step + 1])
    shards = []
    for rank in (0, 1):
        part = old.partition("run", rank)
        assert part is not None
        with pytest.raises(Conflict, match="needs exactly 1"):
            save_partition(part, tmp_path, 1)
        shards += old.checkpoint("run", [rank], 2, str(tmp_path))
    write_manifest(tmp_path, {"step": 2, "tables": {"t": {"num_rows": 10, "dim": 4, "shards": [
        {"rank": r, "row_start": i.row_start, "row_end": i.row_end,
         "optim": {"file": i.file, "bytes": i.bytes, "crc32": i.crc32}} for r, i in shards]}}})
    m_old = torch.cat([old.partition("run", r).tables["t"].m for r in (0, 1)])  # type: ignore
    v_old = torch.cat([old.partition("run", r).tables["t"].v for r in (0, 1)])  # type: ignore
    new = Store()
    bounds = [(0, 3), (3, 6), (6, 10)]
    for rank, (lo, hi) in enumerate(bounds):
        got = new.register("run", rank, 3, 5, [TableSpec("t", 10, 4, lo, hi)], opt,
                           restore=(str(tmp_path), 2))
        assert got[0].last_step == 2
    for rank, (lo, hi) in enumerate(bounds):
        t = new.partition("run", rank).tables["t"]  # type: ignore[union-attr]
        assert t.m is not None and t.v is not None
        assert torch.equal(t.m, m_old[lo:hi]) and torch.equal(t.v, v_old[lo:hi])
        assert t.adam_step == 3 and t.last_step == 2
    # The same store: a restore replaces the run's partitions of the old world size.
    old.register("run", 0, 1, 9, [TableSpec("t", 10, 4, 0, 10)], opt,
                 restore=(str(tmp_path), 2))
    assert [p.world_size for p in old.partitions()] == [1]
    with pytest.raises(Conflict, match="not 1"):
        Store().register("run", 0, 1, 0, [TableSpec("t", 10, 4, 0, 10)], opt,
                         restore=(str(tmp_path), 1))


def test_saved_tensors_hold_only_their_own_data(tmp_path: Path) -> None:
    """A tensor viewing a big storage (the shared-memory arena, a group's block) is saved
    as its own elements: torch.save alone writes the whole storage behind a view."""
    big = torch.arange(1 << 20, dtype=torch.int64)  # 8 MiB
    small: dict[str, Any] = {"ids": big[100:164], "rows": torch.randn(64, 16)[:, 8:], "n": 3,
             "nested": [big[:4], (big[8:12],)], "owned": torch.ones(5)}
    kept = owning_tensors(small)
    assert kept["owned"] is small["owned"] and kept["n"] == 3
    assert isinstance(kept["nested"][1], tuple)
    for got, want in [(kept["ids"], small["ids"]), (kept["rows"], small["rows"]),
                      (kept["nested"][0], big[:4]), (kept["nested"][1][0], big[8:12])]:
        assert torch.equal(got, want)
        assert got.untyped_storage().nbytes() == got.numel() * got.element_size()
    info = save_torch(tmp_path / "small.pt", small)
    assert info["bytes"] < 64 * 1024
    back = torch.load(tmp_path / "small.pt", weights_only=True)
    assert torch.equal(back["ids"], big[100:164]) and torch.equal(back["rows"], small["rows"])
    assert small["ids"].untyped_storage().nbytes() == big.numel() * 8  # the input unchanged


def test_fault_point_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "1:7:rows:sleep=0")
    fault_point(1, 7, "rows")  # sleeps 0s, returns
    fault_point(0, 7, "rows")
    monkeypatch.setenv(FAULT_ENV, "7:bogus")
    with pytest.raises(ValueError, match="phase"):
        fault_point(0, 7, "rows")


# -- end to end ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(server: PsServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """2 ranks: 20 steps straight; 10 steps then --resume to 20 (checkpoints every 10)."""
    d = tmp_path_factory.mktemp("runs")
    ps = ["--ps", server.address, "--checkpoint-every", "10"]
    run([*ps, "--run-id", "straight", "--steps", "20", "--checkpoint-dir", str(d / "ck_a"),
         "--dump-state", str(d / "straight.pt"), "--results", str(d / "straight.json")])
    run([*ps, "--run-id", "first", "--steps", "10", "--checkpoint-dir", str(d / "ck_b")])
    run([*ps, "--run-id", "resumed", "--steps", "20", "--checkpoint-dir", str(d / "ck_b"),
         "--resume", "--dump-state", str(d / "resumed.pt")])
    return {"dir": d, "straight": d / "straight.pt", "resumed": d / "resumed.pt",
            "ck_a": d / "ck_a", "ck_b": d / "ck_b"}


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_resume_is_bitwise_deterministic(runs: dict[str, Path]) -> None:
    assert_states(runs["straight"], runs["resumed"], exact=True)
    assert [s for s, _ in complete_checkpoints(runs["ck_b"])] == [9, 19]
    # ck_a's step 19 is an incremental link (its parent step 9), ck_b's the full first
    # checkpoint of the resumed run: the same optimizer state once composed
    assert Manifest.read(step_dir(runs["ck_a"], 19)).parent is not None
    assert Manifest.read(step_dir(runs["ck_b"], 19)).parent is None
    adam = dataclasses.asdict(OptimizerSpec())
    tables = Manifest.read(step_dir(runs["ck_b"], 19)).tables
    assert sorted(tables) == ["category", "item", "tag", "user"]
    for table, entry in tables.items():
        for lo, hi in ((s.row_start, s.row_end) for s in entry.shards):
            a, b = (load_optim_state(step_dir(runs[ck], 19), table=table,
                                     num_rows=entry.num_rows, dim=entry.dim, row_start=lo,
                                     row_end=hi, step=19, optimizer=adam)
                    for ck in ("ck_a", "ck_b"))
            assert a.adam_step == b.adam_step == 20
            assert a.last_step == b.last_step == 19
            for key in ("m", "v"):
                assert torch.equal(a.state[key], b.state[key]), (table, lo, key)
    manifest = json.loads((step_dir(runs["ck_b"], 9) / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["next_step"] == 10
    assert [(s["row_start"], s["row_end"]) for s in manifest["tables"]["user"]["shards"]] == [
        (0, 1000), (1000, 2000)]


@pytest.mark.e2e
@pytest.mark.timeout(600)
@pytest.mark.parametrize("nproc", [3, 1])
def test_resume_at_another_world_size(runs: dict[str, Path], server: PsServer,
                                      nproc: int) -> None:
    out = runs["dir"] / f"reshard{nproc}.pt"
    run(["--ps", server.address, "--run-id", f"reshard{nproc}", "--steps", "20",
         "--resume-from", str(step_dir(runs["ck_b"], 9)),
         "--checkpoint-dir", str(runs["dir"] / f"ck_w{nproc}"), "--dump-state", str(out)],
        nproc=nproc)
    assert_states(runs["straight"], out, exact=False)


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_local_optimizer_checkpoint_resumes_on_the_server(runs: dict[str, Path],
                                                          server: PsServer,
                                                          tmp_path: Path) -> None:
    """--local-optimizer writes the server's format: a local checkpoint resumes on a server."""
    run(["--local-optimizer", "--steps", "10", "--checkpoint-every", "10",
         "--checkpoint-dir", str(tmp_path / "ck")])
    run(["--ps", server.address, "--run-id", "from-local", "--steps", "20", "--resume",
         "--checkpoint-dir", str(tmp_path / "ck"), "--dump-state", str(tmp_path / "x.pt")])
    assert_states(runs["straight"], tmp_path / "x.pt", exact=False, atol=1e-6)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_torn_checkpoints_are_never_loaded(tmp_path: Path, server: PsServer,
                                           runs: dict[str, Path]) -> None:
    """A rank dies during the write of a checkpoint; --resume loads the previous one."""
    local = ["--local-optimizer", "--steps", "15", "--checkpoint-every", "5"]
    (step_dir(tmp_path / "straight", 2) / "rows").mkdir(parents=True)  # an old torn one
    run([*local, "--checkpoint-dir", str(tmp_path / "straight"), "--checkpoint-keep", "2",
         "--checkpoint-mode", "full",  # a chain keeps its links: test_incremental.py
         "--dump-state", str(tmp_path / "straight.pt")], nproc=1)
    assert sorted(p.name for p in (tmp_path / "straight").iterdir()
                  if p.name not in (SECRET_FILE, OWNER_FILE)) == [  # the run's claim
        "step-0000000009", "step-0000000014"]  # --checkpoint-keep 2 pruned the rest
    for phase in ("rows", "dense", "manifest"):
        ck = tmp_path / phase
        failed = run([*local, "--checkpoint-dir", str(ck)], nproc=1, expect=1,
                     env={FAULT_ENV: f"9:{phase}"})
        assert failed.returncode == FAULT_EXIT_CODE
        assert [s for s, _ in complete_checkpoints(ck)] == [4], phase
        proc = run([*local, "--checkpoint-dir", str(ck), "--resume", "--dump-state",
                    str(ck / "final.pt")], nproc=1)
        assert "resumed from" in proc.stderr and "step 4" in proc.stderr
        assert_states(tmp_path / "straight.pt", ck / "final.pt", exact=True)
    # 2 ranks on the server: rank 1 dies after the server saved its partition of step 19.
    srv = ["--ps", server.address, "--steps", "20", "--checkpoint-every", "10"]
    ck = tmp_path / "server"
    run([*srv, "--run-id", "torn-a", "--checkpoint-dir", str(ck)], expect=1,
        env={FAULT_ENV: "1:19:optim"})
    assert [s for s, _ in complete_checkpoints(ck)] == [9]
    run([*srv, "--run-id", "torn-b", "--checkpoint-dir", str(ck), "--resume",
         "--dump-state", str(ck / "final.pt")])
    assert_states(runs["straight"], ck / "final.pt", exact=True)


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_server_crash_recovery(tmp_path: Path, runs: dict[str, Path]) -> None:
    """kill -9 the shard server twice at random moments (a random delay after the step-4
    and the step-14 checkpoints appear: mid-step, mid-checkpoint or at the final Flush) and
    restart it, empty, on the same port. Each time the workers fail ("lost the optimizer
    state", or a failed Checkpoint/Flush), `torchrun --max-restarts` restarts them, they
    resume from the last complete checkpoint (the new server loads it: Register.restore),
    and the run ends bitwise equal to the uninterrupted run."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    kills = [(4, rng.uniform(0.0, 0.5)), (14, rng.uniform(0.0, 0.3))]  # (after step, delay s)
    what = f"random seed {seed}: kills {kills}"
    # The whole 20-step run can take under 0.5 s: every rank sleeps 1 s at the start of
    # the step-9 checkpoint, so the first kill always finds the run alive (mid-step or
    # mid-checkpoint).
    pace = {FAULT_ENV: "9:start:sleep=1"}
    servers = [start_ps_server(tmp_path / "ps0")]
    port = servers[0].port
    ck = tmp_path / "ck"
    args = [*COMMON, "--batch-size", str(GLOBAL_BATCH // 2), "--ps", servers[0].address,
            "--run-id", "crash", "--steps", "20", "--checkpoint-every", "5",
            "--checkpoint-dir", str(ck), "--resume", "--ps-timeout", "20",
            "--dump-state", str(tmp_path / "final.pt")]
    log_path = tmp_path / "workers.log"
    try:
        with open(log_path, "w") as log:
            proc = subprocess.Popen(worker_cmd(args, 2, max_restarts=3), cwd=REPO, stdout=log,
                                    stderr=subprocess.STDOUT, env=_env(pace))
            try:
                for n, (after, delay) in enumerate(kills):
                    deadline = time.monotonic() + 300
                    while not (step_dir(ck, after) / "manifest.json").exists():
                        assert proc.poll() is None and time.monotonic() < deadline, \
                            f"{what}\n{log_path.read_text()[-6000:]}"
                        time.sleep(0.02)
                    time.sleep(delay)
                    os.kill(servers[-1].proc.pid, signal.SIGKILL)
                    servers[-1].proc.wait()
                    servers.append(start_ps_server(tmp_path / f"ps{n + 1}", "--port", str(port)))
                returncode = proc.wait(600)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    finally:
        for server in servers:
            server.terminate()
    text = log_path.read_text()
    assert returncode == 0, f"{what}\n{text[-8000:]}"
    # The first kill lands mid-run (the step-9 checkpoint waits 1 s, longer than the
    # delay): at least one restart, on both ranks.
    assert text.count("resumed from") >= 2, f"{what}\n{text[-8000:]}"
    assert_states(runs["straight"], tmp_path / "final.pt", exact=True)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_checkpoints_do_not_change_a_stale_run(server: PsServer, tmp_path: Path) -> None:
    """--staleness 2: a checkpoint saves the arrived-but-unapplied updates instead of
    applying them early, so a run with checkpoints equals one without (bitwise), and runs
    resumed from a mid-run checkpoint at 2 ranks (bitwise) and 3 ranks equal it too."""
    stale = ["--ps", server.address, "--staleness", "2", "--steps", "16"]
    run([*stale, "--run-id", "k2-plain", "--dump-state", str(tmp_path / "plain.pt")])
    run([*stale, "--run-id", "k2-ck", "--checkpoint-every", "5", "--checkpoint-dir",
         str(tmp_path / "ck"), "--dump-state", str(tmp_path / "ck.pt")])
    assert_states(tmp_path / "plain.pt", tmp_path / "ck.pt", exact=True)
    manifest = json.loads((step_dir(tmp_path / "ck", 9) / "manifest.json").read_text())
    assert manifest["pending"]["applied_through"] == 7
    payload = torch.load(step_dir(tmp_path / "ck", 9) / manifest["pending"]["files"][1]["file"])
    assert [(u["step"], u["table"]) for u in payload["updates"]] == [
        (s, t) for s in (8, 9) for t in ("user", "item", "category", "tag")]
    assert payload["before"]["user"]["ids"].numel() > 0
    for nproc in (2, 3):
        out = tmp_path / f"resumed{nproc}.pt"
        run([*stale, "--run-id", f"k2-resumed{nproc}", "--resume-from",
             str(step_dir(tmp_path / "ck", 9)), "--dump-state", str(out)], nproc=nproc)
        assert_states(tmp_path / "plain.pt", out, exact=nproc == 2)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_pending_files_hold_only_the_pending_updates(server: PsServer, tmp_path: Path
                                                     ) -> None:
    """--staleness 2 with the shared-memory arena (the default on the server's node): the
    pending file holds the updates, their rows and the predictions, not the 64 MiB arena
    their ids view; no file of the checkpoint is larger than its data."""
    run(["--ps", server.address, "--run-id", "pending-size", "--staleness", "2",
         "--steps", "6", "--checkpoint-every", "3", "--checkpoint-dir", str(tmp_path / "ck"),
         "--results", str(tmp_path / "r.json")], nproc=1)
    results = json.loads((tmp_path / "r.json").read_text())
    assert results["sync"]["shm"] == "on" and results["sync"]["shm_pushes"] > 0
    assert results["config"]["staleness_compensation"] == "predict"
    for step in (2, 5):
        directory = step_dir(tmp_path / "ck", step)
        manifest = json.loads((directory / "manifest.json").read_text())
        (entry,) = manifest["pending"]["files"]
        payload = torch.load(directory / entry["file"], weights_only=True)
        assert payload["updates"] and payload["prediction"]["deltas"]
        assert entry["bytes"] < 1 << 20, f"{entry['file']}: {entry['bytes']} bytes"
        sizes = {str(f.relative_to(directory)): f.stat().st_size
                 for f in directory.rglob("*") if f.is_file()}
        assert sum(sizes.values()) < 4 << 20, sizes


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_export_reproduces_the_sharded_model(runs: dict[str, Path], tmp_path: Path) -> None:
    from tests.testing.reference_trainer import LocalEmbedding
    from worker.config.train_config import TrainConfig
    from worker.tasks import build_task
    from worker.tasks.base import HybridModel, build_dense_seeded

    out = tmp_path / "model.pt"
    proc = subprocess.run([sys.executable, "-m", "worker.export", "--checkpoint",
                           str(runs["ck_a"]), "--out", str(out)], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "exported step 19" in proc.stdout
    exported = torch.load(out)
    cfg = TrainConfig.of(local_optimizer=True, num_rows=2000, dim=8, batch_size=48)
    task = build_task(cfg)
    model = HybridModel(LocalEmbedding(task.tables(), seed=1, init_std=1.0),
                        build_dense_seeded(task, 1))
    model.load_state_dict(exported)  # strict: exactly the un-sharded model's keys
    dump = torch.load(runs["straight"])
    for name, rows in dump["tables"].items():
        assert torch.equal(exported[f"embedding.tables.{name}.weight"], rows)
    for key, value in dump["dense"].items():
        assert torch.equal(exported[f"dense.{key}"], value)
    # The sharded run's eval metrics (mean over its 2 ranks' eval slices) are reproduced.
    res = json.loads((runs["dir"] / "straight.json").read_text())
    with torch.no_grad():
        sums: dict[str, float] = {}
        for rank in (0, 1):
            batch = task.eval_batch(0, rank, 2)
            assert batch is not None
            for k, v in task.evaluate(model, batch).items():
                sums[k] = sums.get(k, 0.0) + float(v) / 2
    for k, v in res["eval"].items():
        assert sums[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


def test_checkpoint_flags_validate() -> None:
    from hybridps.cli import parse_config
    from worker.config.train_config import TrainConfig

    env = {"HYBRIDPS_LOCAL_OPTIMIZER": "1"}
    cfg = parse_config(TrainConfig, ["--checkpoint-dir", "/tmp/x", "--checkpoint-every", "5",
                                     "--resume", "true"], environ=env)
    ck = cfg.checkpoint
    assert (ck.checkpoint_dir, ck.checkpoint_every, ck.resume) == ("/tmp/x", 5, True)
    for kwargs, named in [({"checkpoint_every": 5}, "checkpoint_every=5 needs"),
                          ({"resume": True}, "resume=True needs"),
                          ({"checkpoint_every": -1, "checkpoint_dir": "d"},
                           "checkpoint_every=-1")]:
        with pytest.raises(ValueError, match=named):
            TrainConfig.of(local_optimizer=True, **kwargs)


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_resume_on_two_nodes_with_two_servers(runs: dict[str, Path], tmp_path: Path) -> None:
    """The checkpoint written by ONE server resumes on two "nodes" (`--ps A,B`, one rank
    each, like tests/worker/runtime/test_multinode.py): each new server loads only its node's
    rank."""
    import socket

    from ps.admin import get_shard_stats

    servers = [start_ps_server(tmp_path / f"node{i}") for i in range(2)]
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            endpoint = f"127.0.0.1:{s.getsockname()[1]}"
        dump = tmp_path / "state.pt"
        agents = []
        for i in range(2):
            cmd = [TORCHRUN, "--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", endpoint, "--rdzv-id", "ckpt-two-nodes", "--local-addr",
                   "127.0.0.1", MAIN, *COMMON, "--batch-size", str(GLOBAL_BATCH // 2),
                   "--ps", ",".join(s.address for s in servers), "--run-id", "two-nodes",
                   "--steps", "20", "--resume-from", str(step_dir(runs["ck_b"], 9)),
                   "--checkpoint-dir", str(tmp_path / "ck"), "--dump-state", str(dump)]
            log = open(tmp_path / f"agent{i}.log", "w")  # noqa: SIM115 - closed below
            agents.append((subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=log,
                                            stderr=subprocess.STDOUT), log))
            time.sleep(0.5)  # the first agent hosts the rendezvous store
        for proc, log in agents:
            try:
                proc.wait(300)
            finally:
                log.close()
        for i, (proc, _) in enumerate(agents):
            assert proc.returncode == 0, (tmp_path / f"agent{i}.log").read_text()[-4000:]
        for node, server in enumerate(servers):
            stats = get_shard_stats(server.address, run_id="two-nodes")
            assert {p.rank for p in stats.partitions} == {node}, stats
            assert all(p.last_step == 19 for p in stats.partitions)
        assert_states(runs["straight"], dump, exact=True)
    finally:
        for server in servers:
            server.terminate()


@pytest.mark.e2e
def test_export_reads_pre_dcp_checkpoints(runs: dict[str, Path], tmp_path: Path) -> None:
    """Checkpoints written before the dense part moved to DCP hold one dense.pt of full
    state dicts; export (and resume, the same reader) still take them."""
    import shutil

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from hybridps.checkpoint import read_manifest, save_torch
    from worker.export import export_state_dict

    old = tmp_path / "step-0000000019"
    shutil.copytree(step_dir(runs["ck_a"], 19), old)
    shutil.copytree(step_dir(runs["ck_a"], 9), tmp_path / "step-0000000009")  # its parent
    dcp_to_torch_save(old / "dense", tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    shutil.rmtree(old / "dense")
    manifest = read_manifest(old)
    manifest["dense"] = {"file": "dense.pt", **save_torch(
        old / "dense.pt", {"model": full["model"], "optimizer": full["optim"], "step": 19})}
    write_manifest(old, manifest)
    new_state, _ = export_state_dict(step_dir(runs["ck_a"], 19))
    old_state, step = export_state_dict(old)
    assert step == 19 and set(old_state) == set(new_state)
    assert any(key.startswith("dense.") for key in old_state)
    for key, value in new_state.items():
        assert torch.equal(old_state[key], value), key


def test_resume_may_change_only_the_learning_rates_and_weight_decay() -> None:
    from worker.checkpoint.resume import ResumeError, resume_changes

    adamw = dataclasses.asdict(OptimizerSpec(kind="adamw", lr=0.02))
    dense = {"kind": "adamw", "lr": 3e-3, "weight_decay": 0.0}
    assert resume_changes("ck", adamw, adamw, dense, dense) == []
    lower = {**adamw, "lr": 0.005, "weight_decay": 0.01}
    assert resume_changes("ck", adamw, lower, dense,
                          {**dense, "lr": 1e-3, "weight_decay": 0.01}) == [
        "lr 0.02 -> 0.005", "weight_decay 0 -> 0.01", "dense_lr 0.003 -> 0.001"]
    assert resume_changes("ck", {}, lower, None, dense) == []  # recorded by neither
    for other in ({**adamw, "kind": "adam"}, {**adamw, "beta2": 0.99}, {**adamw, "eps": 1e-6}):
        with pytest.raises(ResumeError, match=r"was saved with optimizer adamw\(lr=0.02.*"
                           r"only lr and weight_decay may change on resume"):
            resume_changes("ck", adamw, other, dense, dense)
    with pytest.raises(ResumeError, match="dense part was saved with optimizer adamw, this run "
                       "has sgd: resume with --dense-optimizer adamw"):
        resume_changes("ck", adamw, adamw, dense, {**dense, "kind": "sgd"})


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_resume_with_lower_learning_rates(server: PsServer, tmp_path: Path) -> None:
    """A resume may lower --lr and --dense-lr: it says so in one line, the server and the
    dense optimizer use the new rates from the first resumed step (equal, bitwise, to a
    resume from a checkpoint that recorded them), and later checkpoints record them; another
    optimizer kind is still refused."""
    ps = ["--ps", server.address]
    adamw = ["--optimizer", "adamw"]
    run([*ps, *adamw, "--run-id", "lr-first", "--steps", "10", "--checkpoint-every", "10",
         "--checkpoint-dir", str(tmp_path / "ck")])
    start = step_dir(tmp_path / "ck", 9)
    lower = [*adamw, "--lr", "0.005", "--dense-lr", "0.001", "--weight-decay", "0.01"]
    changed = run([*ps, *lower, "--run-id", "lr-lower", "--steps", "20",
                   "--resume-from", str(start), "--checkpoint-every", "10",
                   "--checkpoint-dir", str(tmp_path / "ck_lower"),
                   "--dump-state", str(tmp_path / "lower.pt")])
    lines = [line for line in changed.stderr.splitlines() if "resume: " in line]
    assert len(lines) == 1, changed.stderr[-3000:]
    assert lines[0].endswith("resume: lr 0.02 -> 0.005, weight_decay 0 -> 0.01, "
                             "dense_lr 0.003 -> 0.001"), lines[0]
    later = json.loads((step_dir(tmp_path / "ck_lower", 19) / "manifest.json").read_text())
    assert (later["optimizer"]["lr"], later["optimizer"]["weight_decay"]) == (0.005, 0.01)
    assert later["dense"]["optimizer"] == {"kind": "adamw", "lr": 0.001, "weight_decay": 0.01}
    meta = read_shard(step_dir(tmp_path / "ck_lower", 19) / "optim/user.r00000.pt")["meta"]
    assert meta["optimizer"]["lr"] == 0.005
    from worker.checkpoint.dense import read_dense_full
    dense = read_dense_full(step_dir(tmp_path / "ck_lower", 19), later["dense"])
    assert {(g["lr"], g["weight_decay"]) for g in dense["optim"]["param_groups"]} == {
        (0.001, 0.01)}  # the dense optimizer ran at the new rates, not the restored ones
    run([*ps, *adamw, "--run-id", "lr-same", "--steps", "20", "--resume-from", str(start),
         "--dump-state", str(tmp_path / "same.pt")])
    with pytest.raises(AssertionError, match="differs"):
        assert_states(tmp_path / "same.pt", tmp_path / "lower.pt", exact=True)
    # The reference: the same checkpoint, recording the new settings as its own.
    manifest = json.loads((start / "manifest.json").read_text())
    manifest["optimizer"].update(lr=0.005, weight_decay=0.01)
    manifest["dense"]["optimizer"].update(lr=0.001, weight_decay=0.01)
    write_manifest(start, {k: v for k, v in manifest.items() if k not in ("format", "checksum")})
    ref = run([*ps, *lower, "--run-id", "lr-ref", "--steps", "20", "--resume-from", str(start),
               "--dump-state", str(tmp_path / "ref.pt")])
    assert "resume: " not in ref.stderr
    assert_states(tmp_path / "ref.pt", tmp_path / "lower.pt", exact=True)
    refused = run([*ps, "--optimizer", "adam", "--run-id", "lr-adam", "--steps", "20",
                   "--resume-from", str(start)], expect=2)
    errors = [line for line in refused.stderr.splitlines() if "hybridps worker: error:" in line]
    assert errors and "this run has adam(lr=0.02" in errors[0], refused.stderr[-2000:]
    assert "only lr and weight_decay may change on resume" in errors[0]
