"""The KGE trainer's controls (worker/tasks/kge/schedule.py, worker/config/kge_options.py):
warm-up and reduce-on-plateau lr, evaluation by epochs, early stopping, the best model kept;
and end to end: with a schedule, 2 ranks on a shard server equal 2 ranks with
--local-optimizer bitwise (the lr reaches the server with each push, Push.lr)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from hybridps.cli import parse_config
from tests.testing.helpers import PsServer
from tests.worker.checkpoint.test_checkpoint import assert_states, run
from tests.worker.tasks.kge.test_kge_task import write_graph
from worker.config.kge_options import KGEOptions
from worker.config.task_defaults import config_with_task_defaults
from worker.config.train_config import TrainConfig
from worker.runtime.dist import DistContext
from worker.tasks.kge.schedule import KGEHooks, auto_eval_every


def hooks(options: KGEOptions, model: nn.Module | None = None, *, per_epoch: int = 10,
          total: int = 100, every: int = 1) -> KGEHooks:
    return KGEHooks(options, model or nn.Linear(2, 2), steps_per_epoch=per_epoch,
                    total_steps=total, eval_every_epochs=every)


def test_warmup_is_linear_then_flat() -> None:
    h = hooks(KGEOptions(warmup_epochs=0.5))  # 5 steps
    assert [h.lr_scale(s) for s in range(7)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1, 1, 1])
    assert hooks(KGEOptions()).lr_scale(0) == 1.0


def test_plateau_cuts_after_patience_like_torch() -> None:
    h = hooks(KGEOptions(plateau_factor=0.5, plateau_patience=1))
    param = nn.Parameter(torch.zeros(1))
    ref_opt = torch.optim.SGD([param], lr=1.0)
    ref = torch.optim.lr_scheduler.ReduceLROnPlateau(ref_opt, mode="max", factor=0.5,
                                                     patience=1)
    for step, mrr in enumerate([0.1, 0.2, 0.2, 0.2, 0.19, 0.3, 0.3, 0.3, 0.3]):
        h.after_eval(step, {"valid_mrr": mrr})
        ref.step(mrr)
        assert h.lr_scale(step + 1) == pytest.approx(ref_opt.param_groups[0]["lr"]), step
    assert h.cuts == 2


def test_min_lr_scale_bounds_the_cuts() -> None:
    h = hooks(KGEOptions(plateau_factor=0.1, plateau_patience=0, min_lr_scale=0.05))
    for step in range(4):
        h.after_eval(step, {"valid_mrr": 0.1})
    assert h.lr_scale(10) == pytest.approx(0.05)


def test_early_stopping_after_patience_evaluations_without_improvement() -> None:
    h = hooks(KGEOptions(early_stop_patience=2))
    assert not h.after_eval(9, {"valid_mrr": 0.3})
    assert not h.after_eval(19, {"valid_mrr": 0.29})
    assert h.after_eval(29, {"valid_mrr": 0.3})  # not better than 0.3 * (1 + 1e-4)
    assert h.stopped_early and h.describe()["best_step"] == 9


def test_keep_best_restores_the_best_evaluated_parameters() -> None:
    model = nn.Linear(3, 2)
    h = hooks(KGEOptions(keep_best=True), model)
    with torch.no_grad():
        model.weight.fill_(1.0)
    h.after_eval(9, {"valid_mrr": 0.5})
    with torch.no_grad():
        model.weight.fill_(2.0)
    h.after_eval(19, {"valid_mrr": 0.4})
    h.finish()
    assert torch.equal(model.weight, torch.ones(2, 3)) and h.restored_best
    off = nn.Linear(3, 2)
    h2 = hooks(KGEOptions(keep_best=False), off)
    h2.after_eval(9, {"valid_mrr": 0.5})
    with torch.no_grad():
        off.weight.fill_(2.0)
    h2.after_eval(19, {"valid_mrr": 0.4})
    h2.finish()
    assert torch.equal(off.weight, torch.full((2, 3), 2.0)) and not h2.restored_best


def test_eval_due_by_epochs_and_at_the_end() -> None:
    h = hooks(KGEOptions(), per_epoch=4, total=18, every=2)
    assert [s for s in range(18) if h.eval_due(s)] == [7, 15, 17]
    assert not any(hooks(KGEOptions(), every=0).eval_due(s) for s in range(100))


def test_auto_eval_interval_keeps_the_estimated_cost_within_budget() -> None:
    opts = KGEOptions()
    # FB15k-237-like: 17.5k valid triples, 150k KvsAll examples, 14.5k entities
    every = auto_eval_every(opts, training="kvsall", valid_triples=17535, examples=149689,
                            num_entities=14541, neg_ratio=8)
    assert every == 1  # 35k queries vs 3 x 150k: ~8% of an epoch
    neg = auto_eval_every(opts, training="negsample", valid_triples=17535, examples=544230,
                          num_entities=14541, neg_ratio=8)
    assert neg > 100  # negative sampling is cheap per example: evaluating costs epochs
    assert auto_eval_every(KGEOptions(eval_every_epochs=3), training="kvsall",
                           valid_triples=1, examples=1, num_entities=1, neg_ratio=1) == 3


@pytest.mark.parametrize(("argv", "named"), [
    (["--loss", "mse"], "loss='mse'"), (["--reg", "n4"], "reg='n4'"),
    (["--entity-dropout", "1.5"], "entity_dropout=1.5"),
    (["--plateau-factor", "2"], "plateau_factor=2.0"),
    (["--early-stop-patience", "x"], "early-stop-patience='x'"),
    (["--preset", "nope"], "preset='nope'"), (["--eval-budget", "0"], "eval_budget=0.0"),
])
def test_bad_kge_settings_fail_fast_naming_the_value(argv: list[str], named: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_config(TrainConfig, ["--local-optimizer", *argv], environ={})
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


def test_preset_fills_defaults_and_flags_win() -> None:
    from worker.config.task_defaults import task_defaults

    d = task_defaults({"preset": "fb15k237-complex"})
    assert d["task"] == "kge" and d["model"] == "complex" and d["reg"] == "n3"
    assert task_defaults({"preset": "fb15k237-complex", "task": "kge"})["dim"] == d["dim"]
    cfg = config_with_task_defaults(preset="fb15k237-complex", data_dir="d", reg_weight=0.5,
                                    local_optimizer=True)
    assert cfg.kge_train.reg == "n3" and cfg.kge_train.reg_weight == 0.5
    assert cfg.run.dim == d["dim"] and cfg.kge.model == "complex"


FLAT = ["--loss", "ce", "--reg", "n3", "--reg-weight", "0.01", "--eval-every-epochs", "1"]
SCHEDULE = [*FLAT, "--warmup-epochs", "1.5", "--plateau-factor", "0.5", "--plateau-patience",
            "0"]


def kge_args(graph: Path, kge: list[str]) -> list[str]:
    return ["--task", "kge", "--data-dir", str(graph), "--model", "complex", "--dim", "8",
            "--training", "1vsall", "--epochs", "4", "--lr", "0.05", "--dense-lr", "0.05",
            "--staleness", "1", *kge]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_schedule_server_equals_local_optimizer_bitwise(server: PsServer,
                                                         tmp_path: Path) -> None:
    graph = write_graph(tmp_path / "graph")

    def dump(tag: str, args: list[str]) -> Path:
        out = tmp_path / f"{tag}.pt"
        run([*args, "--dump-state", str(out), "--results", str(tmp_path / f"{tag}.json")])
        return out

    on_server = dump("server", [*kge_args(graph, SCHEDULE), "--ps", server.address,
                                "--run-id", "kge-schedule"])
    local = dump("local", [*kge_args(graph, SCHEDULE), "--local-optimizer"])
    assert_states(on_server, local, exact=True)
    inline = dump("inline", [*kge_args(graph, SCHEDULE), "--ps", server.address,
                             "--same-node", "off", "--run-id", "kge-schedule-inline"])
    # (--same-node off: Push.lr travels in the gRPC messages, not the shared-memory batch)
    assert_states(inline, local, exact=True)
    flat = dump("flat", [*kge_args(graph, FLAT), "--local-optimizer"])
    with pytest.raises(AssertionError, match="differs"):  # the schedule changed the run
        assert_states(local, flat, exact=True)
    res = json.loads((tmp_path / "server.json").read_text())
    assert res["hooks"]["evaluations"] == len(res["eval_curve"]) == 4
    assert res["hooks"]["best_valid_mrr"] == max(m["valid_mrr"] for _, m in res["eval_curve"])
    assert res["eval_time_s"] > 0 and res["eval_fraction"] > 0


@pytest.mark.timeout(120)
def test_an_early_stop_is_told_with_one_step_numbering(
        world_of_one: DistContext, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Early stopping with the best model restored, in one process: the bar ends full at
    the stop, saying so; the summary names the step it stopped after, the best step and the
    optimizer, in lines that fit 80 columns; the plot's best step and the export's step are
    that same best step (numbered from 0, as the logs and checkpoints number steps)."""
    from worker.export import main as export_main
    from worker.report.plot import build_figure, end_step
    from worker.train.trainer import Trainer

    monkeypatch.setenv("COLUMNS", "80")
    graph = write_graph(tmp_path / "graph")
    dump, results = tmp_path / "run.pt", tmp_path / "run.json"
    cfg = config_with_task_defaults(
        task="kge", data_dir=str(graph), model="distmult", dim=8, training="1vsall",
        local_optimizer=True, staleness=0, batch_size=16, epochs=12, lr=0.1, dense_lr=0.1,
        eval_every=0, eval_every_epochs=1, early_stop_patience=2, log_every=2,
        progress=True, dump_state=str(dump), results=str(results))
    trainer = Trainer(cfg, world_of_one)
    try:
        trainer.train()
        res = trainer.report()
    finally:
        trainer.close()
    out = capsys.readouterr()
    assert res is not None
    steps, last, hooks_ = res["steps"], res["last_step"], res["hooks"]
    best = hooks_["best_step"]
    assert hooks_["stopped_early"] and hooks_["restored_best"], hooks_
    assert 0 <= best < last < steps - 1
    bar = out.err.replace("\r", "\n").splitlines()
    assert any(line.startswith(f"train (stopped early; {steps} planned): 100%|")
               and f"| {last + 1}/{last + 1} " in line for line in bar), bar[-3:]
    lines_out = out.out.splitlines()
    summary = lines_out[:next(i for i, line in enumerate(lines_out) if line.startswith("wrote"))]
    assert (f"stopped early after step {last} ({last + 1} of {steps} steps; best step "
            f"{best}, restored)") in summary, summary
    assert f"steps {steps}" not in out.out
    assert "optimizer adam lr 0.1  dense adam lr 0.1" in summary
    # a word wider than the line (a path) stands whole on a line of its own
    too_wide = [line for line in lines_out if len(line) > 80 and " " in line.strip()]
    assert not too_wide, too_wide
    star = f"best valid mrr {hooks_['best_valid_mrr']:.4f} at step {best}: restored at the end"
    lines = {line.get_label(): line for line in build_figure(res).axes[1].get_lines()}
    assert np.asarray(lines[star].get_xdata()).tolist() == [best] and end_step(res) == last
    assert export_main(["--state", str(dump), "--kge-results", str(results),
                        "--out", str(tmp_path / "model.pt")]) == 0
    assert capsys.readouterr().out.startswith(f"exported step {best} (best): distmult ")
