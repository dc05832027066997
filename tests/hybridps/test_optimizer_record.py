"""Adding a sparse optimizer is its record plus its kernel (hybridps/optim_kinds.py): a kind
registered here, at test time, through `register_kind` alone (no other file names it) is a
flag choice with its dense counterpart, is stepped by --local-optimizer and by the shard
server's partition (state allocated by its layout, checkpointed and restored by name), is
held to its torch reference by the reference trainer, and the server's overflow check reads
its bound. It is unregistered after each test.

The kind, harmonic_sgd: SGD whose step on a row is lr / n at the row's n-th push (a per-row
1/t schedule), with decoupled weight decay; its state is one float a row, the pushes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import hybridps.optim as optim
from hybridps import native
from hybridps.checkpoint import write_manifest
from hybridps.cli import parse_config
from hybridps.errors import InvalidArgument, NonFiniteUpdate
from hybridps.optim import OptimizerSpec, step_rows_
from hybridps.optim_kinds import (
    ROW_KERNELS,
    STATE_LAYOUTS,
    TAKES_WEIGHT_DECAY,
    OptimizerKind,
    describe_saved,
    kind_names,
    register_kind,
    unregister_kind,
)
from hybridps.optim_torch import all_finite
from ps.core.overflow import OverflowBound
from ps.core.partition import PushChunk, TableSpec
from ps.core.store import Store
from tests.testing.reference_trainer import RowOptimizer, make_sparse_optimizer, train_reference
from worker.config.train_config import TrainConfig
from worker.dense.optimizer import make_dense_optimizer, sparse_optimizer_spec
from worker.embedding.rows import TableConfig
from worker.embedding.sharded import ShardedEmbedding
from worker.plan import optimizer_state_bytes
from worker.runtime.dist import DistContext
from worker.train.trainer import Trainer
from worker.updates.source import LocalSparseOptimizer

KIND = "harmonic_sgd"
NUM_ROWS, DIM = 30, 6


def harmonic_sgd_step(spec: OptimizerSpec, state: Sequence[torch.Tensor], ids_U: torch.Tensor,
                      grads_UD: torch.Tensor, step: int, check_finite: bool = False
                      ) -> tuple[torch.Tensor, float]:
    """The kind's kernel, pure torch: n += 1; delta = g * -lr / n; decay 1 - lr*wd."""
    (pushes_R1,) = state
    n = pushes_R1.index_select(0, ids_U).add_(1.0)
    delta = grads_UD.mul(-spec.lr).div_(n)
    if check_finite and not all_finite(delta):
        raise NonFiniteUpdate("the update would make the delta non-finite")
    pushes_R1.index_copy_(0, ids_U, n)
    return delta, 1.0 - spec.lr * spec.weight_decay


BOUNDS_READ: list[tuple[str, Mapping[str, float]]] = []


def harmonic_sgd_bound(spec: Any, dim: int, step: int, g: float, old: Mapping[str, float]
                       ) -> tuple[dict[str, float], list[float], float]:
    """pushes grows by one a push; |delta| <= lr |g| (n >= 1)."""
    BOUNDS_READ.append((spec.kind, dict(old)))
    r = OverflowBound.ROUNDING
    return {"pushes": (old.get("pushes", 0.0) + 1.0) * r}, [], abs(spec.lr) * g * r


RECORD = OptimizerKind(
    KIND, state=(("pushes", 1),), reads=frozenset({"lr", "weight_decay"}), dense="sgd",
    torch_step=harmonic_sgd_step, bound=harmonic_sgd_bound, reference=ROW_KERNELS,
    touched_from="pushes", summary="harmonic_sgd (lr / n at a row's n-th push)")


@pytest.fixture
def harmonic() -> Iterator[OptimizerKind]:
    register_kind(RECORD)
    BOUNDS_READ.clear()
    try:
        yield RECORD
    finally:
        unregister_kind(KIND)


def reference_rows(rows: torch.Tensor, pushes: torch.Tensor, spec: OptimizerSpec,
                   ids: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """The kind's math one element at a time (float32 0-d tensors); updates `rows` and
    `pushes` in place and returns the delta."""
    delta = torch.empty_like(grads)
    lr, decay = torch.tensor(-spec.lr), torch.tensor(1.0 - spec.lr * spec.weight_decay)
    for i, r in enumerate(ids.tolist()):
        pushes[r, 0] = pushes[r, 0] + 1.0
        for j in range(grads.shape[1]):
            delta[i, j] = grads[i, j] * lr / pushes[r, 0]
            rows[r, j] = rows[r, j] * decay + delta[i, j]
    return delta


def some_pushes(steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sorted unique ids (rows touched several times, some never) and their gradients."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randperm(NUM_ROWS - 4, generator=gen)[:9].sort().values,
             torch.randn(9, DIM, generator=gen)) for _ in range(steps)]


def push(store: Store, step: int, ids: torch.Tensor, grads: torch.Tensor,
         rank: int = 0) -> torch.Tensor:
    answer = store.open_session().feed(PushChunk("run", rank, 0, step, "t", ids, grads))
    assert answer is not None
    return answer.delta


