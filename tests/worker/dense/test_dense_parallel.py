"""--dense-parallel auto|fsdp|hsdp|ddp, --compile, --clip-grad-norm, --precision
(worker/dense/parallel.py).

Every equivalence test trains the synthetic task (small tables, 12 steps) with
torchrun at --staleness 0 and compares the dumped tables and dense weights
with tests/testing/reference_trainer.py (one process, global-mean loss) like
tests/worker/train/test_worker_e2e.py: fsdp (local optimizer and a real shard server),
hsdp on 4 CPU ranks as 2 nodes x 2, ddp with mean and with sum reduction
(the sum reference trains world_size x the global mean loss), torch.compile
against the same eager reference, clipping against clip_grad_norm_ on the
un-sharded reference (the reported pre-clip norm too). fp16 (GradScaler,
skipped steps push no rows) is checked in-process on a world of one and by a
short run; bad combinations must exit non-zero naming the numbers.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.testing.reference_trainer import ReferenceResult, train_reference
from tests.worker.train.test_worker_e2e import MAIN, REPO, ROWS_ATOL, run_worker
from worker.config.train_config import TrainConfig
from worker.dense.parallel import (
    DenseParallelError,
    build_dense_parallel,
    hsdp_mesh_shape,
    mixed_precision_policy,
)
from worker.embedding.rows import TableConfig
from worker.embedding.sharded import ShardedEmbedding

STEPS = 12
SMALL = ["--num-rows", "2000", "--batch-size", "32", "--steps", str(STEPS), "--dim", "8",
         "--log-every", "4", "--eval-batches", "1", "--progress", "false", "--staleness", "0"]
CLIP = 0.05  # binding: the synthetic task's dense grad norm is ~0.1-0.3 over these steps


def small_config(**overrides: Any) -> TrainConfig:
    base: dict[str, Any] = {"local_optimizer": True, "num_rows": 2000, "batch_size": 32,
                            "steps": STEPS, "dim": 8, "staleness": 0}
    return TrainConfig.of(**{**base, **overrides})


def run(tmp_path: Path, args: list[str], nproc: int = 2) -> tuple[dict[str, Any], dict[str, Any]]:
    """torchrun the worker; (dumped state, results json)."""
    if "--ps" not in args:
        args = ["--local-optimizer", *args]
    run_worker([*SMALL, "--dump-state", str(tmp_path / "state.pt"), "--results",
                str(tmp_path / "r.json"), *args], nproc=nproc)
    return (torch.load(tmp_path / "state.pt"),
            json.loads((tmp_path / "r.json").read_text()))


def assert_matches(state: dict[str, Any], ref: ReferenceResult, cfg: TrainConfig,
                   world: int) -> None:
    initial = train_reference(cfg, world_size=world, steps=0)
    assert state["world_size"] == world
    assert set(state["tables"]) == set(ref.tables) and set(state["dense"]) == set(ref.dense)
    for name, rows in state["tables"].items():
        assert not torch.equal(rows, initial.tables[name]), f"table {name} never trained"
        try:
            torch.testing.assert_close(rows, ref.tables[name], rtol=1e-5, atol=ROWS_ATOL)
        except AssertionError as exc:
            raise AssertionError(f"table {name}: {exc}") from None
    for key, value in state["dense"].items():
        try:
            torch.testing.assert_close(value, ref.dense[key], rtol=1e-5, atol=1e-6)
        except AssertionError as exc:
            raise AssertionError(f"dense {key}: {exc}") from None


def full(param: Any) -> torch.Tensor:
    """The whole tensor of an FSDP2 (DTensor) parameter."""
    out: torch.Tensor = param.full_tensor()
    return out


def assert_clip_norm(res: dict[str, Any], ref: ReferenceResult) -> None:
    """The worker's last pre-clip norm (full params) is the reference's; clipping bit."""
    assert len(ref.grad_norms) == STEPS and max(ref.grad_norms) > CLIP, ref.grad_norms
    assert res["dense"]["grad_norm_last"] == pytest.approx(ref.grad_norms[-1], rel=1e-5)
    assert res["dense"]["grad_norm_max"] == pytest.approx(max(ref.grad_norms), rel=1e-5)


# -- fsdp --------------------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_fsdp_server_knobs_clipping_match_reference(ps_address: str, tmp_path: Path) -> None:
    """Real server; no reshard after forward, the CPU offload policy, clipping over the
    DTensor (sharded) gradients: the reference's numbers and pre-clip norms."""
    state, res = run(tmp_path, ["--ps", ps_address, "--run-id", "dense-fsdp-clip",
                                "--clip-grad-norm", str(CLIP), "--reshard-after-forward",
                                "false", "--dense-cpu-offload", "true"])
    assert res["mode"] == "server"
    # the default, auto, takes FSDP2 for FSDP2's own flags
    assert res["dense"]["parallel"] == "fsdp" and res["dense"]["mesh"] == [2]
    assert res["dense"]["asked"] == "auto"
    assert res["dense"]["reshard_after_forward"] is False and res["dense"]["cpu_offload"]
    cfg = small_config(clip_grad_norm=CLIP)
    ref = train_reference(cfg, world_size=2)
    assert_matches(state, ref, cfg, 2)
    assert_clip_norm(res, ref)


