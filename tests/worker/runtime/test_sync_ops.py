"""The training loop asks the host for no device value outside the named sync points,
checked on the CPU (tests/testing/cpu_sync_debug.py): the calls that synchronise on CUDA, seen by a
dispatch mode, on the torch kernels a CUDA device runs: what CUDA's own sync debug mode
(gpu_check/check.py, stage sync_debug) would find, without a GPU."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hybridps import optim, pooled_bags
from tests.testing.cpu_sync_debug import SyncingOps, syncs_on_cuda
from tests.testing.spawn_helpers import run_ranks
from worker.config.train_config import TrainConfig
from worker.runtime.device_copy import sync_point
from worker.runtime.dist import DistContext, destroy_distributed, init_distributed
from worker.train.trainer import Trainer

aten = torch.ops.aten


def test_the_calls_that_synchronise_on_cuda() -> None:
    ids = torch.arange(6)
    mask = ids > 2
    assert syncs_on_cuda(aten._local_scalar_dense.default, (ids[0],), {})
    assert syncs_on_cuda(aten.nonzero.default, (ids,), {})
    assert syncs_on_cuda(aten.index.Tensor, (ids, [mask]), {})
    assert not syncs_on_cuda(aten.index.Tensor, (ids, [ids[:2]]), {})
    assert syncs_on_cuda(aten.index_put_.default, (ids, [mask], ids[:3]), {})
    assert syncs_on_cuda(aten.repeat_interleave.Tensor, (ids,), {})
    assert not syncs_on_cuda(aten.repeat_interleave.Tensor, (ids,), {"output_size": 15})
    assert not syncs_on_cuda(aten.searchsorted.Tensor, (ids, ids), {})
    assert not syncs_on_cuda(aten.index_select.default, (ids, 0, ids[:2]), {})


def test_a_read_is_noted_where_it_is_made_and_not_inside_a_sync_point() -> None:
    ids = torch.arange(6)
    with SyncingOps() as watch:
        kept = ids[ids > 2]  # a mask index: its size comes from the values
        with sync_point("log_loss"):
            float(kept.sum())  # named: allowed
        int(ids.max())
    sites = watch.sites
    assert len(sites) == 2, sites
    assert all(site.startswith("tests/worker/runtime/test_sync_ops.py:") for site in sites), sites
    ops = sorted(op for entry in sites.values() for op in entry["ops"])
    assert ops == ["aten._local_scalar_dense.default", "aten.index.Tensor"], ops
    assert all(entry["count"] == 1 for entry in sites.values())


def test_a_copy_to_the_host_is_noted() -> None:
    ids = torch.arange(6)
    with SyncingOps() as watch:
        ids.tolist()
        ids.cpu()
        ids.numpy()  # a CPU tensor's own memory: no copy on any device
    ops = sorted(op for entry in watch.sites.values() for op in entry["ops"])
    assert ops == ["Tensor.cpu", "Tensor.tolist"], ops


def test_host_data_made_straight_on_a_device_is_noted() -> None:
    ids = torch.arange(6)
    with SyncingOps() as watch:
        torch.tensor([1, 2])  # on the host: a pinned copy can follow (device_copy.to_device)
        ids.new_tensor([3], device="cpu")
        torch.tensor([1, 2], device=ids.device)  # on CUDA: a blocking copy
        ids.new_tensor([3])  # ids' device
        ids.new_full((1,), 3)  # a fill on the device: no copy
    ops = sorted(op for entry in watch.sites.values() for op in entry["ops"])
    assert ops == ["Tensor.new_tensor to a device", "torch.tensor to a device"], ops


def test_the_host_side_step_count_of_torch_optimizers_is_not_noted() -> None:
    weight = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([weight], lr=0.1)
    weight.grad = torch.ones(3)
    with SyncingOps() as watch:
        opt.step()
        opt.step()
    assert watch.sites == {}


@pytest.fixture
def world_of_one(monkeypatch: pytest.MonkeyPatch) -> Iterator[DistContext]:
    for var in ("MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    kernels = optim.kernel_name(), pooled_bags.pool_kernel_name()
    optim.set_kernel("torch")  # what a CUDA device runs (the native kernels are the CPU's)
    pooled_bags.set_pool_kernel("torch")
    ctx = init_distributed("cpu")
    try:
        yield ctx
    finally:
        destroy_distributed()
        optim.set_kernel(kernels[0])
        pooled_bags.set_pool_kernel(kernels[1])


def _watched_run(ctx: DistContext, **settings: Any) -> dict[str, Any]:
    cfg = TrainConfig.of(**{"num_rows": 2000, "batch_size": 64, "steps": 8, "dim": 8,
                            "progress": False, "eval_batches": 1, "log_every": 4, **settings})
    trainer = Trainer(cfg, ctx)
    try:
        with SyncingOps() as watch:
            trainer.train()
    finally:
        trainer.close()
    return watch.sites


LOOPS = {
    "local K=0": {"local_optimizer": True, "staleness": 0},
    "local K=1 predict": {"local_optimizer": True, "staleness": 1},
    "local K=2 predict": {"local_optimizer": True, "staleness": 2},
    "local K=1 bf16 rows": {"local_optimizer": True, "staleness": 1, "row_dtype": "bf16"},
    "local K=1 dlrm": {"local_optimizer": True, "staleness": 1, "task": "dlrm"},
    "local K=1 tables": {"local_optimizer": True, "staleness": 1, "task": "tables"},
    "local K=1 pipeline": {"local_optimizer": True, "staleness": 1, "pipeline": True},
    "local K=2 dynamic ids": {  # refusals, evictions, page-ins, bags
        "local_optimizer": True, "staleness": 2, "task": "tables", "num_rows": 300,
        "batch_size": 32, "tables": "user:40:dynamic:lfu:expire=6,ad:30:3:dynamic:threshold=2,"
                                    "s:50"},
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("loop", list(LOOPS))
def test_the_loop_reads_no_device_value_outside_the_named_sync_points(
        world_of_one: DistContext, loop: str) -> None:
    sites = _watched_run(world_of_one, **LOOPS[loop])
    assert sites == {}, f"{loop}: calls that synchronise on CUDA: {sites}"


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("staleness", [0, 1])
def test_the_loop_with_a_server_reads_no_device_value(
        world_of_one: DistContext, ps_server: str, staleness: int) -> None:
    sites = _watched_run(world_of_one, ps=ps_server, staleness=staleness)
    assert sites == {}, f"server K={staleness}: calls that synchronise on CUDA: {sites}"


def _two_rank_scenario(ctx: DistContext, loop: str) -> None:
    optim.set_kernel("torch")
    pooled_bags.set_pool_kernel("torch")
    sites = _watched_run(ctx, **LOOPS[loop])
    assert sites == {}, f"rank {ctx.rank}, {loop}: calls that synchronise on CUDA: {sites}"


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("loop", ["local K=1 predict", "local K=1 dlrm",
                                  "local K=2 dynamic ids"])
def test_two_ranks_read_no_device_value_outside_the_named_sync_points(loop: str) -> None:
    """World size 2: the ids' all_to_all sizes (input_dist) are the one more named place;
    a multi-GPU run's other syncs would show here first."""
    run_ranks("tests.worker.runtime.test_sync_ops:_two_rank_scenario", 2, loop)
