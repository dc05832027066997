"""The optimizers beyond Adam (hybridps/optim_kinds.py): adagrad, rowwise_adagrad and
partial_rowwise_adam, each against a torch reference written here, and the places that hold
an optimizer's state by its declared layout (the server's partition, --local-optimizer,
checkpoints, the state budget, the wire, the flags).

The references below are per row and per element, in float32 (0-d tensors), with sqrt
taken in float64 by Python's math.sqrt and rounded once to float32 (the correctly rounded
float32 sqrt, which the native sqrtf is): the state and the deltas are held bitwise. Only
against torch.optim.Adagrad itself are the rows held to 2 ulps at their scale (2.5e-7 for
rows ~N(0, 1)), not bitwise: torch's float32 sqrt is not always correctly rounded (an ulp
off now and then); its sum state is bitwise ours all the same.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import hybridps.optim as optim
from hybridps import native
from hybridps.checkpoint import load_optim_state, optim_file, save_shard, write_manifest
from hybridps.cli import parse_config
from hybridps.errors import Conflict, InvalidArgument, NonFiniteUpdate, ResourceExhausted
from hybridps.optim import OptimizerSpec, apply_update_, step_rows_, undo_rows_
from hybridps.optim_kinds import KINDS, STATE_LAYOUTS, state_bytes_per_element
from hybridps.state_alloc import alloc_row_state
from ps.core.partition import PushChunk, TableSpec
from ps.core.store import Store
from ps.edge.sync_codec import optimizer_args
from worker.config.task_defaults import TASK_DEFAULTS, task_defaults
from worker.config.train_config import Optimizer, TrainConfig
from worker.config.update_kinds import kind_named
from worker.embedding.rows import TableConfig
from worker.embedding.sharded import ShardedEmbedding
from worker.plan import Plan, TableShape, format_plan
from worker.sync.messages import optimizer_message
from worker.updates.source import LocalSparseOptimizer

NEW = ("adagrad", "rowwise_adagrad", "partial_rowwise_adam")
KERNELS = ["torch", pytest.param("native", marks=pytest.mark.skipif(
    native.ext is None, reason="native kernels not built"))]
NUM_ROWS = 40


@pytest.fixture(params=KERNELS)
def kernel(request: pytest.FixtureRequest) -> Iterator[str]:
    before = optim.kernel_info()["requested"]
    optim.set_kernel(request.param)
    yield request.param
    optim.set_kernel(before)


def f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def sqrt32(x: torch.Tensor) -> torch.Tensor:
    return f32(math.sqrt(float(x)))


def mean_sq(g_D: torch.Tensor) -> torch.Tensor:
    """The row's mean of g^2: lane k of 8 adds g_j^2 for j = k, k+8, ... in turn, then
    ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), then / D (the documented order)."""
    lane = [f32(0.0) for _ in range(8)]
    for j, x in enumerate(g_D):
        lane[j % 8] = lane[j % 8] + x * x
    total = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5])
                                                          + (lane[6] + lane[7]))
    return total / f32(float(g_D.numel()))


def ref_adagrad(spec: OptimizerSpec, s_RD: torch.Tensor, ids: torch.Tensor,
                g_UD: torch.Tensor) -> torch.Tensor:
    """s += g^2; delta = (g / (sqrt(s) + eps)) * -lr, element by element."""
    delta = torch.empty_like(g_UD)
    for i, r in enumerate(ids.tolist()):
        for j in range(g_UD.shape[1]):
            g = g_UD[i, j]
            s = s_RD[r, j] + g * g
            s_RD[r, j] = s
            delta[i, j] = (g / (sqrt32(s) + f32(spec.eps))) * f32(-spec.lr)
    return delta


def ref_rowwise_adagrad(spec: OptimizerSpec, s_R1: torch.Tensor, ids: torch.Tensor,
                        g_UD: torch.Tensor) -> torch.Tensor:
    """FBGEMM's EXACT_ROWWISE_ADAGRAD: s += mean(g^2); w -= g * lr / (sqrt(s) + eps)."""
    delta = torch.empty_like(g_UD)
    for i, r in enumerate(ids.tolist()):
        s = s_R1[r, 0] + mean_sq(g_UD[i])
        s_R1[r, 0] = s
        multiplier = f32(spec.lr) / (sqrt32(s) + f32(spec.eps))
        delta[i] = g_UD[i] * -multiplier
    return delta


