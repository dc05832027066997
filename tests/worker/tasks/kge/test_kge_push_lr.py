"""A learning rate per push (Push.lr): the server's row optimizer follows a schedule exactly.

The partition applies push t with the lr the push carries; torch's optimizers with the same lr
set in their param_groups before step t are the reference. The same schedule reaches
--local-optimizer through UpdateSource.push(step, grads, lr).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from hybridps import optim
from hybridps.errors import InvalidArgument
from hybridps.optim import OptimizerSpec, apply_update_
from ps.core.partition import PushChunk, TableSpec
from ps.core.store import Store

ROWS, DIM, RUN = 30, 5, "run-lr"
SCHEDULE = [0.1, 0.2, 0.3, 0.05, 0.05, 0.01, 0.4, 0.0, 0.02, 0.1]  # warm-up, plateau cuts, ...


@pytest.fixture
def torch_kernel() -> Iterator[None]:
    before = optim.kernel_info()["requested"]
    optim.set_kernel("torch")
    yield
    optim.set_kernel(before)


def _server_rows(spec: OptimizerSpec, ids_per_step: list[torch.Tensor],
                 grads_per_step: list[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    store = Store(server_id="test")
    store.register(RUN, 0, 1, 0, [TableSpec("emb", ROWS, DIM, 0, ROWS)], spec)
    session = store.open_session()
    rows = rows.clone()
    for step, (ids, grads) in enumerate(zip(ids_per_step, grads_per_step, strict=True)):
        answer = session.feed(PushChunk(RUN, 0, 0, step, "emb", ids, grads,
                                        lr=SCHEDULE[step] * 0.1))
        assert answer is not None
        apply_update_(rows, answer.ids, answer.delta, answer.decay)
    return rows


def _torch_rows(opt_cls: type[torch.optim.Optimizer], kwargs: dict[str, object], sparse: bool,
                every_row: bool) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor],
                                          list[torch.Tensor]]:
    torch.manual_seed(0)
    emb = torch.nn.Embedding(ROWS, DIM, sparse=sparse)
    start = emb.weight.detach().clone()
    opt = opt_cls(emb.parameters(), **kwargs)  # type: ignore[arg-type]
    target = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(2)
    ids_list, grads_list = [], []
    for step in range(len(SCHEDULE)):
        idx = torch.randint(0, ROWS, (12,), generator=gen)
        if every_row:
            idx = torch.cat([idx, torch.arange(ROWS)])
        opt.zero_grad()
        ((emb(idx) - target[idx]) ** 2).sum().backward()
        grad = emb.weight.grad
        assert grad is not None
        if grad.is_sparse:
            grad = grad.coalesce()
            ids_list.append(grad.indices()[0].clone())
            grads_list.append(grad.values().clone())
        else:
            ids_list.append(torch.arange(ROWS))
            grads_list.append(grad.clone())
        for group in opt.param_groups:
            group["lr"] = SCHEDULE[step] * 0.1
        opt.step()
    return start, emb.weight.detach(), ids_list, grads_list


@pytest.mark.usefixtures("torch_kernel")
def test_push_lr_is_sparse_adam_with_a_changing_lr_bitwise() -> None:
    start, ref, ids, grads = _torch_rows(torch.optim.SparseAdam, {"lr": 1.0}, True, False)
    ours = _server_rows(OptimizerSpec("adam", lr=1.0), ids, grads, start)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)


def test_push_lr_native_kernel_close_to_sparse_adam() -> None:
    start, ref, ids, grads = _torch_rows(torch.optim.SparseAdam, {"lr": 1.0}, True, False)
    ours = _server_rows(OptimizerSpec("adam", lr=1.0), ids, grads, start)
    torch.testing.assert_close(ours, ref)


def test_push_lr_is_adamw_with_a_changing_lr() -> None:
    kwargs = {"lr": 1.0, "weight_decay": 0.1, "foreach": False}
    start, ref, ids, grads = _torch_rows(torch.optim.AdamW, kwargs, False, True)
    ours = _server_rows(OptimizerSpec("adamw", lr=1.0, weight_decay=0.1), ids, grads, start)
    torch.testing.assert_close(ours, ref)


def test_push_without_lr_uses_the_registered_lr() -> None:
    _, _, ids, grads = _torch_rows(torch.optim.SparseAdam, {"lr": 0.01}, True, False)
    store = Store(server_id="test")
    store.register(RUN, 0, 1, 0, [TableSpec("emb", ROWS, DIM, 0, ROWS)],
                   OptimizerSpec("adam", lr=0.01))
    session = store.open_session()
    other = Store(server_id="test2")
    other.register(RUN, 0, 1, 0, [TableSpec("emb", ROWS, DIM, 0, ROWS)],
                   OptimizerSpec("adam", lr=0.01))
    for step in range(3):
        a = session.feed(PushChunk(RUN, 0, 0, step, "emb", ids[step], grads[step]))
        b = other.open_session().feed(PushChunk(RUN, 0, 0, step, "emb", ids[step], grads[step],
                                                lr=0.01))
        assert a is not None and b is not None
        torch.testing.assert_close(a.delta, b.delta, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.1])
def test_push_with_a_bad_lr_is_refused_and_changes_nothing(bad: float) -> None:
    store = Store(server_id="test")
    store.register(RUN, 0, 1, 0, [TableSpec("emb", ROWS, DIM, 0, ROWS)],
                   OptimizerSpec("adam", lr=0.01))
    ids, grads = torch.tensor([1, 4]), torch.ones(2, DIM)
    with pytest.raises(InvalidArgument, match="lr="):
        store.open_session().feed(PushChunk(RUN, 0, 0, 0, "emb", ids, grads, lr=bad))
    ok = store.open_session().feed(PushChunk(RUN, 0, 0, 0, "emb", ids, grads, lr=0.01))
    assert ok is not None and ok.step == 0  # the refused push applied nothing


def test_local_optimizer_follows_the_push_lr_like_the_server() -> None:
    from worker.embedding.rows import TableConfig
    from worker.embedding.sharded import ShardedEmbedding
    from worker.updates.source import LocalSparseOptimizer

    emb = ShardedEmbedding([TableConfig("emb", ROWS, DIM)], rank=0, world_size=1, group=None,
                           device=torch.device("cpu"), seed=0, init_std=1.0)
    spec = OptimizerSpec("adam", lr=1.0)
    local = LocalSparseOptimizer(emb, spec)
    _, _, ids, grads = _torch_rows(torch.optim.SparseAdam, {"lr": 1.0}, True, False)
    store = Store(server_id="test")
    store.register(RUN, 0, 1, 0, [TableSpec("emb", ROWS, DIM, 0, ROWS)], spec)
    session = store.open_session()
    for step in range(len(SCHEDULE)):
        lr = SCHEDULE[step] * 0.1
        local.push(step, {"emb": (ids[step], grads[step])}, lr)
        answer = session.feed(PushChunk(RUN, 0, 0, step, "emb", ids[step], grads[step], lr=lr))
        assert answer is not None
        (update,), _ = local.take(step)
        torch.testing.assert_close(update.delta_UD, answer.delta, rtol=0, atol=0)
    assert dataclasses.asdict(spec)["lr"] == 1.0  # the registered spec is not changed