def test_registering_is_all_it_takes_to_be_a_kind(harmonic: OptimizerKind) -> None:
    assert KIND in kind_names() and STATE_LAYOUTS[KIND] == (("pushes", 1),)
    assert KIND in TAKES_WEIGHT_DECAY
    spec = OptimizerSpec(KIND, lr=0.1, weight_decay=0.01)
    assert spec.state_widths(DIM) == (("pushes", 1),) and spec.has_state
    # what a checkpoint says of it: the hyperparameters it reads, no betas or eps
    assert spec.describe() == "harmonic_sgd(lr=0.1, weight_decay=0.01)"
    assert describe_saved(dataclasses.asdict(spec)) == spec.describe()
    assert optimizer_state_bytes(KIND, 64) == 4 / 64  # --plan: one float a row
    with pytest.raises(ValueError, match="already registered"):
        register_kind(RECORD)


def test_config_accepts_it_with_its_dense_counterpart(harmonic: OptimizerKind) -> None:
    cfg = parse_config(TrainConfig, ["--local-optimizer", "--optimizer", KIND,
                                     "--weight-decay", "0.01"], environ={})
    assert cfg.optim.optimizer == KIND and cfg.optim.dense_kind == "sgd"
    assert sparse_optimizer_spec(cfg.optim) == OptimizerSpec(KIND, lr=cfg.optim.lr,
                                                             weight_decay=0.01)
    dense = make_dense_optimizer(cfg.optim, [torch.nn.Parameter(torch.zeros(2))])
    assert type(dense) is torch.optim.SGD and dense.defaults["weight_decay"] == 0.01
    # the wire names the built-in kinds only: a shard server cannot be asked for it
    with pytest.raises(ValueError, match="registered in this process only"):
        TrainConfig.of(ps="127.0.0.1:1", optimizer=KIND)


def test_config_and_spec_refuse_it_once_unregistered() -> None:
    with pytest.raises(ValueError, match=f"optimizer='{KIND}' is not one of adam, adamw"):
        TrainConfig.of(local_optimizer=True, optimizer=KIND)
    with pytest.raises(InvalidArgument, match="is not one of"):
        OptimizerSpec(KIND)


@pytest.mark.parametrize("kernel", ["torch", pytest.param("native", marks=pytest.mark.skipif(
    native.ext is None, reason="native kernels not built"))])
def test_the_kernels_step_it_as_its_reference(harmonic: OptimizerKind, kernel: str) -> None:
    """Without a native entry it runs its torch kernel whichever kernels are chosen."""
    before = optim.kernel_info()["requested"]
    optim.set_kernel(kernel)
    try:
        spec = OptimizerSpec(KIND, lr=0.3, weight_decay=0.02)
        state = {"pushes": torch.zeros(NUM_ROWS, 1)}
        rows, ref_rows, ref_pushes = torch.zeros(NUM_ROWS, DIM), torch.zeros(NUM_ROWS, DIM), \
            torch.zeros(NUM_ROWS, 1)
        for step, (ids, grads) in enumerate(some_pushes(5), start=1):
            want = reference_rows(ref_rows, ref_pushes, spec, ids, grads)
            delta, decay = step_rows_(spec, state, ids, grads, step)
            assert torch.equal(delta, want) and decay == 1.0 - 0.3 * 0.02
            optim.apply_update_(rows, ids, delta, decay)
        assert torch.equal(state["pushes"], ref_pushes) and int(ref_pushes.max()) >= 2
        assert torch.equal(rows, ref_rows)
    finally:
        optim.set_kernel(before)


def test_local_optimizer_and_the_server_core_step_it_alike(harmonic: OptimizerKind,
                                                           tmp_path: Path) -> None:
    spec = OptimizerSpec(KIND, lr=0.2)
    emb = ShardedEmbedding([TableConfig("t", NUM_ROWS, DIM)], seed=1, init_std=0.1)
    local = LocalSparseOptimizer(emb, spec)
    assert {n: tuple(x.shape) for n, x in local.state["t"].items()} == {"pushes": (NUM_ROWS, 1)}
    table = TableSpec("t", NUM_ROWS, DIM, 0, NUM_ROWS)
    store = Store()
    store.register("run", 0, 1, 0, [table], spec)
    t = store.partition("run", 0).tables["t"]  # type: ignore[union-attr]
    assert {n: tuple(x.shape) for n, x in t.state.items()} == {"pushes": (NUM_ROWS, 1)}
    # two flags a row and one float of state
    assert t.state_bytes == table.state_bytes(KIND, master=False) == NUM_ROWS * (2 + 4)
    ref_rows, ref_pushes = torch.zeros(NUM_ROWS, DIM), torch.zeros(NUM_ROWS, 1)
    for step, (ids, grads) in enumerate(some_pushes(6, seed=1)):
        want = reference_rows(ref_rows, ref_pushes, spec, ids, grads)
        local.push(step, {"t": (ids, grads)})
        (update,), _ = local.take(step)
        assert torch.equal(update.delta_UD, want)
        assert torch.equal(push(store, step, ids, grads), want)
    assert torch.equal(local.state["t"]["pushes"], ref_pushes)
    assert torch.equal(t.state["pushes"], ref_pushes)
    # checkpointed and restored by its state's name; the restored server marks as touched
    # the rows its record's touched_from state says were pushed
    ((_, info),) = store.checkpoint("run", [0], 5, str(tmp_path))
    write_manifest(tmp_path, {"step": 5, "tables": {"t": {"num_rows": NUM_ROWS, "dim": DIM,
                   "shards": [{"rank": 0, "row_start": 0, "row_end": NUM_ROWS, "optim": {
                       "file": info.file, "bytes": info.bytes, "crc32": info.crc32}}]}}})
    again = Store()
    again.register("run", 0, 1, 1, [table], spec, restore=(str(tmp_path), 5))
    restored = again.partition("run", 0).tables["t"]  # type: ignore[union-attr]
    assert torch.equal(restored.state["pushes"], ref_pushes)
    assert torch.equal(restored.touched, (ref_pushes != 0).squeeze(1))


