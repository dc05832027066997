"""End to end (torchrun, 2 gloo ranks, --local-optimizer): a run whose optimizer state is
twice --local-memory-budget-mb, and whose touched rows do not fit it, is bitwise the
unbounded run at K = 0 and 1, checkpointed through the spilled pages and resumed from
them; its spill files are gone at exit. A dynamic table's paged-out rows spilled under
the budget likewise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridps.checkpoint import step_dir
from hybridps.paged_rows import ENTRY_OVERHEAD_BYTES

REPO = Path(__file__).resolve().parents[3]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
# the synthetic task's tables at --num-rows 400,000, D=8, adam: about 2 MB of m and v a
# rank, twice the budget of 1 MiB; 2048 samples a step, so that a rank touches more rows
# than the budget holds (the hot set is row-granular: rows never touched cost nothing)
COMMON = ["--local-optimizer", "--num-rows", "400000", "--dim", "8", "--steps", "20",
          "--batch-size", "2048", "--log-every", "5", "--eval-batches", "1", "--progress",
          "false", "--checkpoint-every", "10", "--checkpoint-mode", "full"]
BUDGET_MB = 1


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node", "2",
                           str(REPO / "worker" / "main.py"), *COMMON, *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"worker exit {proc.returncode}:\n{proc.stderr[-6000:]}"
    return proc


def _assert_same_dump(a: Path, b: Path) -> None:
    x, y = torch.load(a), torch.load(b)
    for part in ("tables", "dense"):
        assert set(x[part]) == set(y[part]) and x[part]
        for key in x[part]:
            assert torch.equal(x[part][key], y[part][key]), f"{part} {key} differs"


def _assert_same_optim(a: Path, b: Path) -> None:
    files = sorted((a / "optim").iterdir())
    assert files and [f.name for f in files] == sorted(p.name for p in (b / "optim").iterdir())
    for f in files:
        x = torch.load(f, weights_only=False)["tensors"]
        y = torch.load(b / "optim" / f.name, weights_only=False)["tensors"]
        assert x.keys() == y.keys() and x
        assert any(isinstance(t, torch.Tensor) for t in x.values())
        for key in x:
            same = (x[key] is None and y[key] is None) if x[key] is None else torch.equal(
                x[key], y[key])
            assert same, f"{f.name} {key} differs"


@pytest.mark.e2e
@pytest.mark.timeout(900)
@pytest.mark.parametrize("staleness", [0, 1])
def test_a_small_budget_is_bitwise_the_unbounded_run(tmp_path: Path, staleness: int
                                                       ) -> None:
    k = ["--staleness", str(staleness)]
    spill = tmp_path / "spill"
    bound = ["--local-memory-budget-mb", str(BUDGET_MB), "--local-spill-dir", str(spill),
             "--local-spill-page-kb", "4"]
    _run([*k, "--checkpoint-dir", str(tmp_path / "free"), "--dump-state",
          str(tmp_path / "free.pt")])
    _run([*k, *bound, "--checkpoint-dir", str(tmp_path / "bound"), "--dump-state",
          str(tmp_path / "bound.pt"), "--results", str(tmp_path / "bound.json")])
    _assert_same_dump(tmp_path / "free.pt", tmp_path / "bound.pt")
    for step in (9, 19):
        _assert_same_optim(step_dir(tmp_path / "free", step), step_dir(tmp_path / "bound", step))
    memory = json.loads((tmp_path / "bound.json").read_text())["sync"]["local_memory"]
    assert memory["budget_bytes"] == BUDGET_MB << 20
    assert memory["spills"] > 0 and memory["fills"] > 0 and memory["spilled_units"]
    assert list(spill.iterdir()) == []  # each rank removed its spill directory at exit
    # resumed from the spilled state of step 9, under the budget again
    _run([*k, *bound, "--resume-from", str(step_dir(tmp_path / "bound", 9)),
          "--checkpoint-dir", str(tmp_path / "again"), "--dump-state",
          str(tmp_path / "again.pt")])
    _assert_same_dump(tmp_path / "free.pt", tmp_path / "again.pt")
    _assert_same_optim(step_dir(tmp_path / "free", 19), step_dir(tmp_path / "again", 19))


# a dynamic table of 2048 slots at D=32 (m and v: 256 KiB a rank, within half the budget)
# whose paged-out rows outgrow the memory the budget leaves them: their rows and state
# spill under --local-spill-max-gb, none is dropped
DYNAMIC = ["--task", "tables", "--num-rows", "20000", "--dim", "32", "--tables",
           "user:2048:dynamic,s:1000", "--batch-size", "1024"]


def _assert_same_paged(a: Path, b: Path) -> None:
    files = sorted((a / "paged").iterdir())
    assert files and [f.name for f in files] == sorted(p.name for p in (b / "paged").iterdir())
    for f in files:
        x = torch.load(f, weights_only=False)
        y = torch.load(b / "paged" / f.name, weights_only=False)
        assert x.keys() == y.keys()
        for key in x:
            if isinstance(x[key], torch.Tensor):
                assert torch.equal(x[key], y[key]), f"{f.name} {key} differs"
            elif isinstance(x[key], dict):
                assert x[key].keys() == y[key].keys(), f"{f.name} {key} differs"
                for k, t in x[key].items():
                    same = torch.equal(t, y[key][k]) if isinstance(t, torch.Tensor) else (
                        t == y[key][k])
                    assert same, f"{f.name} {key}.{k} differs"
            else:
                assert x[key] == y[key], f"{f.name} {key} differs"


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_a_dynamic_tables_spilled_paged_rows_are_bitwise_the_unbounded_run(
        tmp_path: Path) -> None:
    k = [*DYNAMIC, "--staleness", "1"]
    spill = tmp_path / "spill"
    bound = ["--local-memory-budget-mb", str(BUDGET_MB), "--local-spill-dir", str(spill),
             "--local-spill-max-gb", "1"]
    _run([*k, "--checkpoint-dir", str(tmp_path / "free"), "--dump-state",
          str(tmp_path / "free.pt"), "--results", str(tmp_path / "free.json")])
    _run([*k, *bound, "--checkpoint-dir", str(tmp_path / "bound"), "--dump-state",
          str(tmp_path / "bound.pt"), "--results", str(tmp_path / "bound.json")])
    _assert_same_dump(tmp_path / "free.pt", tmp_path / "bound.pt")
    for step in (9, 19):
        free, bounded = step_dir(tmp_path / "free", step), step_dir(tmp_path / "bound", step)
        _assert_same_optim(free, bounded)
        _assert_same_paged(free, bounded)
    memory = json.loads((tmp_path / "bound.json").read_text())["sync"]["local_memory"]
    assert memory["paged_spills"] > 0 and memory["paged_fills"] > 0
    assert memory["paged_disk_bytes"] > 0 and memory["paged_dropped"] == 0
    # more paged rows than the memory the budget leaves them holds in memory alone
    row_bytes = 4 * 3 * 32 + ENTRY_OVERHEAD_BYTES  # a row, its m and v, its bookkeeping
    assert memory["paged_rows"] * row_bytes > (BUDGET_MB << 20) - memory["state_bytes"]
    dynamic = json.loads((tmp_path / "bound.json").read_text())["dynamic"]["user"]
    assert dynamic["page_ins"] > 0 and dynamic["dropped_paged"] == 0
    assert list(spill.iterdir()) == []
    # resumed from the checkpoint of step 9, under the budget again
    _run([*k, *bound, "--resume-from", str(step_dir(tmp_path / "bound", 9)),
          "--checkpoint-dir", str(tmp_path / "again"), "--dump-state",
          str(tmp_path / "again.pt"), "--results", str(tmp_path / "again.json")])
    again = json.loads((tmp_path / "again.json").read_text())["sync"]["local_memory"]
    assert again["paged_spills"] > 0 and again["paged_dropped"] == 0  # restored into pages
    _assert_same_dump(tmp_path / "free.pt", tmp_path / "again.pt")
    _assert_same_optim(step_dir(tmp_path / "free", 19), step_dir(tmp_path / "again", 19))
    _assert_same_paged(step_dir(tmp_path / "free", 19), step_dir(tmp_path / "again", 19))