# -- hsdp --------------------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.timeout(150)
def test_hsdp_2x2_with_clipping_matches_reference(tmp_path: Path) -> None:
    """4 CPU ranks as 2 nodes x 2: reduce-scatter in a pair, all-reduce across the pairs."""
    state, res = run(tmp_path, ["--dense-parallel", "hsdp", "--hsdp-shard-size", "2",
                                "--clip-grad-norm", str(CLIP)], nproc=4)
    assert res["dense"]["parallel"] == "hsdp" and res["dense"]["mesh"] == [2, 2]
    cfg = small_config(dense_parallel="hsdp", hsdp_shard_size=2, clip_grad_norm=CLIP)
    ref = train_reference(cfg, world_size=4)
    assert_matches(state, ref, cfg, 4)
    assert_clip_norm(res, ref)


# -- ddp ---------------------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_ddp_mean_small_buckets_clipping_matches_reference(tmp_path: Path) -> None:
    """1 KB buckets (several all-reduces per step), static graph, plain-tensor clipping."""
    state, res = run(tmp_path, ["--dense-parallel", "ddp", "--ddp-bucket-mb", "0.001",
                                "--ddp-static-graph", "true", "--clip-grad-norm", str(CLIP)])
    assert res["dense"]["parallel"] == "ddp" and res["dense"]["static_graph"] is True
    cfg = small_config(dense_parallel="ddp", ddp_bucket_mb=0.001, ddp_static_graph=True,
                       clip_grad_norm=CLIP)
    ref = train_reference(cfg, world_size=2)
    assert_matches(state, ref, cfg, 2)
    assert_clip_norm(res, ref)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(300)  # cold inductor cache: ~70 s on 2 busy cores
def test_ddp_sum_compiled_matches_the_sum_reference(tmp_path: Path) -> None:
    """sum: gradients of sum_r (rank r's mean loss) = W x the global mean, dense AND
    embedding; SGD (not scale invariant) tells it apart from the mean. The dense forward
    is compiled (inductor) before DDP wraps it; the reference is eager."""
    args = ["--optimizer", "sgd", "--lr", "0.5", "--dense-lr", "0.05"]
    state, res = run(tmp_path, ["--dense-parallel", "ddp", "--ddp-grad-reduce", "sum", *args,
                                "--compile", "true", "--eval-batches", "0"])
    assert res["dense"]["grad_reduce"] == "sum" and res["dense"]["embedding_grad_scale"] == 1.0
    assert res["dense"]["compile"] is True
    cfg = small_config(dense_parallel="ddp", ddp_grad_reduce="sum", optimizer="sgd", lr=0.5,
                       dense_lr=0.05, compile=True)
    assert_matches(state, train_reference(cfg, world_size=2), cfg, 2)
    mean_ref = train_reference(small_config(dense_parallel="ddp", optimizer="sgd", lr=0.5,
                                            dense_lr=0.05), world_size=2)
    assert not torch.allclose(state["tables"]["user"], mean_ref.tables["user"], atol=1e-4)


