"""--time-budget (worker/train/time_budget.py): the end's cost comes from the run's measured step
and evaluation times, the ranks agree on the last step at the --log-every steps only, and a
real 2-rank run with a budget far below its planned steps stops early, evaluates and writes
its results within the budget."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hybridps.cli import parse_config
from tests.worker.checkpoint.test_checkpoint import run
from worker.config.train_config import TrainConfig
from worker.tasks.kge.hierarchy import write_hierarchy
from worker.train import time_budget as tb
from worker.train.time_budget import EndCosts, TimeBudget

ONE_RANK: Any = SimpleNamespace(world_size=1, device="cpu")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def budget(monkeypatch: pytest.MonkeyPatch, costs: EndCosts, minutes: float = 1.0,
           every: int = 5) -> tuple[TimeBudget, Clock]:
    clock = Clock()
    monkeypatch.setattr(tb.time, "perf_counter", clock)
    b = TimeBudget(minutes, costs, every=every, started_at=clock.now)
    b.start(0)
    return b, clock


def test_the_end_is_estimated_from_measured_evaluations_scaled_to_the_final_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    costs = EndCosts(final_eval_steps=6.0, quick_eval_steps=2.0, pre_final_eval=True)
    b, _ = budget(monkeypatch, costs, minutes=10.0)
    margin = tb.MARGIN_S + tb.MARGIN_FRACTION * 600.0
    # two evaluations took 8 s: a quick one 4 s, the final (3x the work) 12 s
    assert b.end_estimate_s(step_s=0.5, eval_s=8.0, evals=2) == pytest.approx(
        tb.SAFETY * (12.0 + 4.0) + margin)
    # none timed yet: the task's cost in steps times the measured step
    assert b.end_estimate_s(step_s=0.5, eval_s=0.0, evals=0) == pytest.approx(
        tb.SAFETY * (3.0 + 1.0) + margin)
    dumped = EndCosts(final_eval_steps=0.0, quick_eval_steps=0.0, pre_final_eval=False,
                      dump_bytes=int(tb.DUMP_BYTES_PER_S * 2))
    b2, _ = budget(monkeypatch, dumped, minutes=10.0)
    assert b2.end_estimate_s(step_s=1.0, eval_s=0.0, evals=0) == pytest.approx(
        tb.SAFETY * 2.0 + margin)


def test_training_stops_at_the_last_step_that_leaves_the_reserve(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """1 s a step, a 60 s budget, an end costing 4 steps: the reserve is 1.25 x 4 s plus the
    margins (18 s), so 42 steps fit (42 + 18 <= 60 < 43 + 18); the ranks decide at steps 4,
    9, ... only, the last of them (39) fixing the stop at step 41."""
    costs = EndCosts(final_eval_steps=4.0, quick_eval_steps=1.0, pre_final_eval=False)
    b, clock = budget(monkeypatch, costs, minutes=1.0, every=5)
    reserve = tb.SAFETY * 4 + tb.MARGIN_S + tb.MARGIN_FRACTION * 60
    assert reserve == pytest.approx(18.0)
    decided = []
    monkeypatch.setattr(tb, "_all_reduce_min", lambda fit, ctx: decided.append(fit) or fit)
    stopped = None
    for step in range(1000):
        clock.now += 1.0
        if b.should_stop(step, 0.0, 0, ONE_RANK):
            stopped = step
            break
    assert stopped == 41 and b.stopped_at == 41
    assert len(decided) == 8 and decided[-1] == 2  # at steps 4, 9, ..., 39
    assert b.describe()["reserved_s"] == pytest.approx(reserve)


def test_a_budget_spent_before_training_stops_at_the_first_agreement(
        monkeypatch: pytest.MonkeyPatch) -> None:
    costs = EndCosts(final_eval_steps=1.0, quick_eval_steps=1.0, pre_final_eval=False)
    b, clock = budget(monkeypatch, costs, minutes=0.1, every=3)
    clock.now += 30.0  # setup took longer than the budget
    assert [b.should_stop(s, 0.0, 0, ONE_RANK) for s in range(3)] == [False, False, True]


def test_process_age_is_read_on_linux() -> None:
    age = tb.process_age_s()
    assert age is None or 0.0 <= age < 24 * 3600


@pytest.mark.parametrize("value", ["-1", "nan", "x"])
def test_a_bad_budget_fails_fast_naming_it(value: str, capsys: pytest.CaptureFixture[str]
                                           ) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_config(TrainConfig, ["--local-optimizer", "--time-budget", value], environ={})
    assert exc.value.code == 2 and "time" in capsys.readouterr().err


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_two_rank_kge_run_stops_in_time_and_writes_its_results(tmp_path: Path) -> None:
    graph = tmp_path / "graph"
    write_hierarchy(graph, 400, seed=2)
    results = tmp_path / "run.json"
    minutes = 0.75
    started = time.perf_counter()
    proc = run(["--task", "kge", "--data-dir", str(graph), "--training", "1vsall",
                "--model", "complex", "--dim", "16", "--epochs", "100000", "--lr", "0.01",
                "--dense-lr", "0.01", "--reg", "n3", "--reg-weight", "0.05",
                "--eval-every-epochs", "5", "--local-optimizer", "--log-every", "5",
                "--time-budget", str(minutes), "--results", str(results)],
               nproc=2, timeout=360)
    wall = time.perf_counter() - started
    res = json.loads(results.read_text())
    budget_info = res["time_budget"]
    assert res["last_step"] + 1 < res["steps"]  # stopped long before 100,000 epochs
    assert budget_info["stopped_at_step"] == res["last_step"]
    assert budget_info["elapsed_s"] < minutes * 60  # the results were due within it
    assert wall < minutes * 60 + 20  # torchrun's start to its exit, on a loaded machine
    assert {"valid_mrr", "test_mrr"} <= set(res["eval"]) and results.with_suffix(".png").exists()
    # the stop step was evaluated, so the best model is chosen among every step's
    assert res["eval_curve"][-1][0] == res["last_step"]
    assert "event=time_budget" in proc.stderr and "training stopped after step" in proc.stdout
    print(f"budget {minutes * 60:.0f}s: results at {budget_info['elapsed_s']:.1f}s, "
          f"torchrun wall {wall:.1f}s, steps {res['last_step'] + 1}")
