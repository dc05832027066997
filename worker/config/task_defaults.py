"""Per-task defaults for TrainConfig settings (torch-free: used while parsing flags).

A flag or HYBRIDPS_* variable always wins; then the task's default below; then the
TrainConfig default. Keys are setting names (= flag names), `optimizer` among them (the
rows' optimizer, worker/config/train_config.py). `--task kge` thus trains with dicee's settings
for the small KGE benchmarks (Adam lr 0.1 on entities and relations, N(0, 1) init, global batch
1024 on 2 ranks) and `--task dlrm` with settings that reach the planted model's AUC on the
synthetic generator.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from worker.config.kge_options import preset_defaults

if TYPE_CHECKING:
    from worker.config.train_config import TrainConfig

TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "kge": {
        # Adam: dicee's optimizer, and what the presets were searched with (docs/kge.md);
        # no measurement says the Adagrad kinds would do better here
        "optimizer": "adam",
        "dim": 32, "epochs": 100, "batch_size": 512, "lr": 0.1, "dense_lr": 0.1,
        "init_std": 1.0, "log_every": 5,
        # evaluations by epochs within --eval-budget (KGEHooks); --eval-every N replaces them
        "eval_every": 0,
    },
    "dlrm": {
        "dim": 16, "steps": 1500, "batch_size": 1024, "lr": 0.02, "dense_lr": 3e-3,
        "init_std": 0.05, "log_every": 20, "eval_every": 250, "eval_batches": 16,
        # from files: the Criteo TSV tokens' 64-bit hashes (and raw ids) into --table-rows
        "id_overflow": "hash",
    },
}


def task_defaults(given: Mapping[str, Any]) -> dict[str, Any]:
    """Defaults of the task named in `given` (the fields set by flag or environment).

    `--steps` given alone means a step-count run: the task's default `epochs` is then
    not applied (the run uses --steps only when epochs is 0). `--preset NAME`
    (worker/config/kge_options.py PRESETS) adds its recipe over the task's defaults.
    """
    preset = preset_defaults(str(given["preset"])) if given.get("preset") else {}
    task = str(given.get("task", preset.get("task", "synthetic")))
    defaults = {**TASK_DEFAULTS.get(task, {}), **preset}
    if "steps" in given:
        defaults.pop("epochs", None)
    return defaults


def config_with_task_defaults(**given: Any) -> TrainConfig:
    """TrainConfig.of(**given) with the task's defaults filled in (tests, benchmarks)."""
    from worker.config.train_config import TrainConfig

    return TrainConfig.of(**{**task_defaults(given), **given})