def ref_partial_rowwise_adam(spec: OptimizerSpec, m_RD: torch.Tensor, v_R1: torch.Tensor,
                             ids: torch.Tensor, g_UD: torch.Tensor, t: int) -> torch.Tensor:
    """FBGEMM's PARTIAL_ROWWISE_ADAM: m = b1 m + (1-b1) g per element, v = b2 v +
    (1-b2) mean(g^2) per row; w -= lr/(1-b1^t) * m / (sqrt(v / (1-b2^t)) + eps)."""
    b1, b2 = spec.beta1, spec.beta2
    delta = torch.empty_like(g_UD)
    for i, r in enumerate(ids.tolist()):
        v = mean_sq(g_UD[i]) * f32(1 - b2) + v_R1[r, 0] * f32(b2)
        v_R1[r, 0] = v
        denom = sqrt32(v / f32(1 - b2**t)) + f32(spec.eps)
        for j in range(g_UD.shape[1]):
            m = m_RD[r, j] * f32(b1) + g_UD[i, j] * f32(1 - b1)
            m_RD[r, j] = m
            delta[i, j] = (m / denom) * f32(-(spec.lr / (1 - b1**t)))
    return delta


def pushes(steps: int, dim: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Unique sorted ids (some rows never touched) and gradients of several magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randperm(NUM_ROWS - 5, generator=gen)[:12].sort().values
        scale = 10.0 ** torch.randint(-3, 3, (12, 1), generator=gen).float()
        out.append((ids, torch.randn(12, dim, generator=gen) * scale))
    return out


# -- the layouts ------------------------------------------------------------------------

def test_each_kind_declares_its_state_layout() -> None:
    assert STATE_LAYOUTS == {
        "adam": (("m", "D"), ("v", "D")), "adamw": (("m", "D"), ("v", "D")), "sgd": (),
        "adagrad": (("sum", "D"),), "rowwise_adagrad": (("sum", 1),),
        "partial_rowwise_adam": (("m", "D"), ("v", 1))}
    assert OptimizerSpec("partial_rowwise_adam").state_widths(64) == (("m", 64), ("v", 1))
    # the server's bytes per element (docs/performance.md's table), at dim 64
    assert {k: state_bytes_per_element(k, 64) for k in KINDS} == {
        "adam": 8.0, "adamw": 8.0, "sgd": 0.0, "adagrad": 4.0, "rowwise_adagrad": 0.0625,
        "partial_rowwise_adam": 4.0625}


def test_every_kind_is_a_flag_and_travels_in_register() -> None:
    assert set(typing.get_args(Optimizer)) == set(KINDS)
    for kind in KINDS:
        spec = OptimizerSpec(kind, lr=0.3, weight_decay=0.0)
        assert OptimizerSpec(**optimizer_args(optimizer_message(spec))) == spec
        assert TrainConfig.of(local_optimizer=True, optimizer=kind).optim.optimizer == kind


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"kind": "adagrad", "weight_decay": 0.1}, "adagrad takes no weight_decay"),
    ({"kind": "lamb"}, "'lamb' is not one of"),
])
def test_spec_refuses(kwargs: dict[str, object], named: str) -> None:
    with pytest.raises(InvalidArgument, match=named):
        OptimizerSpec(**kwargs)  # type: ignore[arg-type]


def test_config_refuses_weight_decay_for_adagrad_and_picks_the_dense_optimizer() -> None:
    def dense(**kwargs: str | float) -> str:
        return TrainConfig.of(local_optimizer=True, **kwargs).optim.dense_kind

    with pytest.raises(ValueError, match=r"weight_decay=0\.1 with optimizer='adagrad'"):
        dense(optimizer="adagrad", weight_decay=0.1)
    assert dense(optimizer="rowwise_adagrad") == "adagrad"
    assert dense(optimizer="partial_rowwise_adam") == "adam"
    assert dense(optimizer="rowwise_adagrad", dense_optimizer="adam") == "adam"


