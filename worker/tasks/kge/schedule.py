"""The KGE trainer's controls: lr warm-up and reduce-on-plateau, evaluation by epochs, early
stopping on valid MRR and the best model kept (a worker.tasks.base.TrainHooks).

Determinism. The lr scale of step t is a function of t and of the valid MRRs of the
evaluations after steps < t: every rank computes the same metrics (they are all-reduced), so
every rank, the shard server (Push.lr), --local-optimizer and the single-process reference
see the same lr at every step, whatever the timing.

    scale(t) = warm(t) * max(plateau_factor ** cuts(t), min_lr_scale)
    warm(t)  = min(1, (t + 1) / warmup_steps)          (1 without warm-up)

Reduce on plateau follows torch.optim.lr_scheduler.ReduceLROnPlateau (mode max, relative
threshold 1e-4, no cool-down): after more than `plateau_patience` evaluations in a row without
a better valid MRR the scale is cut by `plateau_factor`. Early stopping ends training after
`early_stop_patience` evaluations in a row without a better valid MRR. With `keep_best` every
better evaluation snapshots the rows this rank owns and its dense parameters (in memory, one
extra copy of the model) and training ends with them restored, so the final evaluation, the
--dump-state and the export are of the best model on valid.

Evaluation cost. `eval_every_epochs` = 0 picks the fewest epochs between evaluations that keep
the estimated cost of evaluating valid (2 queries per triple, each scored against every
entity) within `eval_budget` of the estimated cost of training (forward + backward, about 3
times the scoring work of each example) : see `auto_eval_every`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from hybridps.logs import kv
from worker.config.kge_options import KGEOptions
from worker.tasks.base import TrainHooks
from worker.tasks.kge.collapse import CollapseCheck

log = logging.getLogger("worker.kge")

PLATEAU_THRESHOLD = 1e-4  # relative, as torch's ReduceLROnPlateau's default


def auto_eval_every(options: KGEOptions, *, training: str, valid_triples: int,
                    examples: int, num_entities: int, neg_ratio: int) -> int:
    """Epochs between evaluations (options.eval_every_epochs, or the cost model's)."""
    if options.eval_every_epochs:
        return options.eval_every_epochs
    eval_work = 2 * valid_triples * num_entities
    scored = num_entities if training in ("kvsall", "1vsall") else 1 + neg_ratio
    train_work = 3 * examples * scored
    if train_work <= 0 or eval_work <= 0:
        return 1
    return max(1, math.ceil(eval_work / (options.eval_budget * train_work)))


class KGEHooks(TrainHooks):
    def __init__(self, options: KGEOptions, model: nn.Module, *, steps_per_epoch: int,
                 total_steps: int, eval_every_epochs: int,
                 collapse: CollapseCheck | None = None, is_main: bool = True) -> None:
        self.options, self.model = options, model
        self.collapse, self.is_main = collapse, is_main
        self.collapsed: dict[str, object] | None = None  # the report, once collapsed
        self.last_loss: float | None = None  # the newest --log-every window's mean loss
        self.steps_per_epoch, self.total_steps = steps_per_epoch, total_steps
        self.eval_every_epochs = eval_every_epochs
        self.warmup_steps = round(options.warmup_epochs * steps_per_epoch)
        self.cuts = 0
        self.best: float | None = None
        self.best_step = -1
        self.evaluations = 0
        self.bad = 0          # evaluations in a row without a better valid MRR
        self.plateau_bad = 0  # the same, reset by a cut
        self.stopped_early = False
        self.restored_best = False
        self.last_evaluated = -1
        self._snapshot: list[torch.Tensor] | None = None

    def lr_scale(self, step: int) -> float:
        warm = min(1.0, (step + 1) / self.warmup_steps) if self.warmup_steps else 1.0
        plateau = self.options.plateau_factor ** self.cuts if self.cuts else 1.0
        return warm * max(plateau, self.options.min_lr_scale)

    def eval_due(self, step: int) -> bool:
        if not self.eval_every_epochs:
            return False
        every = self.eval_every_epochs * self.steps_per_epoch
        return (step + 1) % every == 0 or step + 1 == self.total_steps

    def observe_loss(self, step: int, mean: float) -> None:
        self.last_loss = mean

    def after_eval(self, step: int, metrics: dict[str, float]) -> bool:
        mrr = metrics.get("valid_mrr")
        if mrr is None or not math.isfinite(mrr):
            return False
        self.evaluations += 1
        self.last_evaluated = step
        stop = self._schedule(step, mrr)
        if self.collapse is not None and self.collapsed is None:
            report = self.collapse.observe(mrr=mrr, loss=self.last_loss,
                                           epoch=(step + 1) / self.steps_per_epoch)
            if report is not None:  # every rank sees the same metrics and loss: same answer
                self.collapsed = report
                if step + 1 >= self.total_steps:
                    report["action"] = "training ends here anyway"
                elif self.options.on_collapse == "warn":
                    report["action"] = "going on (--on-collapse warn)"
                else:
                    self.stopped_early = stop = True
                if self.is_main:
                    log.warning(kv("collapse", step=step, **report))
        return stop

    def _schedule(self, step: int, mrr: float) -> bool:
        """The best model, reduce-on-plateau and early stopping: True to stop."""
        if self.best is None or mrr > self.best * (1 + PLATEAU_THRESHOLD):
            self.best, self.best_step = mrr, step
            self.bad = self.plateau_bad = 0
            if self.options.keep_best:
                self._take_snapshot()
            return False
        self.bad += 1
        self.plateau_bad += 1
        if self.options.plateau_factor and self.plateau_bad > self.options.plateau_patience:
            self.cuts += 1
            self.plateau_bad = 0
        patience = self.options.early_stop_patience
        if patience and self.bad >= patience and step + 1 < self.total_steps:
            self.stopped_early = True
            return True
        return False

    def finish(self) -> None:
        if self._snapshot is not None and self.best_step != self.last_evaluated:
            with torch.no_grad():
                for param, saved in zip(self._params(), self._snapshot, strict=True):
                    param.copy_(saved)
            self.restored_best = True
        self._snapshot = None

    def describe(self) -> dict[str, object]:
        return {
            "eval_every_epochs": self.eval_every_epochs, "evaluations": self.evaluations,
            "best_valid_mrr": self.best, "best_step": self.best_step,
            "best_epoch": (self.best_step + 1) / self.steps_per_epoch if self.best_step >= 0
            else None,
            "lr_cuts": self.cuts, "stopped_early": self.stopped_early,
            "restored_best": self.restored_best,
            "collapsed": self.collapsed is not None,
        }

    # -- the best model ------------------------------------------------------------------
    def _params(self) -> Iterator[torch.Tensor]:
        """This rank's part of every parameter: owned rows, FSDP-local dense shards.

        FSDP2 keeps the root's parameters gathered after a forward without backward (an
        evaluation): the registered parameters are then temporary full copies, so every
        FSDP module is resharded first and the sharded storage is what is saved/restored."""
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        for param in self.model.parameters():
            yield param.data

    def _take_snapshot(self) -> None:
        with torch.no_grad():
            if self._snapshot is None:
                self._snapshot = [p.clone() for p in self._params()]
            else:
                for saved, param in zip(self._snapshot, self._params(), strict=True):
                    saved.copy_(param)
