"""The exactness tests on a CUDA device (marker `gpu`; `pytest -m gpu`; gpu_check/check.py
runs them on a lent GPU). Without CUDA they skip, so every suite still collects them;
GPU_TESTS_DEVICE=cpu runs them on the CPU (gpu_check/check.py --dry-run).

One worker rank (`python -m worker.main --device cuda`) and a real shard server:
(a) --staleness 0 equals the single-process reference trained on the same device, with
    the shard server and with --local-optimizer (m, v on the device);
(b) bf16 rows on the device are the server's fp32 master rows rounded to bf16, bitwise;
(c) a checkpoint written on the device resumes on the CPU, and one written on the CPU
    resumes on the device, both equal to the uninterrupted run on the device;
(d) `python -m worker.export` of a checkpoint written on the device rebuilds the model on
    the CPU: the rows and dense weights of the run, bitwise;
(e) dynamic tables with their rows on the device make every id decision (admissions,
    evictions, page-ins, expiry) as on the CPU, and train to the same losses.
Tolerances: the server's Adam (C, on the host) and torch.optim.SparseAdam on the device
round differently, and the device sums duplicate ids in another order; Adam amplifies
that for rows whose gradients are ~0. The bugs these tests catch (a lost or doubled
update, a wrong staleness, a missing gradient scale) are >= 1e-3.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridps.checkpoint import read_shard, step_dir
from tests.testing.helpers import PsServer, start_ps_server
from tests.testing.reference_trainer import LocalEmbedding, train_reference
from worker.config.train_config import TrainConfig

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]
STEPS = 20
COMMON = ["--num-rows", "2000", "--dim", "8", "--batch-size", "64", "--log-every", "5",
          "--eval-batches", "1", "--progress", "false", "--staleness", "0"]
RTOL, ATOL = 1e-4, 1e-5


def device_under_test() -> str:
    forced = os.environ.get("GPU_TESTS_DEVICE", "")
    if forced:
        return forced
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device (GPU_TESTS_DEVICE=cpu runs these tests on the CPU)")
    return "cuda"


@pytest.fixture(scope="module")
def device() -> str:
    return device_under_test()


@pytest.fixture(scope="module")
def server(device: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PsServer]:
    ps = start_ps_server(tmp_path_factory.mktemp("ps"))
    try:
        yield ps
    finally:
        ps.terminate()


def run_worker(args: list[str], device: str, timeout: float = 180.0) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "worker.main", "--device", device,
                           *COMMON, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise AssertionError(f"worker on {device} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def load(path: Path) -> Any:
    """A --dump-state or export file, on the CPU (a GPU run may have saved CUDA tensors)."""
    return torch.load(path, map_location="cpu")


def config(**overrides: Any) -> TrainConfig:
    return TrainConfig.of(**{"local_optimizer": True, "num_rows": 2000, "dim": 8,
                             "batch_size": 64, "steps": STEPS, "staleness": 0, **overrides})


def assert_close_states(got: dict[str, Any], want_tables: dict[str, torch.Tensor],
                        want_dense: dict[str, torch.Tensor]) -> None:
    assert set(got["tables"]) == set(want_tables)
    for name, rows in got["tables"].items():
        try:
            torch.testing.assert_close(rows, want_tables[name].to(rows.device), rtol=RTOL,
                                       atol=ATOL)
        except AssertionError as exc:
            raise AssertionError(f"table {name}: {exc}") from None
    assert set(got["dense"]) == set(want_dense) and want_dense
    for key, value in got["dense"].items():
        try:
            torch.testing.assert_close(value, want_dense[key].to(value.device), rtol=RTOL,
                                       atol=ATOL)
        except AssertionError as exc:
            raise AssertionError(f"dense {key}: {exc}") from None


@pytest.fixture(scope="module")
def straight(device: str, server: PsServer, tmp_path_factory: pytest.TempPathFactory
             ) -> dict[str, Path]:
    """20 steps on the device with the server, checkpoints every 10."""
    d = tmp_path_factory.mktemp("straight")
    run_worker(["--ps", server.address, "--run-id", "gpu-straight", "--steps", str(STEPS),
                "--checkpoint-every", "10", "--checkpoint-dir", str(d / "ck"),
                "--dump-state", str(d / "state.pt")], device)
    return {"dir": d, "state": d / "state.pt", "ck": d / "ck"}


@pytest.mark.timeout(300)
def test_staleness0_on_the_device_equals_the_reference(device: str,
                                                       straight: dict[str, Path]) -> None:
    state = load(straight["state"])
    ref = train_reference(config(), world_size=1, device=device)
    initial = train_reference(config(), world_size=1, steps=0)
    for name, rows in state["tables"].items():
        assert not torch.equal(rows, initial.tables[name]), f"table {name} never trained"
    assert_close_states(state, ref.tables, ref.dense)


@pytest.mark.timeout(300)
def test_local_optimizer_on_the_device_equals_the_reference(device: str,
                                                            tmp_path: Path) -> None:
    """--local-optimizer: the server's kernels with m, v on the device."""
    run_worker(["--local-optimizer", "--steps", str(STEPS), "--dump-state",
                str(tmp_path / "state.pt")], device)
    ref = train_reference(config(), world_size=1, device=device)
    assert_close_states(load(tmp_path / "state.pt"), ref.tables, ref.dense)