def test_tasks_choose_the_optimizer_and_the_flag_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    def parse(*argv: str) -> TrainConfig:
        return parse_config(TrainConfig, ["--local-optimizer", *argv], environ={},
                            defaults=task_defaults)

    assert parse("--task", "kge", "--data-dir", "/d").optim.optimizer == "adam"
    monkeypatch.setitem(TASK_DEFAULTS, "tables", {"optimizer": "rowwise_adagrad"})
    assert parse("--task", "tables").optim.optimizer == "rowwise_adagrad"
    assert parse("--task", "tables", "--optimizer", "partial_rowwise_adam"
                 ).optim.optimizer == "partial_rowwise_adam"


def test_descriptions_name_what_each_kind_reads() -> None:
    assert OptimizerSpec("rowwise_adagrad", lr=0.1, weight_decay=0.01).describe() == (
        "rowwise_adagrad(lr=0.1, eps=1e-08, weight_decay=0.01)")
    assert OptimizerSpec("adagrad", lr=0.1).describe() == "adagrad(lr=0.1, eps=1e-08)"
    assert OptimizerSpec("partial_rowwise_adam", lr=0.1).describe() == (
        "partial_rowwise_adam(lr=0.1, betas=(0.9, 0.999), eps=1e-08, weight_decay=0)")
    assert OptimizerSpec("adam", lr=0.1).describe() == (
        "adam(lr=0.1, betas=(0.9, 0.999), eps=1e-08)")


@pytest.mark.parametrize(("kind", "floats"), [
    ("adam", 2 * 64), ("partial_rowwise_adam", 64 + 1), ("adagrad", 64),
    ("rowwise_adagrad", 1), ("sgd", 0)])
def test_plan_counts_the_layout(kind: str, floats: int) -> None:
    server = Plan([TableShape("t", 1000, 64)], 2, 2, 10, kind, 1, kind_named("server"))
    assert server.host_state_bytes_per_rank == 500 * (4 * floats + 2)  # two flags a row
    # what the server's Register reserves for those rows
    assert server.host_state_bytes_per_rank == TableSpec("t", 1000, 64, 0, 500).state_bytes(
        kind, master=False)
    local = Plan([TableShape("t", 1000, 64)], 2, 2, 10, kind, 1, kind_named("local"))
    assert local.device_state_bytes == 500 * 4 * floats
    text = format_plan(server)
    assert f"{4 * floats / 64:g} bytes/element at dim 64" in text


# -- the kernels against the references ---------------------------------------------------

