"""Sizing plan (worker/plan.py): the per-row arithmetic, docs/deploy.md's worked example,
and `worker/main.py --plan` / the refusal of a config that cannot fit, before allocating."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridps.cli import parse_config
from tests.testing.helpers import REPO
from worker.config.task_defaults import task_defaults
from worker.config.train_config import TrainConfig
from worker.config.update_kinds import kind_named
from worker.plan import (
    Plan,
    PlanError,
    TableShape,
    format_plan,
    optimizer_state_bytes,
    plan_for_config,
)
from worker.plan import main as plan_main

MAIN = str(REPO / "worker" / "main.py")


def example(optimizer: str = "adam") -> Plan:
    """docs/deploy.md: one 1e9-row, 128-dim table on 8 nodes x 8 GPUs."""
    return Plan([TableShape("table", 10**9, 128)], world_size=64, ranks_per_node=8,
                batch_size=4096, optimizer=optimizer, staleness=1, update_kind=kind_named("server"))


def test_bytes_per_row() -> None:
    plan = example()
    t = plan.tables[0]
    assert plan.rows_per_rank(t) == 15_625_000
    assert plan.device_rows_bytes == 15_625_000 * 128 * 4 == 8_000_000_000
    assert plan.host_state_bytes_per_rank == 15_625_000 * (128 * 8 + 2)  # m, v; two flags
    assert plan.host_bytes_per_server >= 8 * 15_625_000 * 1026 == 128_250_000_000
    assert plan.wire_bytes_per_rank_step == (4096 * (8 + 512), 4096 * (8 + 512))
    sgd = example("sgd")
    assert sgd.host_state_bytes_per_rank == 2 * 15_625_000  # the touched and changed flags
    local = Plan([TableShape("t", 1000, 4)], 1, 1, 10, "adam", 0, update_kind=kind_named("local"))
    assert local.device_state_bytes == 1000 * 4 * 4 * 2 and local.host_bytes_per_server == 0


def test_refusals_name_the_numbers() -> None:
    plan = example()
    plan.device_capacity, plan.host_capacity = 80 * 10**9, 512 * 10**9
    assert plan.fits
    plan.device_capacity, plan.host_capacity = 4 * 10**9, 100 * 10**9
    text = " ".join(plan.refusals)
    assert "each rank needs 8.015 GB" in text and "a device has 4.000 GB" in text
    assert "shard server needs 128.386 GB" in text and "a node has 100.000 GB" in text
    assert "DOES NOT FIT" in format_plan(plan)


def test_docs_worked_example_matches_the_calculator(capsys: object) -> None:
    code = plan_main(["--rows", "1000000000", "--dim", "128", "--nodes", "8",
                      "--ranks-per-node", "8"])
    assert code == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    docs = (REPO / "docs" / "deploy.md").read_text()
    for line in out.splitlines():
        if line.startswith(("device bytes", "host bytes", "wire bytes")):
            assert line in docs, f"docs/deploy.md is out of date; the calculator says:\n{line}"


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HYBRIDPS_", "RANK",
                                                                     "WORLD_SIZE", "LOCAL_"))}
    return subprocess.run([sys.executable, MAIN, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**base, **(env or {})}, check=False)


@pytest.mark.e2e
def test_main_plan_prints_the_plan_of_the_flags_and_layout() -> None:
    proc = _run("--plan", "--local-optimizer", "--num-rows", "1000000000", "--dim", "128",
                "--device", "cuda", "--device-memory-gb", "80", "--host-memory-gb", "512",
                env={"WORLD_SIZE": "64", "LOCAL_WORLD_SIZE": "8"})
    assert "64 ranks = 8 node(s) x 8 ranks" in proc.stdout, proc.stderr
    assert "user: 1,000,000,000 rows x 128 dim" in proc.stdout
    assert "tag: 10,000,000 rows" in proc.stdout
    # --local-optimizer keeps m, v on the device: 3 x 4 x 128 bytes per row there.
    assert "verdict: fits" in proc.stdout and proc.returncode == 0


@pytest.mark.e2e
def test_a_config_that_cannot_fit_is_refused_before_allocating() -> None:
    args = ("--ps", "127.0.0.1:1", "--num-rows", "1000000000", "--dim", "128",
            "--device", "cpu", "--host-memory-gb", "64")
    start = time.monotonic()
    proc = _run(*args)  # would need ~1.5 TB; nothing is allocated, no server contacted
    assert proc.returncode == 1, proc.stderr
    assert time.monotonic() - start < 60
    assert "cannot fit; nothing was allocated" in proc.stderr
    assert "a node has 64.000 GB" in proc.stderr
    planned = _run("--plan", *args)
    assert planned.returncode == 1 and "verdict: DOES NOT FIT" in planned.stdout


# -- sizing without a cluster: `python -m worker.plan --world-size N --nodes M [worker flags]`

def test_optimizer_state_size_is_said_in_one_place() -> None:
    assert optimizer_state_bytes("adam") == optimizer_state_bytes("adamw") == 8
    assert optimizer_state_bytes("sgd") == 0
    with pytest.raises(PlanError, match="no state size known for optimizer 'lion'"):
        optimizer_state_bytes("lion")
    bf16 = Plan([TableShape("t", 100, 4)], 1, 1, 10, "adam", 0, update_kind=kind_named("server"),
                row_bytes=2)
    assert bf16.host_state_bytes_per_rank == 100 * (4 * (8 + 4) + 2)  # m, v, fp32 master; flags


JOB = ["--num-rows", "1000000000", "--dim", "128", "--batch-size", "4096",
       "--device-memory-gb", "80", "--host-memory-gb", "512"]


def test_a_job_on_a_cluster_is_planned_without_a_server(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    code = plan_main(["--world-size", "64", "--nodes", "8", *JOB])  # no --ps, no torchrun
    out = capsys.readouterr().out
    assert code == 0, out
    assert "hybridps plan: 64 ranks = 8 node(s) x 8 ranks, batch 4096/rank" in out
    assert "user: 1,000,000,000 rows x 128 dim" in out
    cfg = parse_config(TrainConfig, [*JOB, "--plan"], defaults=task_defaults)
    expected = plan_for_config(cfg, world_size=64, ranks_per_node=8, detect=False)
    assert expected.device_kind == "cuda" and expected.fits
    assert format_plan(expected) in out  # per GPU, per server, on the wire, the verdict
    lines = out.splitlines()
    server = lines[lines.index("  on each node, its shard server:") + 1]
    assert server.strip().startswith("python -m ps --host 0.0.0.0 --port 50051 "
                                     "--auth-token-file ps.token")
    ranks = " ".join(lines[lines.index("  on each node, its ranks:") + 1:][:2])
    assert "hybridps-run --nnodes 8 --nproc_per_node 8 --rdzv-backend c10d" in ranks
    assert ("worker/main.py --ps " + ",".join(f"NODE{i}:50051" for i in range(8))) in ranks
    assert "--num-rows 1000000000 --dim 128 --batch-size 4096" in ranks
    assert "--device-memory-gb" not in ranks  # the plan's flags, not the job's


def test_a_job_that_does_not_fit_gets_a_layout_that_does(capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    code = plan_main(["--world-size", "8", "--nodes", "1", *JOB])
    out = capsys.readouterr().out
    assert code == 1 and "verdict: DOES NOT FIT" in out
    nodes = int(out.split("would fit: ")[1].split(" nodes x 8 ranks")[0])
    cfg = parse_config(TrainConfig, [*JOB, "--plan"], defaults=task_defaults)
    for n, fits in ((nodes - 1, False), (nodes, True)):
        plan = plan_for_config(cfg, world_size=8 * n, ranks_per_node=8, detect=False)
        assert plan.fits == fits, (n, plan.refusals)
    assert plan_main(["--world-size", str(8 * nodes), "--nodes", str(nodes), *JOB]) == 0


def test_a_single_node_job_gets_local_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_main(["--world-size", "2", "--local-optimizer", "--num-rows", "1000"]) == 0
    out = capsys.readouterr().out
    assert "its shard server:" not in out and "--ps" not in out
    assert "hybridps-run --standalone --nproc_per_node 2" in out
    assert "worker/main.py --local-optimizer --num-rows 1000" in out


@pytest.mark.parametrize(("args", "message"), [
    (["--world-size", "7", "--nodes", "2"], "--world-size 7 does not split evenly over --nodes 2"),
    (["--world-size", "8", "--nodes", "2", "--ranks-per-node", "2"],
     "--world-size 8 is not --nodes 2 x --ranks-per-node 2"),
    (["--nodes", "2"], "give --world-size N"),
])
def test_a_layout_that_cannot_be_is_refused_with_one_line(
        args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        plan_main(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.e2e
def test_main_plan_needs_no_server_and_the_module_no_torch() -> None:
    proc = _run("--plan", "--num-rows", "1000000", "--dim", "16", "--device", "cpu",
                "--host-memory-gb", "64")
    assert proc.returncode == 0, proc.stderr
    assert "verdict: fits" in proc.stdout
    code = "import sys, worker.plan; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert out.strip() == "False"


def test_a_kge_1vsall_plan_pushes_every_owned_entity_row(tmp_path: Path) -> None:
    """KGE 1vsAll scores every entity: each rank pushes all its entity rows every step,
    far more than its batch's lookups; the plan sizes the wire and the answer cache by it."""
    from worker.tasks.kge.hierarchy import write_hierarchy

    graph = tmp_path / "graph"
    write_hierarchy(graph, 2000, seed=1)
    plans = {}
    for training in ("1vsall", "negsample"):
        cfg = parse_config(TrainConfig, ["--task", "kge", "--data-dir", str(graph),
                                         "--training", training, "--batch-size", "16",
                                         "--neg-ratio", "4", "--plan"],
                           defaults=task_defaults)
        plans[training] = plan_for_config(cfg, world_size=2, ranks_per_node=2, detect=False)
    full = plans["1vsall"]
    entity = next(t for t in full.tables if t.pushed_per_step is not None)
    assert full.touched_per_step(entity) == full.rows_per_rank(entity) > 16 * 3
    sampled = plans["negsample"]
    negsample_entity = next(t for t in sampled.tables if t.name == entity.name)
    assert sampled.touched_per_step(negsample_entity) < full.touched_per_step(entity)
    assert full.wire_bytes_per_rank_step[0] > sampled.wire_bytes_per_rank_step[0]


