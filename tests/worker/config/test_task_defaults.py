"""Per-task defaults (worker/config/task_defaults.py): flag > env > task default >
TrainConfig default, and the fail-fast checks of the kge / dlrm flags."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hybridps.cli import parse_config
from worker.config.task_defaults import TASK_DEFAULTS, config_with_task_defaults, task_defaults
from worker.config.train_config import TrainConfig

BASE = ["--local-optimizer"]
REPO = Path(__file__).resolve().parents[3]


def parse(*argv: str, environ: dict[str, str] | None = None) -> TrainConfig:
    return parse_config(TrainConfig, [*BASE, *argv], environ=environ or {},
                        defaults=task_defaults)


def test_kge_defaults_are_the_dicee_settings() -> None:
    cfg = parse("--task", "kge", "--data-dir", "/d")
    assert (cfg.optim.lr, cfg.optim.dense_lr, cfg.optim.init_std, cfg.run.batch_size,
            cfg.run.epochs, cfg.run.dim) == (0.1, 0.1, 1.0, 512, 100, 32)
    assert cfg.kge.model == "distmult" and cfg.kge.training == "kvsall"
    # valid MRR by epochs within --eval-budget (worker/tasks/kge/schedule.py), not the
    # step-based --eval-every of the other tasks
    assert cfg.output.eval_every == 0 and TrainConfig.of(local_optimizer=True).output.eval_every


def test_flag_and_env_beat_task_defaults() -> None:
    cfg = parse("--task", "kge", "--data-dir", "/d", "--lr", "0.3",
                environ={"HYBRIDPS_DIM": "64"})
    assert cfg.optim.lr == 0.3 and cfg.run.dim == 64 and cfg.optim.dense_lr == 0.1
    # --steps alone means a step-count run: the task's default epochs is not applied
    steps = parse("--task", "kge", "--data-dir", "/d", "--steps", "7")
    assert steps.run.epochs == 0 and steps.run.steps == 7


def test_other_tasks_keep_the_config_defaults() -> None:
    assert parse() == TrainConfig.of(local_optimizer=True)
    assert parse("--task", "x.y:Z").optim.lr == TrainConfig.of(local_optimizer=True).optim.lr
    dlrm = parse("--task", "dlrm")
    assert dlrm.run.steps == TASK_DEFAULTS["dlrm"]["steps"] and dlrm.run.epochs == 0
    assert config_with_task_defaults(task="dlrm", local_optimizer=True) == dlrm


@pytest.mark.parametrize(("argv", "match"), [
    (["--task", "kge"], "needs --data-dir"),
    (["--model", "transe"], "model='transe'"),
    (["--training", "allvsall"], "training='allvsall'"),  # 1vsall became a mode
    (["--neg-ratio", "0"], "neg_ratio=0"),
    (["--table-rows", "10,x"], "table_rows='10,x'"),
    (["--eval-every", "-1"], "eval_every=-1"),
])
def test_bad_task_flags_fail_fast(argv: list[str], match: str,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


@pytest.mark.e2e
def test_parsing_stays_torch_free() -> None:
    """Bad flags fail before torch is imported: the defaults hook must not import it."""
    code = ("import sys; from worker.main import main; from worker.config.task_defaults import "
            "task_defaults; task_defaults({'task': 'kge'}); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
