"""Sizing plan (worker/plan.py): the per-row arithmetic, docs/deploy.md's worked example,
and `worker/main.py --plan` / the refusal of a config that cannot fit, before allocating."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO
from worker.plan import Plan, TableShape, format_plan
from worker.plan import main as plan_main

MAIN = str(REPO / "worker" / "main.py")


def example(optimizer: str = "adam") -> Plan:
    """docs/deploy.md: one 1e9-row, 128-dim table on 8 nodes x 8 GPUs."""
    return Plan([TableShape("table", 10**9, 128)], world_size=64, ranks_per_node=8,
                batch_size=4096, optimizer=optimizer, staleness=1, local_optimizer=False)


def test_bytes_per_row() -> None:
    plan = example()
    t = plan.tables[0]
    assert plan.rows_per_rank(t) == 15_625_000
    assert plan.device_rows_bytes == 15_625_000 * 128 * 4 == 8_000_000_000
    assert plan.host_state_bytes_per_rank == 15_625_000 * (128 * 8 + 1)
    assert plan.host_bytes_per_server >= 8 * 15_625_000 * 1025 == 128_125_000_000
    assert plan.wire_bytes_per_rank_step == (4096 * (8 + 512), 4096 * (8 + 512))
    sgd = example("sgd")
    assert sgd.host_state_bytes_per_rank == 15_625_000  # the touched flag only
    local = Plan([TableShape("t", 1000, 4)], 1, 1, 10, "adam", 0, local_optimizer=True)
    assert local.device_state_bytes == 1000 * 4 * 4 * 2 and local.host_bytes_per_server == 0


def test_refusals_name_the_numbers() -> None:
    plan = example()
    plan.device_capacity, plan.host_capacity = 80 * 10**9, 512 * 10**9
    assert plan.fits
    plan.device_capacity, plan.host_capacity = 4 * 10**9, 100 * 10**9
    text = " ".join(plan.refusals)
    assert "each rank needs 8.015 GB" in text and "a device has 4.000 GB" in text
    assert "shard server needs 128.261 GB" in text and "a node has 100.000 GB" in text
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
