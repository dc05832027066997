"""The Task interface: what a job plugs into the (task-agnostic) training loop.

A task says which embedding tables it needs, builds its dense module, makes
batches and computes the loss. The loop (worker/train/trainer.py) and the
single-process reference (tests/testing/reference_trainer.py) never change per task.

Contract:
- `tables()` lists the tables (name, num_rows, dim); their order is the
  table index used for row init and the order of pushes.
- `build_dense()` returns the dense nn.Module; the caller seeds torch's RNG
  with the run seed first (`build_dense_seeded`), so every rank and the
  reference start from the same weights. It is trained under FSDP2.
- `global_batch(step, world_size)` makes the GLOBAL batch of step `step`
  (world_size * batch_size samples) from (seed, step) alone; `batch(step,
  rank, world_size)` is slice `rank` of it (the default slices; override
  only to avoid generating what the rank drops).
- `loss(model, batch)` returns the MEAN loss over the batch's samples. It
  reads embeddings only through `model.lookups` (`lookup`, `lookup_bag`,
  `lookup_many`, `local_block`: EmbeddingLookups below) and must issue the
  same lookups in the same order on every rank (they are collectives).
- optional: `eval_batch(index, rank, world_size)` (held-out data, None when
  there is none), `evaluate(model, batch)` (metrics as mean-over-batch
  scalar tensors), `steps_per_epoch(world_size)` (finite data; `steps_for_epochs(epochs,
  world_size)` where a resumed schedule's epochs differ in length),
  `fsdp_units(dense)` (submodules to shard separately), `describe()`,
  `evaluate_full(model, rank, world_size, quick=...)` (a whole-split evaluation
  that is itself a collective, e.g. shard-parallel ranking; replaces the
  eval_batch/evaluate averaging when it returns metrics), `save_artifacts(
  results_path)` (rank 0 writes task files next to --results, e.g. id maps),
  `hooks(model, world_size)` (a TrainHooks: lr schedule, scheduled evaluation, early
  stopping, best-model restore; the loop and the reference call it the same way),
  `data_state(next_step)` / `load_data_state(states_by_rank, next_step)` (a reader whose
  position is not a function of the step: a checkpoint saves each rank's, a resume hands
  back all of them).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from worker.config.train_config import TrainConfig
from worker.embedding.rows import TableConfig
from worker.runtime.device_copy import to_device

__all__ = ["Batch", "EmbeddingLookups", "HybridModel", "TableConfig", "Task", "TrainHooks",
           "build_dense_seeded"]


class EmbeddingLookups(Protocol):
    """What a task may call on `model.lookups` (sharded or the reference's tables)."""

    def lookup(self, name: str, ids_N: torch.Tensor) -> torch.Tensor: ...

    def lookup_bag(self, name: str, ids_N: torch.Tensor, offsets_B: torch.Tensor,
                   mode: str = "sum") -> torch.Tensor: ...

    def lookup_many(self, names: Sequence[str], ids: Sequence[torch.Tensor],
                    bags: Sequence[tuple[torch.Tensor, str] | None] | None = None
                    ) -> list[torch.Tensor]: ...

    def local_block(self, name: str) -> tuple[int, torch.Tensor]: ...


class HybridModel(nn.Module):
    """The whole model: embedding tables + the dense module (FSDP in the worker)."""

    def __init__(self, embedding: nn.Module, dense: nn.Module) -> None:
        super().__init__()
        self.embedding = embedding
        self.dense = dense

    @property
    def lookups(self) -> EmbeddingLookups:
        return self.embedding  # type: ignore[return-value]


@dataclass
class Batch:
    """`size` samples. Every tensor's first dimension is the sample, except bags.

    ids: per-sample id features, [size] or [size, k] (global row ids).
    bags: multi-hot features as (ids_N flat, offsets_B) like nn.EmbeddingBag.
    values: per-sample float (or label) tensors, [size, ...].
    """

    size: int
    ids: dict[str, torch.Tensor] = field(default_factory=dict)
    bags: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    values: dict[str, torch.Tensor] = field(default_factory=dict)

    def slice(self, lo: int, hi: int) -> Batch:
        """Samples [lo, hi) (bags re-based to start at offset 0)."""
        if not 0 <= lo <= hi <= self.size:
            raise IndexError(f"slice [{lo}, {hi}) outside a batch of {self.size}")
        bags = {}
        for name, (ids_N, offsets_B) in self.bags.items():
            ends = torch.cat([offsets_B[1:], offsets_B.new_tensor([ids_N.numel()])])
            start = int(offsets_B[lo]) if lo < self.size else ids_N.numel()
            stop = int(ends[hi - 1]) if hi > lo else start
            bags[name] = (ids_N[start:stop], offsets_B[lo:hi] - start)
        return Batch(hi - lo, {k: v[lo:hi] for k, v in self.ids.items()}, bags,
                     {k: v[lo:hi] for k, v in self.values.items()})

    def pin_memory(self) -> Batch:
        """The same samples in pinned host memory (a non-blocking copy to a GPU overlaps)."""
        return Batch(
            self.size, {k: v.pin_memory() for k, v in self.ids.items()},
            {k: (i.pin_memory(), o.pin_memory()) for k, (i, o) in self.bags.items()},
            {k: v.pin_memory() for k, v in self.values.items()})

    def to(self, device: torch.device | str) -> Batch:
        """The batch on `device`; to a CUDA device through pinned buffers with
        non-blocking copies (worker/runtime/device_copy.py `to_device`: a copy from
        pageable memory would make the host wait for it)."""
        dev = torch.device(device)
        return Batch(
            self.size,
            {k: to_device(v, dev) for k, v in self.ids.items()},
            {k: (to_device(i, dev), to_device(o, dev)) for k, (i, o) in self.bags.items()},
            {k: to_device(v, dev) for k, v in self.values.items()},
        )


class TrainHooks:
    """Per-run training controls a task may add (Task.hooks); the defaults change nothing.

    Determinism: `lr_scale(step)` may depend only on `step` and on the metrics given to
    `after_eval` before `step` (the same on every rank), so the lr of step t's push is fixed
    by what was known when step t was taken, whatever the timing."""

    def lr_scale(self, step: int) -> float:
        """Factor on --lr (the rows' optimizer, sent with each push) and --dense-lr."""
        return 1.0

    def eval_due(self, step: int) -> bool:
        """Evaluate (task.evaluate_full(quick=True), a collective) after `step`?"""
        return False

    def after_eval(self, step: int, metrics: dict[str, float]) -> bool:
        """Metrics of the evaluation after `step`; True: stop training after this step."""
        return False

    def observe_loss(self, step: int, mean: float) -> None:
        """The training loss of the --log-every window ending at `step`, the mean over the
        ranks (all-reduced: the same on every rank)."""

    def finish(self) -> None:
        """After the last step's updates are applied, before the final evaluation."""

    def describe(self) -> dict[str, object]:
        return {}


class Task(ABC):
    """One job. Constructed from the run's TrainConfig (sizes, seed, batch size)."""

    name = "task"

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg

    @abstractmethod
    def tables(self) -> list[TableConfig]:
        """The embedding tables, in a fixed order."""

    @abstractmethod
    def build_dense(self) -> nn.Module:
        """The dense module (random init from torch's global RNG)."""

    @abstractmethod
    def global_batch(self, step: int, world_size: int) -> Batch:
        """world_size * cfg.run.batch_size samples, a pure function of (seed, step)."""

    @abstractmethod
    def loss(self, model: HybridModel, batch: Batch) -> torch.Tensor:
        """Mean loss over the batch's samples (a scalar)."""

    def batch(self, step: int, rank: int, world_size: int) -> Batch:
        """This rank's slice of the global batch of `step`."""
        b = self.cfg.run.batch_size
        return self.global_batch(step, world_size).slice(rank * b, (rank + 1) * b)

    def eval_batch(self, index: int, rank: int, world_size: int) -> Batch | None:
        """This rank's slice of held-out global batch `index`; None: no eval data."""
        return None

    def evaluate(self, model: HybridModel, batch: Batch) -> dict[str, torch.Tensor]:
        """Mean-over-batch metrics (scalar tensors); runs under torch.no_grad()."""
        return {"loss": self.loss(model, batch)}

    def steps_per_epoch(self, world_size: int) -> int | None:
        """Steps in one pass over finite data; None for generated data."""
        return None

    def steps_for_epochs(self, epochs: int, world_size: int) -> int | None:
        """The step --epochs passes end before: epochs * steps_per_epoch, unless the data's
        schedule says otherwise (a resume at another world size re-splits what was left of
        an epoch into a remainder of its own length); None for generated data."""
        per_epoch = self.steps_per_epoch(world_size)
        return None if per_epoch is None else epochs * per_epoch

    def evaluate_full(self, model: HybridModel, rank: int, world_size: int, *,
                      quick: bool = False) -> dict[str, float] | None:
        """Whole-split metrics computed by all ranks together (a collective: every rank calls
        it at the same point); the same dict on every rank. `quick`: the cheap subset shown
        in the progress bar during training. None: use eval_batch/evaluate instead."""
        return None

    def save_artifacts(self, results_path: str) -> list[str]:
        """Rank 0, after --results is written: task files next to it; returns their paths."""
        return []

    def eval_cost_in_steps(self, world_size: int, *, quick: bool) -> float:
        """An evaluation's cost in training steps, an estimate (--time-budget scales the
        measured step time with it; the final over a quick one scales the measured
        evaluations). Default: --eval-batches forward passes, a third of a step each."""
        return self.cfg.output.eval_batches / 3.0

    def rows_pushed_per_step(self, world_size: int) -> dict[str, int] | None:
        """The most rows of each table one rank pushes in a step (sizes the same-node
        arena, worker/sync/arena.py); None: not known (the default arena size)."""
        return None

    def data_state(self, next_step: int) -> dict[str, Any] | None:
        """This rank's reading position before batch `next_step` (a checkpoint saves it:
        plain values and tensors); None when batches are a pure function of the step."""
        return None

    def load_data_state(self, states_by_rank: Sequence[dict[str, Any] | None],  # noqa: B027
                        next_step: int) -> None:
        """Resume reading at batch `next_step` from every saved rank's `data_state` (in
        rank order; None where a rank saved none), so a task can re-split them at another
        world size. Called on every resume, before the first batch."""

    def hooks(self, model: HybridModel, world_size: int) -> TrainHooks | None:
        """Training controls for this run (None: none); built once the model exists."""
        return None

    @classmethod
    def plan_dense_parameters(cls, cfg: TrainConfig) -> int | None:
        """The dense part's parameter count without building the task (worker/plan.py:
        what --dense-parallel auto would choose); None: known once the task is built."""
        return None

    def fsdp_units(self, dense: nn.Module) -> list[nn.Module]:
        """Submodules of `dense` to shard as their own FSDP units (default: root only)."""
        return []

    def describe(self) -> dict[str, object]:
        """Facts worth printing/saving with the results (sizes, planted truth...)."""
        return {"task": self.name, "tables": [_table_facts(t) for t in self.tables()]}


def _table_facts(t: TableConfig) -> dict[str, object]:
    """name, num_rows, dim (and a dynamic table's policies) as plain values."""
    facts: dict[str, object] = {"name": t.name, "num_rows": t.num_rows, "dim": t.dim}
    if t.dynamic is not None:
        facts["dynamic"] = dataclasses.asdict(t.dynamic)
    return facts


def build_dense_seeded(task: Task, seed: int) -> nn.Module:
    """task.build_dense() under torch.manual_seed(seed), leaving the global RNG as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return task.build_dense()