@pytest.mark.timeout(300)
def test_bf16_rows_are_the_servers_fp32_master_rounded(device: str, server: PsServer,
                                                       tmp_path: Path) -> None:
    run_worker(["--ps", server.address, "--run-id", "gpu-bf16", "--row-dtype", "bf16",
                "--steps", "10", "--checkpoint-every", "10", "--checkpoint-dir",
                str(tmp_path / "ck"), "--dump-state", str(tmp_path / "state.pt")], device)
    state = load(tmp_path / "state.pt")
    initial = train_reference(config(), world_size=1, steps=0)
    for name, rows in state["tables"].items():
        assert rows.dtype == torch.bfloat16, name
        master = read_shard(step_dir(tmp_path / "ck", 9) / f"optim/{name}.r00000.pt")
        master_RD = master["tensors"]["master"]
        assert master_RD.dtype == torch.float32 and master_RD.shape == rows.shape, name
        assert torch.equal(rows, master_RD.to(torch.bfloat16)), f"table {name}"
        assert not torch.equal(master_RD, initial.tables[name]), f"table {name} never trained"


@pytest.mark.timeout(420)
@pytest.mark.parametrize("first,then", [("device", "cpu"), ("cpu", "device")])
def test_a_checkpoint_resumes_across_devices(device: str, server: PsServer,
                                             straight: dict[str, Path], tmp_path: Path,
                                             first: str, then: str) -> None:
    """10 steps on one device, a checkpoint, 10 more on the other: the straight run."""
    on = {"device": device, "cpu": "cpu"}
    ck = ["--checkpoint-every", "10", "--checkpoint-dir", str(tmp_path / "ck")]
    run_worker(["--ps", server.address, "--run-id", f"gpu-{first}-first", "--steps", "10",
                *ck], on[first])
    run_worker(["--ps", server.address, "--run-id", f"gpu-{first}-then-{then}", "--steps",
                str(STEPS), "--resume", *ck, "--dump-state", str(tmp_path / "state.pt")],
               on[then])
    want = load(straight["state"])
    assert_close_states(load(tmp_path / "state.pt"), want["tables"], want["dense"])


@pytest.mark.timeout(300)
def test_export_of_a_device_checkpoint(straight: dict[str, Path], tmp_path: Path) -> None:
    """The straight run's last checkpoint (written by the device) exported on the CPU."""
    from worker.tasks import build_task
    from worker.tasks.base import HybridModel, build_dense_seeded

    out = tmp_path / "model.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    proc = subprocess.run([sys.executable, "-m", "worker.export", "--checkpoint",
                           str(straight["ck"]), "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert f"exported step {STEPS - 1}" in proc.stdout
    exported = load(out)
    cfg = config()
    task = build_task(cfg)
    model = HybridModel(LocalEmbedding(task.tables(), seed=cfg.run.seed,
                                       init_std=cfg.optim.init_std),
                        build_dense_seeded(task, cfg.run.seed))
    model.load_state_dict(exported)  # strict: exactly the un-sharded model's keys
    dump = load(straight["state"])
    for name, rows in dump["tables"].items():
        assert torch.equal(exported[f"embedding.tables.{name}.weight"], rows), name
    for key, value in dump["dense"].items():
        assert torch.equal(exported[f"dense.{key}"], value), key


DYNAMIC = ["--local-optimizer", "--task", "tables", "--num-rows", "300", "--batch-size", "32",
           "--tables", "user:40:dynamic:lfu:expire=6,ad:30:3:dynamic:threshold=2,s:50",
           "--staleness", "1", "--steps", str(STEPS)]
# what a dynamic table decides from the ids alone (the same on any device)
DYNAMIC_COUNTS = ("lookups", "hits", "admissions", "refused_filter", "refused_capacity",
                  "evictions", "page_ins", "dropped_paged", "occupied", "paged")


@pytest.mark.timeout(300)
def test_dynamic_tables_on_the_device_decide_and_train_as_on_the_cpu(
        device: str, tmp_path: Path) -> None:
    """Dynamic tables with rows on the device (the id -> slot maps and the paged store on
    the host), at K=1 with evictions, page-ins, refusals and expiry: every count the ids
    decide equals the CPU run's, and the losses agree."""
    import json

    results = {}
    for where in (device, "cpu"):
        out = tmp_path / f"{where}.json"
        run_worker([*DYNAMIC, "--results", str(out)], where)
        results[where] = json.loads(out.read_text())
    got, want = results[device], results["cpu"]
    assert set(got["dynamic"]) == {"user", "ad"}
    for table, counts in want["dynamic"].items():
        assert counts["evictions"] > 0 and counts["page_ins"] > 0, (table, counts)
        for key in DYNAMIC_COUNTS:
            assert got["dynamic"][table][key] == counts[key], (table, key)
    got_loss = [loss for _, loss in got["loss_curve"]]
    want_loss = [loss for _, loss in want["loss_curve"]]
    torch.testing.assert_close(torch.tensor(got_loss), torch.tensor(want_loss), rtol=1e-3,
                               atol=1e-4)
