"""`--task tables --zipf-rows N`: the same distinct ids a step at any table size."""

from __future__ import annotations

import torch

from hybridps.cli import parse_config
from worker.config.train_config import TrainConfig
from worker.tasks import build_task
from worker.tasks.base import Task


def _task(*argv: str) -> Task:
    cfg = parse_config(TrainConfig, ["--local-optimizer", "--task", "tables",
                                     "--batch-size", "512", *argv], environ={})
    return build_task(cfg)


def _distinct(task: Task, steps: int) -> list[int]:
    return [int(task.global_batch(s, 2).ids["t0"].unique().numel()) for s in range(steps)]


def test_zipf_rows_holds_distinct_ids_while_the_table_grows() -> None:
    small = _task("--num-rows", "10000", "--zipf-rows", "10000")
    big = _task("--num-rows", "5000000", "--zipf-rows", "10000")
    whole = _task("--num-rows", "5000000")
    assert _distinct(big, 5) == _distinct(small, 5)
    # over the whole big table the same law touches more distinct rows: what --zipf-rows
    # takes out of the growth benchmark
    assert sum(_distinct(whole, 5)) > sum(_distinct(small, 5))
    ids = torch.cat([big.global_batch(s, 2).ids["t0"] for s in range(5)])
    assert int(ids.min()) >= 0 and int(ids.max()) < 5_000_000
    # still spread over the whole table, not packed into its first 10k rows
    assert int((ids >= 10_000).sum()) > ids.numel() // 2


def test_zipf_rows_above_the_table_is_the_whole_table() -> None:
    assert _distinct(_task("--num-rows", "10000", "--zipf-rows", "10000000"), 3) \
        == _distinct(_task("--num-rows", "10000"), 3)


def test_zipf_s_zero_draws_uniform_ids() -> None:
    """A subclass's `zipf_s = 0` (bench/bench_memory_tier.py's worst case): every row about
    equally often, where the task's Zipf 1.1 puts a large share on its most popular row."""
    zipf = _task("--num-rows", "1000")
    uniform = _task("--num-rows", "1000")
    uniform.zipf_s = 0.0  # type: ignore[attr-defined]

    def counts(task: Task) -> torch.Tensor:
        ids = torch.cat([task.global_batch(s, 2).ids["t0"] for s in range(20)])
        return torch.bincount(ids, minlength=1000)

    flat, skewed = counts(uniform), counts(zipf)  # 20,480 ids over 1,000 rows
    assert int((flat > 0).sum()) == 1000 and int(flat.max()) < 3 * 20
    assert int(skewed.max()) > 20 * int(flat.max())
