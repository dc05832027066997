"""The KGE trainer's settings (a section of TrainConfig, `cfg.kge_train`) and the recipes
(`--preset NAME`).

Torch-free: checked while flags are parsed. Every field is a flag (`--reg n3`,
`--reg-weight 0.05`, ...) and a HYBRIDPS_* variable like any setting; presets are defaults
for any setting, applied before TrainConfig is built (worker/config/task_defaults.py): a flag or
variable still wins. What each does and the search behind the presets: docs/kge.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from hybridps.cli import check_settings, setting

KgeLoss = Literal["", "bce", "ce"]
KgeReg = Literal["none", "l2", "n3"]
KgeOnCollapse = Literal["stop", "warn"]


@dataclass(frozen=True)
class KGEOptions:
    """Loss, regularisation, dropout, lr schedule, evaluation and early stopping of --task kge
    (worker/tasks/kge/task.py, schedule.py)."""

    preset: str = setting(
        "", "a recipe: defaults for the flags not given, e.g. fb15k237-complex (PRESETS in "
        "worker/config/kge_options.py, docs/kge.md)", "NAME")
    loss: KgeLoss = setting(
        "", "bce | ce (softmax cross-entropy over all entities); empty: ce for 1vsall, bce "
        "for kvsall and negsample")
    label_smoothing: float = setting(
        0.0, "bce over all entities: targets (1 - ls) * y + ls / num_entities", "LS",
        at_least=0)
    reg: KgeReg = setting(
        "none", "penalty on the embeddings a batch uses (h, r and t of each example; KvsAll "
        "examples have no t), once per occurrence, i.e. weighted by frequency (Lacroix et al. "
        "2018), divided by the batch size; n3: |x|^3 of the modulus of each complex (ComplEx) "
        "/ quaternion (QMult) coordinate")
    reg_weight: float = setting(0.0, "weight of the entity penalty (--reg)", "W", at_least=0)
    rel_reg_weight: float = setting(
        -1.0, "weight of the relation penalty (negative: --reg-weight)", "W")
    entity_dropout: float = setting(
        0.0, "dropout on the entity rows a step uses (heads and the scored entity rows)", "P",
        at_least=0)
    relation_dropout: float = setting(
        0.0, "dropout on the relation rows a step uses", "P", at_least=0)
    warmup_epochs: float = setting(
        0.0, "linear lr warm-up over this many epochs (rows' and dense lr alike)", "E",
        at_least=0)
    plateau_factor: float = setting(
        0.0, "reduce-on-plateau on valid MRR: multiply the lr by this when valid MRR has not "
        "improved for more than --plateau-patience evaluations (0: off)", "F", at_least=0)
    plateau_patience: int = setting(
        2, "evaluations without improvement before the lr is reduced", "N", at_least=0)
    min_lr_scale: float = setting(
        0.0, "the plateau schedule never scales the lr below this", "S", at_least=0)
    early_stop_patience: int = setting(
        0, "stop after this many evaluations without a better valid MRR (0: never)", "N",
        at_least=0)
    eval_every_epochs: int = setting(
        0, "evaluate valid MRR every N epochs (0: auto, the fewest epochs that keep the "
        "evaluation's estimated cost within --eval-budget of training)", "N", at_least=0)
    eval_budget: float = setting(
        0.1, "--eval-every-epochs 0: target evaluation cost as a fraction of training", "F")
    eval_test: bool = setting(
        True, "evaluate test at the end (false while tuning: only valid is ever computed)")
    on_collapse: KgeOnCollapse = setting(
        "stop", "when the scores have collapsed to uniform (training loss at its value for "
        "uniform scores and valid MRR at chance, two evaluations in a row after the first "
        "epoch; worker/tasks/kge/collapse.py): stop (and still evaluate and write the "
        "results) | warn (one line, and go on)")
    keep_best: bool = setting(
        True, "end with the rows and dense weights of the evaluation with the best valid MRR "
        "(one in-memory copy of each rank's part of the model)")
    planted_community: int = setting(
        8, "--task kge_planted: entities per community (the MRR ceiling is H_S / S)", "S",
        at_least=1)
    planted_relations: int = setting(
        16, "--task kge_planted: relations (each maps a community to another)", "R",
        at_least=1)
    planted_test: int = setting(
        1000, "--task kge_planted: test triples (ranked in both directions, unfiltered)", "N",
        at_least=1)

    def __post_init__(self) -> None:
        check_settings(self)
        for name in ("label_smoothing", "entity_dropout", "relation_dropout", "min_lr_scale",
                     "plateau_factor"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value < 1.0):
                raise ValueError(f"{name}={value!r} must be in [0, 1)")
        for name in ("reg_weight", "warmup_epochs", "rel_reg_weight"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)!r} must be finite")
        if not (math.isfinite(self.eval_budget) and self.eval_budget > 0.0):
            raise ValueError(f"eval_budget={self.eval_budget!r} must be > 0")
        if self.preset and self.preset not in PRESETS:
            raise ValueError(f"preset={self.preset!r} is not one of {', '.join(sorted(PRESETS))}")

    @property
    def relation_reg_weight(self) -> float:
        return self.reg_weight if self.rel_reg_weight < 0 else self.rel_reg_weight

    def loss_for(self, training: str) -> str:
        return self.loss or ("ce" if training == "1vsall" else "bce")


# Recipes: defaults for any setting (a flag or HYBRIDPS_* variable still wins). The search
# that chose them, on valid MRR only, is logged in docs/kge.md.
FAMILY = {"task": "kge", "model": "complex", "training": "1vsall", "dim": 256, "batch_size": 256,
          "lr": 0.01, "dense_lr": 0.01, "init_std": 0.1, "loss": "ce", "reg": "n3",
          "reg_weight": 0.05, "plateau_factor": 0.5, "plateau_patience": 1,
          "early_stop_patience": 4}
PRESETS: dict[str, dict[str, Any]] = {
    # 1vsAll + softmax CE + N3, ComplEx with 128 complex dims; batch per rank: 2 ranks x 256
    # = the global batch of 512 the search used (a world of one: --batch-size 512)
    "fb15k237-complex": {**FAMILY, "epochs": 20},
    # the same family on the small dense sets (not tuned on them: docs/kge.md)
    "umls-complex": {**FAMILY, "epochs": 100, "batch_size": 128},
    "kinship-complex": {**FAMILY, "epochs": 100, "batch_size": 128},
}


def preset_defaults(name: str) -> dict[str, Any]:
    if name not in PRESETS:
        raise ValueError(f"preset={name!r} is not one of {', '.join(sorted(PRESETS))}")
    return dict(PRESETS[name])
