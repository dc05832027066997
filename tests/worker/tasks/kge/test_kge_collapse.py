"""A KGE run collapsing to uniform scores (worker/tasks/kge/collapse.py): why (N3 at a weight
>= 1/3 makes the all-zero model the optimum of ComplEx's objective), when it is called
collapsed, and a real run forced to collapse that stops after its second epoch with one line
saying what to change, while the same run at the preset's weight does not."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.worker.checkpoint.test_checkpoint import run
from worker.config.kge_options import KGEOptions
from worker.tasks.kge.collapse import (
    CollapseCheck,
    chance_mrr,
    effective_n3_weight,
    uniform_loss,
    what_to_change,
    zero_model_is_optimal,
)
from worker.tasks.kge.hierarchy import write_hierarchy
from worker.tasks.kge.models import build_model
from worker.tasks.kge.schedule import KGEHooks


def test_chance_mrr_is_the_harmonic_mean_rank() -> None:
    assert chance_mrr(1) == 1.0 and chance_mrr(2) == pytest.approx(0.75)
    exact = sum(1.0 / k for k in range(1, 20_001)) / 20_000
    assert chance_mrr(20_000) == pytest.approx(exact, rel=1e-9)


def test_uniform_loss_of_each_softmax() -> None:
    assert uniform_loss("1vsall", "ce", 1000, 8) == pytest.approx(math.log(1000))
    assert uniform_loss("kvsall", "ce", 1000, 8) == pytest.approx(math.log(1000))
    assert uniform_loss("negsample", "ce", 1000, 63) == pytest.approx(math.log(64))
    assert uniform_loss("kvsall", "bce", 1000, 8) is None


def test_the_zero_model_is_optimal_from_an_n3_weight_of_one_third() -> None:
    assert not zero_model_is_optimal(KGEOptions(reg="n3", reg_weight=0.33), "complex")
    assert zero_model_is_optimal(KGEOptions(reg="n3", reg_weight=0.34), "ComplEx")
    assert zero_model_is_optimal(KGEOptions(reg="n3", reg_weight=0.5), "distmult")
    # the geometric mean of the weights on |h|^3, |r|^3, |t|^3
    light_relations = KGEOptions(reg="n3", reg_weight=0.5, rel_reg_weight=0.1)
    assert effective_n3_weight(light_relations) == pytest.approx((0.5 * 0.5 * 0.1) ** (1 / 3))
    assert not zero_model_is_optimal(light_relations, "complex")
    assert not zero_model_is_optimal(KGEOptions(reg="l2", reg_weight=0.5), "complex")
    assert not zero_model_is_optimal(KGEOptions(reg="n3", reg_weight=0.5), "qmult")
    advice = what_to_change(KGEOptions(reg="n3", reg_weight=0.5), "complex", 0.003)
    assert "--reg-weight 0.5" in advice and "use 0.05 (the presets) to 0.1" in advice
    assert "now 0.3; the presets use 0.05" in what_to_change(
        KGEOptions(reg="n3", reg_weight=0.3), "complex", 0.01)


def _fit(weight: float, steps: int = 120) -> tuple[float, float]:
    """Full-batch Adam on the exact 1vsAll objective (softmax CE + per-occurrence N3, as
    worker/tasks/kge/task.py) of a small random graph, from a good start: (loss, mean |row|)."""
    gen = torch.Generator().manual_seed(0)
    entities, relations, dim = 30, 3, 16
    triples = torch.randint(0, entities, (200, 3), generator=gen)
    triples[:, 1] %= relations
    scorer = build_model("complex", relations, dim)
    rows = torch.nn.Parameter(torch.randn(entities, dim, generator=gen) * 0.5)
    with torch.no_grad():
        scorer.relation.weight.normal_(0.0, 0.5, generator=gen)
    opt = torch.optim.Adam([rows, *scorer.parameters()], lr=0.02)
    h, r, t = triples[:, 0], triples[:, 1], triples[:, 2]
    for _ in range(steps):
        q, _ = scorer.query(rows[h], r)
        ce = F.cross_entropy(q @ rows.t(), t)
        cubes = (scorer.squared_moduli(rows[h]).pow(1.5).sum()
                 + scorer.squared_moduli(scorer.relation(r)).pow(1.5).sum()
                 + scorer.squared_moduli(rows[t]).pow(1.5).sum())
        loss = ce + weight * cubes / len(triples)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(ce.detach()), float(rows.detach().abs().mean())


def test_n3_above_one_third_drives_complex_to_uniform_scores() -> None:
    """The module doc's bound, on the objective itself: at 0.5 the rows go to ~0 and the
    CE to ln(E); at the preset's 0.05 the same start fits the graph."""
    ce_strong, size_strong = _fit(0.5)
    ce_light, size_light = _fit(0.05)
    assert ce_strong == pytest.approx(math.log(30), abs=0.02) and size_strong < 0.05
    assert ce_light < math.log(30) - 1.0 and size_light > 0.1