def test_plan_prints_each_tables_placement_as_the_worker_places_it() -> None:
    """--sharding and a --tables suffix reach the plan; its placement is the embedding's."""
    from worker.embedding.sharded import ShardedEmbedding
    from worker.tasks import build_task, task_tables

    flags = ["--task", "tables", "--tables", "a:100000,b:500:3:table_wise,c:300:row_wise,d:64",
             "--sharding", "auto", "--local-optimizer", "--dim", "4", "--plan"]
    cfg = parse_config(TrainConfig, flags, defaults=task_defaults)
    plan = plan_for_config(cfg, world_size=2, ranks_per_node=2, detect=False)
    text = format_plan(plan)
    assert "a: 100,000 rows x 4 dim, 1 lookups/sample, row_wise over 2 ranks -> 50,000" in text
    assert "b: 500 rows x 4 dim, 3 lookups/sample, table_wise on rank 0 -> 500 rows/rank" in text
    assert "c: 300 rows x 4 dim, 1 lookups/sample, row_wise over 2 ranks -> 150" in text
    assert "d: 64 rows x 4 dim, 1 lookups/sample, table_wise on rank 1 -> 64" in text
    emb = ShardedEmbedding(task_tables(build_task(cfg)), rank=0, world_size=2,
                           sharding=cfg.run.sharding)
    placed = emb.describe()["sharding"]
    assert isinstance(placed, dict)
    assert {n: (s["scheme"], s["ranks"]) for n, s in placed.items()} == {
        "a": ("row_wise", [0, 1]), "b": ("table_wise", [0]), "c": ("row_wise", [0, 1]),
        "d": ("table_wise", [1])}


