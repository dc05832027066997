"""--row-dtype bf16: bf16 rows on the device, an fp32 master on the shard server.

Unit: the device rows really are bf16 (2 bytes per element) and lookups/gradients
are fp32; the server's master-rows math equals torch.optim.SparseAdam on an fp32
copy of the rows (bitwise on the torch kernels, to ~1 ulp on the native ones) and
answers those rows rounded to bf16; seeding rules; the master is checkpointed and
restored at another world size (and seeded from the rows of an fp32 checkpoint);
--local-optimizer keeps the same fp32 master in-process; a bad --row-dtype is
refused naming the value.

End to end (real server subprocess, 2 torchrun ranks): a bf16 run reaches the eval
loss of the fp32 run within EVAL_LOSS_TOLERANCE (measured gap: ~4e-4); a bf16
checkpoint + resume ends bitwise equal to the uninterrupted bf16 run; fp32 rows
resumed from a bf16 checkpoint start from its fp32 master.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hybridps import optim
from hybridps.checkpoint import read_shard, save_shard, step_dir, write_manifest
from hybridps.errors import Conflict, InvalidArgument, NotSeeded
from hybridps.optim import OptimizerSpec
from hybridps.v1 import shard_pb2
from ps.admin import get_shard_stats
from ps.core.partition import PushChunk, TableSpec
from ps.core.store import Store
from tests.testing.chains import composed_like
from tests.testing.helpers import PsServer
from worker.config.train_config import TrainConfig
from worker.embedding.rows import TableConfig, init_rows
from worker.embedding.sharded import ShardedEmbedding
from worker.sync.client import ShardClient, SyncError
from worker.updates.source import LocalSparseOptimizer

REPO = Path(__file__).resolve().parents[3]
MAIN = str(REPO / "worker" / "main.py")
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
COMMON = ["--num-rows", "2000", "--dim", "8", "--batch-size", "32", "--log-every", "10",
          "--eval-batches", "4", "--progress", "false"]
ACCURACY_STEPS = 150
# |eval loss (bf16 rows) - eval loss (fp32 rows)| after ACCURACY_STEPS steps; the loss
# itself falls by ~0.06 over the run, the measured gap is ~4e-4.
EVAL_LOSS_TOLERANCE = 0.01
KERNELS = ["torch"] + (["native"] if optim._native_module()[0] is not None else [])


@pytest.fixture
def kernel(request: pytest.FixtureRequest) -> Iterator[str]:
    before = optim.kernel_name()
    optim.set_kernel(request.param)
    try:
        yield request.param
    finally:
        optim.set_kernel(before if before == "torch" else "auto")


# -- config --------------------------------------------------------------------------------

@pytest.mark.e2e
def test_bad_row_dtype_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"row_dtype='fp16' is not one of fp32, bf16"):
        TrainConfig.of(local_optimizer=True, row_dtype="fp16")
    assert TrainConfig.of(local_optimizer=True).optim.row_dtype == "fp32"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    proc = subprocess.run([sys.executable, MAIN, "--local-optimizer", "--row-dtype", "fp8"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 2, proc.stderr
    assert "row_dtype='fp8'" in proc.stderr
    proc = subprocess.run([sys.executable, MAIN, "--local-optimizer"], cwd=REPO,
                          env={**env, "HYBRIDPS_ROW_DTYPE": "int8"}, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "row_dtype='int8'" in proc.stderr


# -- the device rows ----------------------------------------------------------------------

TABLES = [TableConfig("a", 300, 6), TableConfig("b", 70000, 4)]  # b spans two init chunks


def test_bf16_rows_take_two_bytes_per_element() -> None:
    fp32 = ShardedEmbedding(TABLES, seed=3, init_std=0.1)
    bf16 = ShardedEmbedding(TABLES, seed=3, init_std=0.1, row_dtype=torch.bfloat16)
    for t in TABLES:
        w = bf16.weights[t.name]
        assert w.dtype == torch.bfloat16 and w.element_size() == 2
        assert bf16.device_bytes()[t.name] == t.num_rows * t.dim * 2
        assert fp32.device_bytes()[t.name] == t.num_rows * t.dim * 4
        assert torch.equal(w.data, fp32.weights[t.name].data.to(torch.bfloat16))
    with pytest.raises(ValueError, match="row dtype"):
        ShardedEmbedding(TABLES, row_dtype=torch.float16)

    ids = torch.tensor([[1, 5], [5, 299]])
    rows = bf16.lookup("a", ids)
    bag = bf16.lookup_bag("b", torch.tensor([0, 69999, 3]), torch.tensor([0, 2]), "mean")
    assert rows.dtype == torch.float32 and bag.dtype == torch.float32
    (rows.sum() + bag.pow(2).sum()).backward()
    grads = bf16.pop_grads(scale=0.5)
    ids_a, grads_a = grads["a"]
    assert grads_a.dtype == torch.float32 and ids_a.tolist() == [1, 5, 299]
    assert torch.equal(grads_a, torch.tensor([[0.5] * 6, [1.0] * 6, [0.5] * 6]))
    assert grads["b"][1].dtype == torch.float32 and grads["b"][0].tolist() == [0, 3, 69999]

    new = torch.randn(2, 6)
    bf16.set_rows("a", torch.tensor([7, 2]), new)
    assert torch.equal(bf16.weights["a"].data[[7, 2]], new.to(torch.bfloat16))


def test_initial_row_blocks_are_the_fp32_init_and_checked() -> None:
    emb = ShardedEmbedding(TABLES, rank=1, world_size=2, seed=3, init_std=0.1,
                           row_dtype=torch.bfloat16)
    start, end = emb.ranges["b"]
    blocks = list(emb.initial_row_blocks("b"))
    assert [lo for lo, _ in blocks] == [start, 65536]  # one block per init chunk
    got = torch.cat([rows for _, rows in blocks])
    assert got.dtype == torch.float32
    assert torch.equal(got, init_rows(70000, 4, start, end, seed=3, table_index=1,
                                      init_std=0.1))
    emb.weights["b"].data[0, 0] += 1  # the rows are no longer the init rounded to bf16
    with pytest.raises(RuntimeError, match="not the initial rows"):
        list(emb.initial_row_blocks("b"))


# -- the server's master rows ---------------------------------------------------------

SPEC = TableSpec("t", 50, 6, 10, 40)  # rank 1's rows [10, 40) of a 50 x 6 table


def _bf16_store(opt: OptimizerSpec) -> Store:
    store = Store()
    store.register("run", 1, 2, 0, [SPEC], opt, row_dtype=torch.bfloat16)
    return store


def _pushes(steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        n = int(torch.randint(1, 20, (1,), generator=gen))
        ids = torch.randperm(30, generator=gen)[:n] + 10
        out.append((ids, torch.randn(n, 6, generator=gen)))
    return out


@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
def test_server_master_is_fp32_sparse_adam(kernel: str) -> None:
    opt = OptimizerSpec(lr=0.05)
    store = _bf16_store(opt)
    session = store.open_session()
    init = torch.randn(30, 6, generator=torch.Generator().manual_seed(1))
    pushes = _pushes(8)
    with pytest.raises(NotSeeded, match="0 of its 30 rows are seeded"):
        session.feed(PushChunk("run", 1, 0, 0, "t", *pushes[0]))
    with pytest.raises(InvalidArgument, match="gap"):
        store.seed_rows("run", 1, 0, "t", 25, init[15:])
    assert store.seed_rows("run", 1, 0, "t", 10, init[:15]) == (15, 30)
    assert store.seed_rows("run", 1, 0, "t", 10, init[:15]) == (15, 30)  # a retry
    with pytest.raises(NotSeeded):
        session.feed(PushChunk("run", 1, 0, 0, "t", *pushes[0]))
    assert store.seed_rows("run", 1, 0, "t", 25, init[15:]) == (30, 30)

    ref = torch.nn.Parameter(init.clone())
    adam = torch.optim.SparseAdam([ref], lr=opt.lr, betas=(opt.beta1, opt.beta2),
                                  eps=opt.eps)
    answers = []
    for step, (ids, grads) in enumerate(pushes):
        answer = session.feed(PushChunk("run", 1, 0, step, "t", ids, grads))
        assert answer is not None and answer.rows and answer.decay == 0.0
        assert answer.delta.dtype == torch.bfloat16 and torch.equal(answer.ids, ids)
        answers.append(answer)
        ref.grad = torch.sparse_coo_tensor((ids - 10)[None], grads, ref.shape,
                                           check_invariants=True)
        adam.step()
        expect = ref.detach()[ids - 10].to(torch.bfloat16)
        if kernel == "torch":
            assert torch.equal(answer.delta, expect)
        else:  # the native adam delta may differ in the last bits of fp32
            torch.testing.assert_close(answer.delta.float(), expect.float(), rtol=1e-2,
                                       atol=1e-2)
    master = store.partition("run", 1).tables["t"].master  # type: ignore[union-attr]
    assert master is not None
    if kernel == "torch":
        assert torch.equal(master, ref.detach())
    else:
        torch.testing.assert_close(master, ref.detach(), rtol=1e-6, atol=1e-6)

    # exactly-once: a re-sent push is answered from the cache, not applied again
    again = store.open_session().feed(PushChunk("run", 1, 0, 7, "t", *pushes[7]))
    assert again is not None and again.duplicate and again.rows
    assert torch.equal(again.delta, answers[7].delta)
    with pytest.raises(Conflict, match="can no longer be seeded"):
        store.seed_rows("run", 1, 0, "t", 10, init[:1])
    with pytest.raises(Conflict, match="row dtype"):
        store.register("run", 1, 2, 0, [SPEC], opt)  # same partition with fp32 rows

    row = store.stats("run").partitions[0]
    assert row.master_bytes == 30 * 6 * 4 and row.row_dtype == "bf16"
    assert row.state_bytes == 30 * 6 * 8 + 2 * 30  # m, v, the two flags: the master is apart
    assert store.stats("run").master_bytes_total == 30 * 6 * 4


def test_fp32_partitions_hold_no_master_and_refuse_seeding() -> None:
    store = Store()
    store.register("run", 0, 1, 0, [TableSpec("t", 4, 2, 0, 4)], OptimizerSpec())
    with pytest.raises(InvalidArgument, match="holds no master rows"):
        store.seed_rows("run", 0, 0, "t", 0, torch.zeros(4, 2))
    answer = store.open_session().feed(
        PushChunk("run", 0, 0, 0, "t", torch.tensor([1]), torch.ones(1, 2)))
    assert answer is not None and not answer.rows and answer.decay == 1.0
    assert store.stats().partitions[0].master_bytes == 0
    with pytest.raises(InvalidArgument, match="row dtype"):
        Store().register("run", 0, 1, 0, [TableSpec("t", 4, 2, 0, 4)], OptimizerSpec(),
                         row_dtype=torch.float16)


def _manifest(directory: Path, shards: list[tuple[int, object]],
              rows: dict[int, object] | None = None) -> None:
    entries = []
    for rank, info in shards:
        entry = {"rank": rank, "row_start": info.row_start, "row_end": info.row_end,  # type: ignore[attr-defined]
                 "optim": {"file": info.file, "bytes": info.bytes,  # type: ignore[attr-defined]
                           "crc32": info.crc32}}  # type: ignore[attr-defined]
        if rows is not None:
            r = rows[rank]
            entry["rows"] = {"file": r.file, "bytes": r.bytes, "crc32": r.crc32}  # type: ignore[attr-defined]
        entries.append(entry)
    write_manifest(directory, {"step": 2, "tables": {"t": {"num_rows": 50, "dim": 6,
                                                            "shards": entries}}})


def test_master_checkpoint_restores_at_another_world_size(tmp_path: Path) -> None:
    opt = OptimizerSpec()
    old = Store()
    bounds = [(0, 10), (10, 50)]
    full = torch.randn(50, 6)
    for rank, (lo, hi) in enumerate(bounds):
        old.register("run", rank, 2, 0, [TableSpec("t", 50, 6, lo, hi)], opt,
                     row_dtype=torch.bfloat16)
        old.seed_rows("run", rank, 0, "t", lo, full[lo:hi])
    for step, (ids, grads) in enumerate(_pushes(3)):
        for rank, (lo, hi) in enumerate(bounds):
            keep = (ids >= lo) & (ids < hi)
            old.open_session().feed(PushChunk("run", rank, 0, step, "t", ids[keep],
                                              grads[keep]))
    shards = []
    for rank in (0, 1):
        shards += old.checkpoint("run", [rank], 2, str(tmp_path))
    saved = read_shard(tmp_path / shards[1][1].file)
    assert saved["tensors"]["master"].dtype == torch.float32
    _manifest(tmp_path, shards)
    master_old = torch.cat([old.partition("run", r).tables["t"].master  # type: ignore
                            for r in (0, 1)])
    assert not torch.equal(master_old, full)
    new = Store()
    for rank, (lo, hi) in enumerate([(0, 20), (20, 35), (35, 50)]):
        new.register("run", rank, 3, 1, [TableSpec("t", 50, 6, lo, hi)], opt,
                     restore=(str(tmp_path), 2), row_dtype=torch.bfloat16)
        t = new.partition("run", rank).tables["t"]  # type: ignore[union-attr]
        assert t.master is not None and torch.equal(t.master, master_old[lo:hi])
        assert t.rows_seeded == hi - lo and t.adam_step == 3
        answer = new.open_session().feed(PushChunk("run", rank, 1, 3, "t",
                                                   torch.tensor([lo]), torch.ones(1, 6)))
        assert answer is not None and answer.rows  # restored = seeded: pushes go on


def test_fp32_checkpoint_seeds_the_master_from_its_rows(tmp_path: Path) -> None:
    """A checkpoint of fp32 rows (no master saved) resumed with bf16 rows."""
    opt = OptimizerSpec()
    old = Store()
    old.register("run", 0, 1, 0, [TableSpec("t", 50, 6, 0, 50)], opt)
    for step, (ids, grads) in enumerate(_pushes(3)):
        old.open_session().feed(PushChunk("run", 0, 0, step, "t", ids, grads))
    shards = old.checkpoint("run", [0], 2, str(tmp_path))
    weight = torch.randn(50, 6)
    rows = save_shard(tmp_path, "rows/t.r00000.pt", kind="rows", table="t", rank=0,
                      num_rows=50, dim=6, row_start=0, row_end=50, tensors={"weight": weight})
    _manifest(tmp_path, shards, {0: rows})
    new = Store()
    new.register("run", 0, 1, 1, [TableSpec("t", 50, 6, 0, 50)], opt,
                 restore=(str(tmp_path), 2), row_dtype=torch.bfloat16)
    t = new.partition("run", 0).tables["t"]  # type: ignore[union-attr]
    assert t.master is not None and torch.equal(t.master, weight)


def test_bf16_worker_refuses_a_server_without_master_rows() -> None:
    """A server that registers another row dtype than asked keeps no master rows: refused."""
    emb = ShardedEmbedding([TableConfig("t", 8, 2)], row_dtype=torch.bfloat16)
    client = ShardClient("127.0.0.1:1", run_id="r", rank=0, world_size=1,
                         tables=list(emb.tables.values()), ranges=emb.ranges,
                         optimizer=OptimizerSpec(), timeout_s=1.0, max_chunk_bytes=1 << 20,
                         row_dtype=torch.bfloat16, initial_rows=emb.initial_row_blocks)
    # (never started: a call would fail otherwise; the answer is refused before any)
    response = shard_pb2.RegisterResponse(server_id="old")
    response.tables.add(name="t", rows_held=8, last_step=-1, created=True)
    with pytest.raises(SyncError, match="keeps no fp32 master rows"):
        client._seed_master(response, first=True)
    with pytest.raises(ValueError, match="needs initial_rows"):
        ShardClient("127.0.0.1:1", run_id="r", rank=0, world_size=1,
                    tables=list(emb.tables.values()), ranges=emb.ranges,
                    optimizer=OptimizerSpec(), timeout_s=1.0, max_chunk_bytes=1 << 20,
                    row_dtype=torch.bfloat16)


# -- --local-optimizer ------------------------------------------------------------------

def test_local_optimizer_keeps_an_fp32_master() -> None:
    opt = OptimizerSpec(lr=0.05)
    emb = ShardedEmbedding([TableConfig("t", 60, 6)], rank=1, world_size=2, seed=2,
                           init_std=0.1, row_dtype=torch.bfloat16)
    local = LocalSparseOptimizer(emb, opt)
    master = local.masters["t"]
    assert master.dtype == torch.float32
    m, v = local.moments["t"]
    assert m is not None and v is not None and m.dtype == v.dtype == torch.float32
    ref = torch.nn.Parameter(init_rows(60, 6, 30, 60, seed=2, table_index=0, init_std=0.1))
    assert torch.equal(master, ref.detach())
    adam = torch.optim.SparseAdam([ref], lr=opt.lr)
    for step, (ids, grads) in enumerate(_pushes(4, seed=5)):
        local.push(step, {"t": (ids + 20, grads)})  # global ids in the owned [30, 60)
        ref.grad = torch.sparse_coo_tensor((ids - 10)[None], grads, ref.shape,
                                           check_invariants=True)
        adam.step()
    torch.testing.assert_close(master, ref.detach(), rtol=1e-6, atol=1e-6)
    updates, _ = local.take(3)
    assert all(u.rows and u.delta_UD.dtype == torch.bfloat16 for u in updates)
    for u in updates:
        emb.set_rows(u.table, u.ids_U, u.delta_UD)
    touched = torch.unique(torch.cat([u.ids_U for u in updates])) - 30
    assert torch.equal(emb.weights["t"].data[touched], master[touched].to(torch.bfloat16))


# -- end to end ---------------------------------------------------------------------------

def run_worker(args: list[str], timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node", "2", MAIN, *COMMON, *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    if proc.returncode != 0:
        raise AssertionError(f"worker failed ({proc.returncode}):\n{proc.stdout}\n"
                             f"{proc.stderr[-6000:]}")
    return proc


@pytest.fixture(scope="module")
def accuracy_runs(server: PsServer, tmp_path_factory: pytest.TempPathFactory
                  ) -> dict[str, dict[str, object]]:
    d = tmp_path_factory.mktemp("accuracy")
    out: dict[str, dict[str, object]] = {}
    for name, args in [("fp32", ["--ps", server.address, "--run-id", "acc-fp32"]),
                       ("bf16", ["--ps", server.address, "--run-id", "acc-bf16",
                                 "--row-dtype", "bf16"]),
                       ("local-bf16", ["--local-optimizer", "--row-dtype", "bf16"])]:
        run_worker([*args, "--steps", str(ACCURACY_STEPS), "--results",
                    str(d / f"{name}.json"), "--dump-state", str(d / f"{name}.pt")])
        out[name] = {"results": json.loads((d / f"{name}.json").read_text()),
                     "state": torch.load(d / f"{name}.pt")}
    return out


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_bf16_rows_reach_the_fp32_eval_loss(accuracy_runs: dict[str, dict[str, object]],
                                            server: PsServer) -> None:
    fp32 = accuracy_runs["fp32"]["results"]
    assert isinstance(fp32, dict)
    base = fp32["eval"]["loss"]
    assert fp32["final_loss"] < fp32["first_loss"] - 0.03  # it trained
    for name in ("bf16", "local-bf16"):
        res = accuracy_runs[name]["results"]
        assert isinstance(res, dict) and res["config"]["row_dtype"] == "bf16"
        gap = abs(res["eval"]["loss"] - base)
        assert gap <= EVAL_LOSS_TOLERANCE, (name, res["eval"], fp32["eval"])
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16),
                        ("local-bf16", torch.bfloat16)):
        state = accuracy_runs[name]["state"]
        assert isinstance(state, dict)
        assert {t.dtype for t in state["tables"].values()} == {dtype}, name
    stats = get_shard_stats(server.address, run_id="acc-bf16")
    assert stats.master_bytes_total == sum(p.rows_held * 8 * 4 for p in stats.partitions)
    assert {p.row_dtype for p in stats.partitions} == {"bf16"}
    assert get_shard_stats(server.address, run_id="acc-fp32").master_bytes_total == 0


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_bf16_resume_equals_uninterrupted(server: PsServer, tmp_path: Path) -> None:
    ps = ["--ps", server.address, "--row-dtype", "bf16", "--checkpoint-every", "10"]
    run_worker([*ps, "--run-id", "bf16-straight", "--steps", "20", "--checkpoint-dir",
                str(tmp_path / "ck_a"), "--dump-state", str(tmp_path / "straight.pt")])
    run_worker([*ps, "--run-id", "bf16-first", "--steps", "10", "--checkpoint-dir",
                str(tmp_path / "ck_b")])
    run_worker([*ps, "--run-id", "bf16-resumed", "--steps", "20", "--checkpoint-dir",
                str(tmp_path / "ck_b"), "--resume", "--dump-state", str(tmp_path / "resumed.pt")])
    a, b = torch.load(tmp_path / "straight.pt"), torch.load(tmp_path / "resumed.pt")
    for part in ("tables", "dense"):
        assert set(a[part]) == set(b[part])
        for key in a[part]:
            assert torch.equal(a[part][key], b[part][key]), f"{part} {key} differs"
    for rank in (0, 1):
        name = f"optim/user.r{rank:05d}.pt"
        # ck_a's step 19 is an incremental link; ck_b's the resumed run's first, full one
        sb = read_shard(step_dir(tmp_path / "ck_b", 19) / name)
        sa = composed_like(step_dir(tmp_path / "ck_a", 19), 19, sb, master=True)
        assert sa.master is not None
        assert torch.equal(sa.master, sb["tensors"]["master"])
        rows = read_shard(step_dir(tmp_path / "ck_b", 19) / f"rows/user.r{rank:05d}.pt")
        # the device rows are the master rounded to bf16
        assert torch.equal(rows["tensors"]["weight"],
                           sb["tensors"]["master"].to(torch.bfloat16).float())
    # fp32 rows resumed from a bf16 checkpoint start from the fp32 master, not the rounding
    run_worker(["--ps", server.address, "--run-id", "fp32-from-bf16", "--steps", "10",
                "--resume-from", str(step_dir(tmp_path / "ck_b", 9)), "--checkpoint-dir",
                str(tmp_path / "ck_c"), "--dump-state", str(tmp_path / "fp32.pt")])
    masters = torch.cat([read_shard(step_dir(tmp_path / "ck_b", 9) / f"optim/user.r{r:05d}.pt")
                         ["tensors"]["master"] for r in (0, 1)])
    fp32_rows = torch.load(tmp_path / "fp32.pt")["tables"]["user"]
    assert fp32_rows.dtype == torch.float32 and torch.equal(fp32_rows, masters)