# -- compile -----------------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.timeout(300)  # cold inductor cache: ~70 s on 2 busy cores
def test_fsdp_compile_matches_eager_reference(tmp_path: Path) -> None:
    """Inductor (gcc) on the dense forward inside FSDP2's eager hooks; the reference is the
    eager single process (ddp + compile: the ddp mean test). No eval: a no_grad forward
    would compile a second graph (~10 s on 2 busy cores)."""
    state, res = run(tmp_path, ["--dense-parallel", "fsdp", "--compile", "true",
                                "--eval-batches", "0"])
    assert res["dense"]["compile"] is True and res["dense"]["parallel"] == "fsdp"
    cfg = small_config(dense_parallel="fsdp", compile=True)
    assert_matches(state, train_reference(cfg, world_size=2), cfg, 2)


# -- fp16 / bf16 -------------------------------------------------------------------------
def test_fp16_scaler_unscales_embedding_grads_and_skips_on_inf(world_of_one: Any) -> None:
    """A step with an inf only in the EMBEDDING gradient is skipped by the dense optimizer
    too and pushes zero rows; a good step pushes the embedding gradient without the scale."""
    cfg = small_config(precision="fp16", loss_scale_init=1024.0)
    table = TableConfig("t", 10, 4)
    emb = ShardedEmbedding([table], device="cpu", seed=0, init_std=0.5)
    torch.manual_seed(0)
    dp = build_dense_parallel(cfg.dense, world_of_one, nn.Linear(4, 1))
    opt = torch.optim.SGD(dp.module.parameters(), lr=0.1)
    ids = torch.tensor([1, 3, 3, 7])

    def forward_backward() -> torch.Tensor:
        loss = dp.module(emb.lookup("t", ids)).float().pow(2).mean()
        dp.backward(loss)
        return loss

    before = [full(p).clone() for p in dp.module.parameters()]
    forward_backward()
    grad = emb.weights["t"].grad.coalesce()
    values = grad.values().clone()
    values[0, 0] = float("inf")
    emb.weights["t"].grad = torch.sparse_coo_tensor(grad.indices(), values, grad.shape,
                                                     check_invariants=True)
    grads = dp.step(opt, emb)
    assert dp.skipped_steps == 1 and grads["t"][0].numel() == 0 and grads["t"][1].shape == (0, 4)
    for p, b in zip(dp.module.parameters(), before, strict=True):
        assert torch.equal(full(p), b)
    assert dp.describe()["loss_scale"] == 512.0  # backed off

    # A good step: the pushed rows are the gradient of the unscaled loss.
    x = emb.weights["t"].detach().clone().requires_grad_(True)
    w = [full(p).detach() for p in dp.module.parameters()]
    expected = (nn.functional.linear(x[ids], w[0].half().float(), w[1].half().float())
                .pow(2).mean())
    expected.backward()
    forward_backward()
    grads = dp.step(opt, emb)
    assert dp.skipped_steps == 1
    assert grads["t"][0].tolist() == [1, 3, 7]
    assert x.grad is not None
    torch.testing.assert_close(grads["t"][1], x.grad[[1, 3, 7]], rtol=2e-3, atol=1e-4)
    assert not torch.equal(full(next(iter(dp.module.parameters()))), before[0])


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_fp16_run_skips_overflowing_steps_and_learns(ps_address: str, tmp_path: Path) -> None:
    """Loss scale 2^20 overflows fp16 at first: those steps are skipped (every rank alike,
    else FSDP's collectives would hang) and push zero rows to the server, the scale backs
    off, then training proceeds close to the fp32 reference."""
    state, res = run(tmp_path, ["--ps", ps_address, "--run-id", "dense-fp16", "--precision",
                                "fp16", "--loss-scale-init", str(2.0**20)])
    assert res["sync"]["pushes"] == STEPS * 4  # every step is pushed, skipped ones empty
    dense = res["dense"]
    assert 1 <= dense["skipped_steps"] <= STEPS // 2, dense
    assert dense["loss_scale"] < 2.0**20
    ref = train_reference(small_config(), world_size=2)
    # fp16 compute with skipped steps cannot match fp32 weights to 1e-5 (Adam moves every
    # weight by ~lr a step, whatever the gradient's size, and the skips put the run a few
    # steps behind); the loss of the last window of 4 steps stays close (measured: 2 skips,
    # 0.654 vs 0.640).
    losses = [v for _, v in res["loss_curve"]]
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0] - 0.02
    assert res["final_loss"] == pytest.approx(sum(ref.losses[-4:]) / 4, abs=0.03)
    assert set(state["dense"]) == set(ref.dense)