def test_collapse_needs_two_evaluations_in_a_row_after_the_first_epoch() -> None:
    check = CollapseCheck(num_entities=20_000, uniform=math.log(20_000), advice="do X")
    flat = math.log(20_000)
    assert check.observe(mrr=0.0004, loss=flat, epoch=0.5) is None  # too early
    assert check.observe(mrr=0.0004, loss=flat, epoch=1.0) is None  # one
    assert check.observe(mrr=0.2, loss=flat - 3, epoch=2.0) is None  # learning: reset
    assert check.observe(mrr=0.0004, loss=flat, epoch=3.0) is None
    report = check.observe(mrr=0.0006, loss=flat + 0.001, epoch=4.0)
    assert report is not None
    assert report["valid_mrr"] == "0.0006" and report["change"] == "do X"
    assert report["uniform_loss"] == f"{flat:.4f}"
    # a ranking far above chance is never called collapsed, whatever the loss
    good = CollapseCheck(num_entities=20_000, uniform=flat, advice="")
    assert not good.looks_collapsed(0.05, flat)
    # a loss well above ln(E) is confident wrong scores, not uniform ones
    assert not good.looks_collapsed(0.0004, 1.2 * flat)
    assert good.looks_collapsed(0.0004, 0.995 * flat) and good.looks_collapsed(0.0004, 1.005 * flat)
    # bce: valid MRR alone, below 3 x chance (and never at 0.05 or more: tiny graphs)
    bce = CollapseCheck(num_entities=20_000, uniform=None, advice="")
    assert bce.looks_collapsed(2 * chance_mrr(20_000), None)
    assert not bce.looks_collapsed(4 * chance_mrr(20_000), None)
    assert not CollapseCheck(num_entities=23, uniform=None, advice="").looks_collapsed(0.2, None)


def test_hooks_stop_on_collapse_and_say_so(caplog: pytest.LogCaptureFixture) -> None:
    check = CollapseCheck(num_entities=1000, uniform=math.log(1000), advice="lower it")
    h = KGEHooks(KGEOptions(), torch.nn.Linear(2, 2), steps_per_epoch=10, total_steps=100,
                 eval_every_epochs=1, collapse=check)
    h.observe_loss(9, math.log(1000))
    assert not h.after_eval(9, {"valid_mrr": 0.003})
    h.observe_loss(19, math.log(1000))
    with caplog.at_level("WARNING", logger="worker.kge"):
        assert h.after_eval(19, {"valid_mrr": 0.002})
    lines = [r.getMessage() for r in caplog.records if "event=collapse" in r.getMessage()]
    assert len(lines) == 1 and 'change="lower it"' in lines[0]
    assert h.describe()["collapsed"] is True and h.stopped_early
    # --on-collapse warn: the same line, and training goes on
    warn = KGEHooks(KGEOptions(on_collapse="warn"), torch.nn.Linear(2, 2), steps_per_epoch=10,
                    total_steps=100, eval_every_epochs=1,
                    collapse=CollapseCheck(num_entities=1000, uniform=math.log(1000),
                                           advice="lower it"))
    for step in (9, 19, 29):
        warn.observe_loss(step, math.log(1000))
        assert not warn.after_eval(step, {"valid_mrr": 0.002})
    assert warn.describe()["collapsed"] is True and not warn.stopped_early


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_run_forced_to_collapse_stops_after_two_epochs_with_one_line(tmp_path: Path) -> None:
    graph = tmp_path / "graph"
    write_hierarchy(graph, 600, seed=1)
    common = ["--task", "kge", "--data-dir", str(graph), "--training", "1vsall",
              "--model", "complex", "--dim", "16", "--epochs", "8", "--lr", "0.01",
              "--dense-lr", "0.01", "--init-std", "0.1", "--reg", "n3",
              "--eval-every-epochs", "1", "--local-optimizer", "--log-every", "2",
              "--batch-size", "128"]
    out = tmp_path / "collapsed.json"
    proc = run([*common, "--reg-weight", "5", "--results", str(out)], nproc=1)
    res = json.loads(out.read_text())
    per_epoch = res["steps"] // 8
    # Stopped at an evaluation, early: the second one in a row that looked collapsed. On
    # this graph the loss after epoch 1 sits near the check's 1% margin above ln(E)
    # (Adam's steps around zero), so epoch 2 or 3 (the hooks' unit test pins the count).
    stopped_after = (res["last_step"] + 1) / per_epoch
    assert res["hooks"]["collapsed"] and stopped_after in (2, 3), res["last_step"]
    lines = [x for x in proc.stderr.splitlines() if "event=collapse" in x]
    assert len(lines) == 1 and "--reg-weight 5 makes the all-zero model" in lines[0]
    assert "event=kge_penalty" in proc.stderr  # said at the start already
    assert res["eval"]["test_mrr"] < 3 * chance_mrr(res["task"]["entities"])
    healthy = tmp_path / "healthy.json"
    proc = run([*common, "--reg-weight", "0.05", "--epochs", "3", "--results", str(healthy)],
               nproc=1)
    res = json.loads(healthy.read_text())
    assert not res["hooks"]["collapsed"] and "event=collapse" not in proc.stderr
    assert res["eval"]["valid_mrr"] > 10 * chance_mrr(res["task"]["entities"])