@pytest.mark.usefixtures("kernel")
def test_adagrad_is_torch_adagrad() -> None:
    """The sum state bitwise torch.optim.Adagrad's (sparse gradients), the delta bitwise the
    reference above, the rows within 2.5e-7 of torch's (its float32 sqrt)."""
    torch.manual_seed(1)
    emb = torch.nn.Embedding(NUM_ROWS, 6, sparse=True)
    ours = emb.weight.detach().clone()
    spec = OptimizerSpec("adagrad", lr=0.05, eps=1e-8)
    opt = torch.optim.Adagrad(emb.parameters(), lr=spec.lr, eps=spec.eps)
    state = alloc_row_state(spec.state_widths(6), NUM_ROWS)
    ref_sum = torch.zeros(NUM_ROWS, 6)
    target = torch.randn(NUM_ROWS, 6, generator=torch.Generator().manual_seed(2))
    gen = torch.Generator().manual_seed(3)
    for step in range(1, 21):
        idx = torch.randint(0, NUM_ROWS - 5, (14,), generator=gen)  # repeats: summed
        opt.zero_grad()
        ((emb(idx) - target[idx]) ** 2).sum().backward()
        grad = emb.weight.grad
        assert grad is not None
        grad = grad.coalesce()
        ids, rows = grad.indices()[0], grad.values()
        opt.step()
        want = ref_adagrad(spec, ref_sum, ids, rows)
        delta, decay = step_rows_(spec, state, ids, rows.clone(), step)
        assert decay == 1.0 and torch.equal(delta, want)
        apply_update_(ours, ids, delta, decay)
        assert torch.equal(state["sum"], ref_sum)
        assert torch.equal(state["sum"], opt.state[emb.weight]["sum"])
    # rows ~N(0, 1): 2.5e-7 is 2 ulps at |w| in [1, 2) (measured: 1.2e-7, one ulp)
    torch.testing.assert_close(ours, emb.weight.detach(), rtol=0, atol=2.5e-7)


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("dim", [1, 6, 8, 13])
def test_rowwise_adagrad_is_the_reference_bitwise(dim: int) -> None:
    spec = OptimizerSpec("rowwise_adagrad", lr=0.07, eps=1e-6, weight_decay=0.01)
    state = alloc_row_state(spec.state_widths(dim), NUM_ROWS)
    ref_s = torch.zeros(NUM_ROWS, 1)
    for step, (ids, grads) in enumerate(pushes(12, dim), start=1):
        want = ref_rowwise_adagrad(spec, ref_s, ids, grads)
        delta, decay = step_rows_(spec, state, ids, grads, step)
        assert torch.equal(delta, want), step
        assert torch.equal(state["sum"], ref_s), step
        assert decay == 1.0 - spec.lr * spec.weight_decay
    assert state["sum"].shape == (NUM_ROWS, 1) and int((ref_s == 0).sum()) >= 5


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("dim", [1, 6, 8, 13])
def test_partial_rowwise_adam_is_the_reference_bitwise(dim: int) -> None:
    spec = OptimizerSpec("partial_rowwise_adam", lr=0.02, beta1=0.8, beta2=0.95, eps=1e-7,
                         weight_decay=0.05)
    state = alloc_row_state(spec.state_widths(dim), NUM_ROWS)
    ref_m, ref_v = torch.zeros(NUM_ROWS, dim), torch.zeros(NUM_ROWS, 1)
    for step, (ids, grads) in enumerate(pushes(12, dim, seed=4), start=1):
        want = ref_partial_rowwise_adam(spec, ref_m, ref_v, ids, grads, step)
        delta, decay = step_rows_(spec, state, ids, grads, step)
        assert torch.equal(delta, want), step
        assert torch.equal(state["m"], ref_m) and torch.equal(state["v"], ref_v), step
        assert decay == 1.0 - spec.lr * spec.weight_decay


@pytest.mark.skipif(native.ext is None, reason="native kernels not built")
@pytest.mark.parametrize("kind", NEW)
@pytest.mark.parametrize("threads", [1, 3])
def test_native_is_the_torch_path_bitwise_on_large_pushes(kind: str, threads: int) -> None:
    """Enough rows for the thread pool's chunks; the delta into a reused buffer."""
    spec = OptimizerSpec(kind, lr=0.03)
    rows, dim = 5000, 64
    before = optim.kernel_info()["requested"]
    try:
        nat = alloc_row_state(spec.state_widths(dim), rows)
        ref = {k: v.clone() for k, v in nat.items()}
        out = torch.empty(3000 * dim)
        gen = torch.Generator().manual_seed(7)
        for step in range(1, 4):
            ids = torch.randperm(rows, generator=gen)[:3000]  # unsorted, unique
            grads = torch.randn(3000, dim, generator=gen)
            optim.set_kernel("native")
            got, k1 = step_rows_(spec, nat, ids, grads, step, out=out, num_threads=threads)
            assert got.data_ptr() == out.data_ptr()
            optim.set_kernel("torch")
            want, k2 = step_rows_(spec, ref, ids, grads, step)
            assert k1 == k2 and torch.equal(got, want)
            for name in nat:
                assert torch.equal(nat[name], ref[name]), name
    finally:
        optim.set_kernel(before)


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("kind", NEW)
def test_a_non_finite_step_changes_nothing(kind: str) -> None:
    spec = OptimizerSpec(kind, lr=0.1)
    state = alloc_row_state(spec.state_widths(8), NUM_ROWS)
    ids, grads = pushes(1, 8)[0]
    step_rows_(spec, state, ids, grads, 1)
    before = {k: v.clone() for k, v in state.items()}
    huge = grads.clone()
    huge[3, 5] = 3e38  # finite, but its square is not
    with pytest.raises(NonFiniteUpdate):
        step_rows_(spec, state, ids, huge, 2, check_finite=True)
    for name in state:
        assert torch.equal(state[name], before[name]), name
    # a checked step that succeeds can be undone (the master rows turned out non-finite)
    step_rows_(spec, state, ids, grads, 2, check_finite=True)
    assert any(not torch.equal(state[n], before[n]) for n in state)
    assert undo_rows_()
    for name in state:
        assert torch.equal(state[name], before[name]), name