def test_the_server_overflow_check_reads_its_bound(harmonic: OptimizerKind) -> None:
    """A gradient whose delta would overflow: the bound says so, the push runs checked and
    is refused unchanged. The same kernel with a bound that proves nothing false runs it
    unchecked: the bound, the record's, is all that decides."""
    spec = OptimizerSpec(KIND, lr=10.0)
    ids, grads = some_pushes(1)[0]
    store = Store()
    store.register("run", 0, 1, 0, [TableSpec("t", NUM_ROWS, DIM, 0, NUM_ROWS)], spec)
    push(store, 0, ids, grads)
    assert BOUNDS_READ and BOUNDS_READ[-1][0] == KIND
    t = store.partition("run", 0).tables["t"]  # type: ignore[union-attr]
    assert t.bound.state == {"pushes": pytest.approx(1.0)}
    before = t.state["pushes"].clone()
    with pytest.raises(NonFiniteUpdate, match="refused, nothing changed"):
        push(store, 1, ids, grads * 1e38)
    assert torch.equal(t.state["pushes"], before) and t.last_step == 0

    blind = dataclasses.replace(RECORD, name="blind_sgd",
                                bound=lambda *args: ({"pushes": 0.0}, [], 0.0))
    register_kind(blind)
    try:
        spec = OptimizerSpec("blind_sgd", lr=10.0)
        store = Store()
        store.register("run", 0, 1, 0, [TableSpec("t", NUM_ROWS, DIM, 0, NUM_ROWS)], spec)
        push(store, 0, ids, grads)
        assert not bool(torch.isfinite(push(store, 1, ids, grads * 1e38)).all())
    finally:
        unregister_kind("blind_sgd")


def test_the_reference_trainer_uses_its_torch_kernel(harmonic: OptimizerKind) -> None:
    cfg = TrainConfig.of(local_optimizer=True, optimizer=KIND)
    table = torch.nn.Parameter(torch.zeros(NUM_ROWS, DIM))
    opt = make_sparse_optimizer(cfg, [table])
    assert isinstance(opt, RowOptimizer)
    ids, grads = some_pushes(1)[0]
    table.grad = torch.sparse_coo_tensor(ids.unsqueeze(0), grads, (NUM_ROWS, DIM),
                                         check_invariants=True)
    opt.step()
    want, pushes = torch.zeros(NUM_ROWS, DIM), torch.zeros(NUM_ROWS, 1)
    reference_rows(want, pushes, sparse_optimizer_spec(cfg.optim), ids, grads)
    assert torch.equal(table.detach(), want)


@pytest.mark.timeout(180)
def test_a_one_rank_run_with_it_matches_the_reference(harmonic: OptimizerKind,
                                                      world_of_one: DistContext,
                                                      tmp_path: Path) -> None:
    """The worker's loop with --local-optimizer --optimizer harmonic_sgd (its dense part on
    SGD, the record's counterpart) equals the single-process reference trainer."""
    cfg = TrainConfig.of(local_optimizer=True, optimizer=KIND, weight_decay=0.01, lr=0.5,
                         num_rows=300, batch_size=32, steps=8, dim=8, staleness=0,
                         progress=False, eval_batches=1)
    trainer = Trainer(cfg, world_of_one)
    try:
        trainer.train()
        trainer.dump_state(str(tmp_path / "state.pt"))
    finally:
        trainer.close()
    state = torch.load(tmp_path / "state.pt")
    ref = train_reference(cfg, world_size=1)
    initial = train_reference(cfg, world_size=1, steps=0)
    assert set(state["tables"]) == set(ref.tables)
    for name, rows in state["tables"].items():
        assert not torch.equal(rows, initial.tables[name]), name
        torch.testing.assert_close(rows, ref.tables[name], rtol=1e-5, atol=1e-6)
    assert set(state["dense"]) == set(ref.dense) and state["dense"]
    for key, value in state["dense"].items():
        torch.testing.assert_close(value, ref.dense[key], rtol=1e-5, atol=1e-6)