def test_the_device_total_is_the_busiest_ranks_not_each_tables_largest_share() -> None:
    """Two tables placed whole on different ranks: each rank holds one of them, so a rank
    needs the larger table's bytes, not the two tables' sum."""
    flags = ["--task", "tables", "--tables", "a:1000:1:table_wise,b:600:1:table_wise",
             "--local-optimizer", "--dim", "8", "--plan"]
    cfg = parse_config(TrainConfig, flags, defaults=task_defaults)
    plan = plan_for_config(cfg, world_size=2, ranks_per_node=2, detect=False)
    ranks = {t.name: [r for r in range(2) if plan.rank_rows(t, r)] for t in plan.tables}
    assert sorted(ranks.values()) == [[0], [1]], ranks  # one table on each rank
    row_bytes = 8 * plan.row_bytes
    assert plan.device_rows_bytes == 1000 * row_bytes
    assert plan.device_state_bytes == 1000 * plan.state_floats(plan.tables[0]) * 4
    row_wise = plan_for_config(parse_config(
        TrainConfig, [f.replace(":table_wise", ":row_wise") for f in flags],
        defaults=task_defaults), world_size=2, ranks_per_node=2, detect=False)
    assert row_wise.device_rows_bytes == (500 + 300) * row_bytes


def test_sharding_flag_and_table_suffix_are_checked_once() -> None:
    from typing import get_args

    from worker.config.task_options import SHARDINGS, parse_tables, table_shardings
    from worker.config.train_config import Sharding
    from worker.embedding.sharding import SHARDING_CHOICES

    assert get_args(Sharding) == SHARDINGS == SHARDING_CHOICES
    with pytest.raises(ValueError, match="sharding='colwise'"):
        TrainConfig.of(local_optimizer=True, sharding="colwise")
    assert TrainConfig.of(local_optimizer=True, sharding="auto").run.sharding == "auto"
    spec = "a:10,b:5:3:table_wise,c:7:auto:dynamic:lru,d:4:row_wise"
    assert [(n, r, p) for n, r, p, _ in parse_tables(spec)] == [
        ("a", 10, 1), ("b", 5, 3), ("c", 7, 1), ("d", 4, 1)]
    assert table_shardings(spec) == {"b": "table_wise", "c": "auto", "d": "row_wise"}
    with pytest.raises(ValueError, match=r"'a:10:colwise'.*SCHEME"):
        parse_tables("a:10:colwise")