# -- the server's partition, its budget and its checkpoints ----------------------------------

def _push(store: Store, step: int, ids: torch.Tensor, grads: torch.Tensor,
          rank: int = 0) -> torch.Tensor:
    answer = store.open_session().feed(PushChunk("run", rank, 0, step, "t", ids, grads))
    assert answer is not None
    return answer.delta


@pytest.mark.parametrize("kind", NEW)
def test_the_partition_holds_and_counts_the_declared_state(kind: str) -> None:
    spec = OptimizerSpec(kind, lr=0.1)
    table = TableSpec("t", NUM_ROWS, 8, 0, NUM_ROWS)
    store = Store()
    store.register("run", 0, 1, 0, [table], spec)
    t = store.partition("run", 0).tables["t"]  # type: ignore[union-attr]
    assert {n: tuple(x.shape) for n, x in t.state.items()} == {
        n: (NUM_ROWS, w) for n, w in spec.state_widths(8)}
    assert t.state_bytes == table.state_bytes(kind, master=False) == NUM_ROWS * (
        2 + 4 * sum(w for _, w in spec.state_widths(8)))  # two flags a row
    local = alloc_row_state(spec.state_widths(8), NUM_ROWS)
    for step, (ids, grads) in enumerate(pushes(6, 8), start=1):
        delta = _push(store, step - 1, ids, grads)
        want, _ = step_rows_(spec, local, ids, grads, step)
        assert torch.equal(delta, want)
    for name in local:
        assert torch.equal(t.state[name], local[name])
    # the rows-wise kinds keep a few bytes a row: a budget too small for adam admits them
    budget = table.state_bytes("adam", master=False) - 1
    small = Store(max_state_bytes=budget)
    small.register("run", 0, 1, 0, [table], spec)
    with pytest.raises(ResourceExhausted):
        Store(max_state_bytes=budget).register("run", 0, 1, 0, [table],
                                               OptimizerSpec("adam", lr=0.1))


def test_a_gradient_that_would_overflow_is_refused_unchanged() -> None:
    spec = OptimizerSpec("rowwise_adagrad", lr=0.1)
    store = Store()
    store.register("run", 0, 1, 0, [TableSpec("t", NUM_ROWS, 8, 0, NUM_ROWS)], spec)
    ids, grads = pushes(1, 8)[0]
    _push(store, 0, ids, grads)
    t = store.partition("run", 0).tables["t"]  # type: ignore[union-attr]
    before = t.state["sum"].clone()
    with pytest.raises(NonFiniteUpdate, match="refused, nothing changed"):
        _push(store, 1, ids, grads * 1e20)
    assert torch.equal(t.state["sum"], before) and t.last_step == 0


def _manifest(tmp_path: Path, shards: list[tuple[int, object]]) -> None:
    write_manifest(tmp_path, {"step": 2, "tables": {"t": {"num_rows": 10, "dim": 4, "shards": [
        {"rank": r, "row_start": i.row_start, "row_end": i.row_end,  # type: ignore[attr-defined]
         "optim": {"file": i.file, "bytes": i.bytes, "crc32": i.crc32}}  # type: ignore[attr-defined]
        for r, i in shards]}}})


