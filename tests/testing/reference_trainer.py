"""The single-process reference trainer: what the distributed worker must equal.

Plain PyTorch, no sharding, no server: one nn.Embedding(sparse=True) per
table (pooled bags call F.embedding_bag(..., sparse=True) on the same weight,
which is exactly nn.EmbeddingBag(sparse=True).forward) trained by
torch.optim.SparseAdam (torch.optim.SGD for --optimizer sgd, torch.optim.Adagrad for
adagrad, and for rowwise_adagrad and partial_rowwise_adam `RowOptimizer`: the torch
reference kernels of hybridps/optim_torch.py on the whole table; each kind's record says
which, hybridps/optim_kinds.py `OptimizerKind.reference`), the dense
module trained by the same torch.optim optimizer as the worker's, starting
from the same rows (worker.embedding.sharded.init_rows over the whole table) and the
same dense init (the run seed), on the same GLOBAL batches
(task.global_batch(step, world_size)), with the loss = the mean over the
global batch. With --staleness 0 the worker must reach the same rows and
dense weights up to float rounding (tests/worker/train/test_worker_e2e.py).

    from tests.testing.reference_trainer import train_reference
    result = train_reference(cfg, world_size=2)
    result.tables["user"], result.dense["0.weight"], result.losses
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from hybridps.optim import OptimizerSpec, apply_update_torch_, step_rows_torch_state_
from hybridps.optim_kinds import ROW_KERNELS, TorchReference
from worker.config.train_config import TrainConfig
from worker.dense.optimizer import make_dense_optimizer, sparse_optimizer_spec
from worker.embedding.rows import TableConfig, init_rows
from worker.embedding.sharded import POOLING_MODES
from worker.tasks import build_task
from worker.tasks.base import HybridModel, Task, build_dense_seeded
from worker.train.trainer import num_steps, scheduled_lr


class LocalEmbedding(nn.Module):
    """Whole tables in one process, with the lookups API of ShardedEmbedding."""

    def __init__(self, tables: Sequence[TableConfig], *, seed: int, init_std: float,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.tables = nn.ModuleDict()
        for index, t in enumerate(tables):
            if t.dynamic is not None:
                raise ValueError(f"table {t.name!r} is dynamic: the reference trainer has "
                                 "only static tables (docs/dynamic_ids.md)")
            rows_RD = init_rows(t.num_rows, t.dim, 0, t.num_rows, seed=seed, table_index=index,
                                init_std=init_std)
            self.tables[t.name] = nn.Embedding(t.num_rows, t.dim, sparse=True,
                                               _weight=rows_RD.to(device),
                                               device=device)

    def lookup(self, name: str, ids_N: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.tables[name](ids_N)
        return out

    def lookup_bag(self, name: str, ids_N: torch.Tensor, offsets_B: torch.Tensor,
                   mode: str = "sum") -> torch.Tensor:
        if mode not in POOLING_MODES:
            raise ValueError(f"mode={mode!r} is not one of {POOLING_MODES}")
        return F.embedding_bag(ids_N, self.weight(name), offsets_B, mode=mode, sparse=True)

    def weight(self, name: str) -> torch.Tensor:
        module = self.tables[name]
        assert isinstance(module, nn.Embedding)
        return module.weight

    def lookup_many(self, names: Sequence[str], ids: Sequence[torch.Tensor],
                    bags: Sequence[tuple[torch.Tensor, str] | None] | None = None
                    ) -> list[torch.Tensor]:
        bags = bags if bags is not None else [None] * len(names)
        return [self.lookup(n, i) if bag is None else self.lookup_bag(n, i, *bag)
                for n, i, bag in zip(names, ids, bags, strict=True)]

    def local_block(self, name: str) -> tuple[int, torch.Tensor]:
        """(0, whole table) with a sparse gradient: ShardedEmbedding.local_block at world 1."""
        weight = self.weight(name)
        local_R = torch.arange(weight.shape[0], device=weight.device)
        return 0, F.embedding(local_R, weight, sparse=True)

    def full_tables(self) -> dict[str, torch.Tensor]:
        return {name: self.weight(name).detach().cpu().clone() for name in self.tables}


class RowOptimizer(torch.optim.Optimizer):
    """A torch.optim optimizer for sparse gradients over hybridps' torch reference kernels
    (hybridps/optim_torch.py), for the kinds torch has no optimizer of: each step
    coalesces a parameter's gradient and updates its touched rows (one step count a
    parameter, like SparseAdam). The lr is the param group's (a schedule sets it)."""

    def __init__(self, params: Sequence[nn.Parameter], spec: OptimizerSpec) -> None:
        super().__init__(list(params), {"lr": spec.lr})
        self.spec = spec

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            spec = dataclasses.replace(self.spec, lr=group["lr"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.coalesce()
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["rows"] = {name: torch.zeros(p.shape[0], width, device=p.device)
                                     for name, width in spec.state_widths(p.shape[1])}
                state["step"] += 1
                ids_U = grad.indices()[0]
                delta_UD, decay = step_rows_torch_state_(spec, state["rows"], ids_U,
                                                         grad.values(), state["step"])
                apply_update_torch_(p.data, ids_U, delta_UD, decay)


def make_sparse_optimizer(cfg: TrainConfig, params: Sequence[nn.Parameter]
                          ) -> torch.optim.Optimizer:
    """The kind's reference (its record, hybridps/optim_kinds.py): a torch.optim optimizer
    taking sparse gradients, or ROW_KERNELS: RowOptimizer over its torch kernel."""
    spec = sparse_optimizer_spec(cfg.optim)
    reference = spec.record.reference
    if reference == ROW_KERNELS:
        return RowOptimizer(params, spec)
    if isinstance(reference, TorchReference) and (
            spec.weight_decay == 0 or "weight_decay" in reference.args):
        kwargs = {name: getattr(spec, name) for name in reference.args}
        optimizer: torch.optim.Optimizer = getattr(torch.optim, reference.torch_class)(
            list(params), **kwargs)
        return optimizer
    raise NotImplementedError(
        f"the reference has no torch sparse optimizer for optimizer={spec.kind!r} "
        f"with weight_decay={spec.weight_decay}")


@dataclass
class ReferenceResult:
    tables: dict[str, torch.Tensor]  # full tables after the last step
    dense: dict[str, torch.Tensor]   # dense state_dict after the last step
    losses: list[float]              # global-batch loss of every step
    grad_norms: list[float] = field(default_factory=list)  # --clip-grad-norm: pre-clip norms


def train_reference(cfg: TrainConfig, world_size: int, *, steps: int | None = None,
                    task: Task | None = None, device: torch.device | str = "cpu"
                    ) -> ReferenceResult:
    """Train like the worker at --staleness 0 on `world_size` ranks, in one process."""
    task = task or build_task(cfg)
    steps = num_steps(cfg.run, task, world_size) if steps is None else steps
    embedding = LocalEmbedding(task.tables(), seed=cfg.run.seed, init_std=cfg.optim.init_std,
                               device=device)
    dense = build_dense_seeded(task, cfg.run.seed).to(device)
    model = HybridModel(embedding, dense)
    sparse_opt = make_sparse_optimizer(cfg, list(embedding.parameters()))
    dense_opt = make_dense_optimizer(cfg.optim, dense.parameters())
    losses, grad_norms = [], []
    logged = 0
    # --dense-parallel ddp --ddp-grad-reduce sum: the objective is the sum over ranks of each
    # rank's mean loss, i.e. world_size x the global mean (for dense and embedding grads).
    d = cfg.dense
    loss_factor = world_size if d.dense_parallel == "ddp" and d.ddp_grad_reduce == "sum" else 1
    hooks = task.hooks(model, world_size)  # the worker's lr schedule, evaluations, best model
    for step in range(steps):
        batch = task.global_batch(step, world_size).to(device)
        loss = task.loss(model, batch)  # mean over the global batch
        (loss * loss_factor if loss_factor != 1 else loss).backward()
        if d.clip_grad_norm > 0:  # the dense part only, like the worker
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(
                list(dense.parameters()), d.clip_grad_norm)))
        lr = scheduled_lr(hooks, step, cfg.optim, dense_opt)
        if lr is not None:
            for group in sparse_opt.param_groups:
                group["lr"] = lr
        dense_opt.step()
        sparse_opt.step()
        dense_opt.zero_grad(set_to_none=True)
        sparse_opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if hooks is not None and (hooks.eval_due(step) or (
                cfg.output.eval_every and ((step + 1) % cfg.output.eval_every == 0
                                           or step + 1 == steps))):
            with torch.no_grad():
                metrics = task.evaluate_full(model, 0, 1, quick=True) or {}
            if hooks.after_eval(step, metrics):
                break
        if hooks is not None and ((step + 1) % cfg.output.log_every == 0 or step + 1 == steps):
            window = losses[logged:]  # the worker's --log-every window, after its evaluation
            hooks.observe_loss(step, sum(window) / len(window))
            logged = len(losses)
    if hooks is not None:
        hooks.finish()
    state = {k: v.detach().cpu().clone() for k, v in dense.state_dict().items()}
    return ReferenceResult(embedding.full_tables(), state, losses, grad_norms)