def test_bf16_computes_in_bf16_with_fp32_output_and_grads(world_of_one: Any) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(4, 2)
    seen: list[tuple[torch.dtype, torch.dtype]] = []
    linear.register_forward_pre_hook(lambda m, args: seen.append((m.weight.dtype, args[0].dtype)))
    dp = build_dense_parallel(small_config(precision="bf16").dense, world_of_one, linear)
    x = torch.randn(3, 4)
    out = dp.module(x)
    assert seen == [(torch.bfloat16, torch.bfloat16)] and out.dtype == torch.float32
    out.sum().backward()
    for p in dp.module.parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
    torch.testing.assert_close(out, nn.functional.linear(x, full(linear.weight), full(linear.bias)),
                               rtol=2e-2, atol=2e-2)


def test_mixed_precision_policy_from_flags() -> None:
    fp32 = mixed_precision_policy("fp32")
    assert fp32.param_dtype is None and fp32.reduce_dtype is None
    bf16 = mixed_precision_policy("bf16")
    assert (bf16.param_dtype, bf16.reduce_dtype, bf16.output_dtype) == (
        torch.bfloat16, torch.float32, torch.float32)
    fp16 = mixed_precision_policy("fp16", "bf16")
    assert (fp16.param_dtype, fp16.reduce_dtype) == (torch.float16, torch.bfloat16)


# -- bad combinations ----------------------------------------------------------------------
def test_hsdp_mesh_shape_and_errors() -> None:
    assert hsdp_mesh_shape(4, 4, 2) == (2, 2)
    assert hsdp_mesh_shape(8, 4) == (2, 4)
    assert hsdp_mesh_shape(1, 1) == (1, 1)
    with pytest.raises(DenseParallelError) as err:
        hsdp_mesh_shape(6, 6, 4)
    assert "world size 6" in str(err.value) and "local world size (LOCAL_WORLD_SIZE) 6" in str(
        err.value) and "shard size 4" in str(err.value)
    with pytest.raises(DenseParallelError, match="shard size 8"):
        hsdp_mesh_shape(4, 4, 8)