@pytest.mark.parametrize("kind", NEW)
def test_partition_checkpoints_reshard_bitwise_and_refuse_another_optimizer(
        tmp_path: Path, kind: str) -> None:
    spec = OptimizerSpec(kind, lr=0.05)
    old = Store()
    for rank, (lo, hi) in enumerate([(0, 5), (5, 10)]):
        old.register("run", rank, 2, 0, [TableSpec("t", 10, 4, lo, hi)], spec)
    gen = torch.Generator().manual_seed(5)
    for step in range(3):
        for rank, ids in ((0, [0, 3, 4][: step + 1]), (1, [9, 5][: step + 1])):
            _push(old, step, torch.tensor(sorted(ids)), torch.randn(len(ids), 4, generator=gen),
                  rank)
    shards: list[tuple[int, object]] = []
    for rank in (0, 1):
        shards += old.checkpoint("run", [rank], 2, str(tmp_path))
    _manifest(tmp_path, shards)
    held = {n: torch.cat([old.partition("run", r).tables["t"].state[n]  # type: ignore
                          for r in (0, 1)]) for n, _ in spec.state_layout()}
    new = Store()
    for rank, (lo, hi) in enumerate([(0, 3), (3, 10)]):
        new.register("run", rank, 2, 5, [TableSpec("t", 10, 4, lo, hi)], spec,
                     restore=(str(tmp_path), 2))
        t = new.partition("run", rank).tables["t"]  # type: ignore[union-attr]
        for name, whole in held.items():
            assert torch.equal(t.state[name], whole[lo:hi]), name
        assert t.adam_step == 3 and t.last_step == 2
    other = "adam"
    with pytest.raises(Conflict) as refused:
        Store().register("run", 0, 1, 0, [TableSpec("t", 10, 4, 0, 10)],
                         OptimizerSpec(other, lr=0.05), restore=(str(tmp_path), 2))
    message = str(refused.value)
    assert "\n" not in message
    assert f"saved with optimizer {spec.describe()}" in message
    assert f"this run uses {OptimizerSpec(other, lr=0.05).describe()}" in message


def test_adam_checkpoints_of_before_the_layouts_still_load(tmp_path: Path) -> None:
    """An optim file as written before there were other optimizers (m, v, master by name,
    the optimizer dict in its meta) loads into adam's layout unchanged."""
    adam = dataclasses.asdict(OptimizerSpec("adam", lr=0.1))
    m, v = torch.randn(10, 4), torch.rand(10, 4)
    info = save_shard(tmp_path, optim_file("t", 0), kind="optim", table="t", rank=0,
                      num_rows=10, dim=4, row_start=0, row_end=10,
                      tensors={"m": m, "v": v, "master": None},
                      meta={"adam_step": 7, "last_step": 6, "incarnation": 0,
                            "optimizer": adam})
    write_manifest(tmp_path, {"step": 6, "tables": {"t": {"num_rows": 10, "dim": 4, "shards": [
        {"rank": 0, "row_start": 0, "row_end": 10,
         "optim": {"file": info.file, "bytes": info.bytes, "crc32": info.crc32}}]}}})
    state = load_optim_state(tmp_path, table="t", num_rows=10, dim=4, row_start=2, row_end=9,
                             step=6, optimizer=adam)
    assert state.adam_step == 7 and set(state.state) == {"m", "v"}
    assert state.m is not None and torch.equal(state.m, m[2:9])
    assert state.v is not None and torch.equal(state.v, v[2:9])
    with pytest.raises(Conflict, match=r"saved with optimizer adam\(lr=0.1"):
        load_optim_state(tmp_path, table="t", num_rows=10, dim=4, row_start=0, row_end=10,
                         step=6, optimizer=dataclasses.asdict(OptimizerSpec("adagrad")))


# -- --local-optimizer --------------------------------------------------------------------

@pytest.mark.parametrize("kind", NEW)
def test_local_optimizer_holds_the_layout_like_the_server(kind: str) -> None:
    spec = OptimizerSpec(kind, lr=0.05, weight_decay=0.0)
    emb = ShardedEmbedding([TableConfig("t", NUM_ROWS, 8)], seed=1, init_std=0.1)
    local = LocalSparseOptimizer(emb, spec)
    assert {n: tuple(x.shape) for n, x in local.state["t"].items()} == {
        n: (NUM_ROWS, w) for n, w in spec.state_widths(8)}
    store = Store()
    store.register("run", 0, 1, 0, [TableSpec("t", NUM_ROWS, 8, 0, NUM_ROWS)], spec)
    for step, (ids, grads) in enumerate(pushes(5, 8)):
        local.push(step, {"t": (ids, grads)})
        want = _push(store, step, ids, grads)
        (update,), _ = local.take(step)
        assert torch.equal(update.delta_UD, want)
    t = store.partition("run", 0).tables["t"]  # type: ignore[union-attr]
    for name, x in local.state["t"].items():
        assert torch.equal(x, t.state[name])