@pytest.mark.e2e
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("args", "message"), [
    (["--dense-parallel", "zero3"],
     "dense_parallel='zero3' is not one of auto, fsdp, hsdp, ddp"),
    (["--dense-parallel", "ddp", "--dense-cpu-offload"],
     "dense_cpu_offload=True with dense_parallel='ddp'"),
    (["--dense-parallel", "ddp", "--precision", "bf16"],
     "precision='bf16' reduce_dtype='' with dense_parallel='ddp'"),
    (["--dense-parallel", "ddp", "--reshard-after-forward", "false"],
     "reshard_after_forward=False with dense_parallel='ddp'"),
    (["--dense-parallel", "ddp", "--prefetch-dense", "true"],
     "prefetch_dense=True with dense_parallel='ddp'"),
    (["--hsdp-shard-size", "2"], "hsdp_shard_size=2 with dense_parallel='auto'"),
    (["--dense-parallel", "fsdp", "--hsdp-shard-size", "2"],
     "hsdp_shard_size=2 with dense_parallel='fsdp'"),
    (["--ddp-grad-reduce", "sum"], "ddp_grad_reduce='sum' with dense_parallel='auto'"),
    (["--dense-parallel", "fsdp", "--ddp-grad-reduce", "sum"],
     "ddp_grad_reduce='sum' with dense_parallel='fsdp'"),
    (["--dense-parallel", "ddp", "--ddp-bucket-mb", "0"], "ddp_bucket_mb=0.0 must be > 0"),
    (["--precision", "fp8"], "precision='fp8' is not one of fp32, bf16, fp16"),
    (["--loss-scale-init", "1024"], "loss_scale_init=1024.0 with precision='fp32'"),
    (["--clip-grad-norm", "-1"], "clip_grad_norm=-1.0 must be finite and >= 0"),
    (["--dense-parallel", "ddp", "--compile", "--ddp-bucket-mb", "0.5"],
     "ddp_bucket_mb=0.5 with --compile: Dynamo's DDPOptimizer"),
])
def test_bad_combinations_exit_2_naming_the_values(args: list[str], message: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    proc = subprocess.run([sys.executable, MAIN, "--local-optimizer", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False, env=env)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr


@pytest.mark.e2e
@pytest.mark.timeout(90)
def test_hsdp_world_not_divisible_fails_before_training(tmp_path: Path) -> None:
    proc = run_worker(["--local-optimizer", "--dense-parallel", "hsdp", "--hsdp-shard-size",
                       "2", *SMALL], nproc=3, check=False, timeout=80)
    assert proc.returncode != 0
    assert ("world size 3 is not divisible by the shard size 2 (world size 3, local world "
            "size (LOCAL_WORLD_SIZE) 3, shard size 2)") in proc.stderr
    assert "hybridps worker: error:" in proc.stderr
    assert f'File "{REPO / "worker"}' not in proc.stderr  # one clear line, no worker traceback
    assert "steps" not in proc.stdout  # no summary: it never trained


@pytest.mark.parametrize("reshard", [True, False])
def test_root_keeps_its_gathered_parameters_for_backward(tmp_path: Path,
                                                         reshard: bool) -> None:
    """--reshard-after-forward true reshards the units after forward but not the root,
    whose parameters backward would all-gather again at once (one collective a step)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from worker.dense.parallel import apply_fsdp

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        unit = nn.Linear(4, 4)
        model = nn.Sequential(unit, nn.ReLU(), nn.Linear(4, 1))
        apply_fsdp(model, mesh, [unit], reshard_after_forward=reshard)
        model(torch.randn(3, 4)).sum()
        root_group = model._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
        unit_group = unit._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
        assert root_group.is_unsharded
        assert unit_group.is_unsharded is not reshard
    finally:
        dist.destroy_process_group()


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_prefetch_dense_is_bitwise_the_unprefetched_run(tmp_path: Path) -> None:
    """--prefetch-dense starts the all-gather at the top of every step after the first; the
    run is bitwise the one that gathers at the dense forward (fsdp's default)."""
    on_state, on_res = run(tmp_path / "on", ["--dense-parallel", "fsdp", "--prefetch-dense",
                                             "true"])
    off_state, off_res = run(tmp_path / "off", ["--dense-parallel", "fsdp"])
    assert on_res["dense"]["prefetch"] is True and on_res["dense"]["prefetches"] == STEPS - 1
    assert off_res["dense"]["prefetch"] is False and off_res["dense"]["prefetches"] == 0
    for name, rows in on_state["tables"].items():
        assert torch.equal(rows, off_state["tables"][name]), name
    assert set(on_state["dense"]) == set(off_state["dense"])
    for key, value in on_state["dense"].items():
        assert torch.equal(value, off_state["dense"][key]), key


def test_prefetch_starts_the_root_gather_before_forward(world_of_one: Any) -> None:
    """After the first step, prefetch() leaves the root's all-gather pending (FSDP2's
    pre-forward then only waits for it); before any forward it does nothing (lazy init);
    with --prefetch-dense false it never gathers early."""
    for enabled in (True, False):
        torch.manual_seed(0)
        dp = build_dense_parallel(small_config(dense_parallel="fsdp",
                                               prefetch_dense=enabled).dense, world_of_one,
                                  nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)))
        group = dp.module._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
        opt = torch.optim.SGD(dp.module.parameters(), lr=0.1)
        dp.prefetch()  # before the first forward: FSDP2 has not picked its root yet
        assert group._all_gather_result is None and dp.prefetches == 0
        for _ in range(2):
            dp.prefetch()
            assert (group._all_gather_result is not None) is (enabled and dp.steps > 0)
            loss = dp.module(torch.randn(3, 4)).pow(2).mean()
            dp.backward(loss)
            opt.step()
            opt.zero_grad()
            dp.steps += 1
            assert not group.is_unsharded  # resharded after backward: nothing held over
        assert dp.prefetches == (1 if enabled else 0)
