"""--dense-parallel auto (worker/dense/policy.py): the rule's decisions at its thresholds,
the plan's line, and a run under auto bitwise the run under the kind it chose."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.worker.dense.test_dense_parallel import run
from worker.config.train_config import TrainConfig
from worker.dense.policy import (
    SHARD_MEMORY_SHARE,
    SHARD_SPEED_MIN_WORLD,
    SHARD_SPEED_PARAM_BYTES,
    DenseFacts,
    choose_dense_parallel,
    state_copies,
)
from worker.plan import format_plan, plan_for_config
from worker.report.results import summary
from worker.tasks import build_task, task_class

GB = 10**9


def dense(**kw: Any) -> Any:
    return TrainConfig.of(local_optimizer=True, **kw).dense


def facts(param_bytes: int = 4 * 6529, *, world: int = 2, backend: str = "gloo",
          memory: int | None = 16 * GB, copies: int = 2) -> DenseFacts:
    return DenseFacts(param_bytes, copies, world, backend, memory)


def test_explicit_kinds_are_taken_as_they_are() -> None:
    huge = facts(100 * GB, world=8, backend="nccl", memory=GB)
    for kind in ("fsdp", "hsdp", "ddp"):
        choice = choose_dense_parallel(dense(dense_parallel=kind), huge)
        assert (choice.kind, choice.requested) == (kind, kind)
    tiny = choose_dense_parallel(dense(dense_parallel="fsdp"), facts(40))
    assert tiny.kind == "fsdp"


def test_small_dense_part_replicates_and_says_why() -> None:
    choice = choose_dense_parallel(dense(), facts())
    assert (choice.kind, choice.requested) == ("ddp", "auto")
    assert choice.reason == "params+grads+state 104 KB replicated <= 0.1 x 16 GB a rank; " \
        "gloo: DDP faster"
    assert choice.describe() == f"ddp (auto: {choice.reason})"


@pytest.mark.parametrize(("kw", "flag"), [
    ({"precision": "bf16"}, "--precision bf16"), ({"reduce_dtype": "bf16"}, "--reduce-dtype bf16"),
    ({"dense_cpu_offload": True}, "--dense-cpu-offload"),
    ({"prefetch_dense": True}, "--prefetch-dense"),
    ({"reshard_after_forward": False}, "--reshard-after-forward false")])
def test_a_flag_only_fsdp2_has_takes_fsdp(kw: dict[str, Any], flag: str) -> None:
    for world in (1, 2):  # even on one rank: the flag asks for FSDP2's feature
        choice = choose_dense_parallel(dense(**kw), facts(world=world))
        assert choice.kind == "fsdp" and choice.reason == f"{flag}: FSDP2 only"


def test_one_rank_never_shards() -> None:
    choice = choose_dense_parallel(dense(), facts(100 * GB, world=1, backend="nccl", memory=GB))
    assert choice.kind == "ddp" and choice.reason == "one rank: nothing to shard"


@pytest.mark.parametrize("copies", [0, 1, 2])
def test_memory_threshold_counts_params_grads_and_optimizer_state(copies: int) -> None:
    memory = 12 * GB
    limit = int(SHARD_MEMORY_SHARE * memory)  # replicated bytes allowed: 1.2 GB
    at = limit // (2 + copies)
    assert at * (2 + copies) == limit
    assert choose_dense_parallel(dense(), facts(at, memory=memory, copies=copies)).kind == "ddp"
    over = choose_dense_parallel(dense(), facts(at + 1, memory=memory, copies=copies))
    assert over.kind == "fsdp" and over.reason.endswith("replicated > 0.1 x 12 GB a rank")
    # memory not known: no memory rule (and gloo has no speed rule)
    unknown = choose_dense_parallel(dense(), facts(100 * GB, memory=None))
    assert unknown.kind == "ddp" and unknown.reason == (
        "params+grads+state 400 GB replicated memory unknown; gloo: DDP faster")


def test_speed_threshold_on_nccl_only_from_enough_ranks() -> None:
    big = 10**6 * GB  # memory that never binds
    at, world = SHARD_SPEED_PARAM_BYTES, SHARD_SPEED_MIN_WORLD
    shard = choose_dense_parallel(dense(), facts(at, world=world, backend="nccl", memory=big))
    assert shard.kind == "fsdp" and shard.reason == (
        f"params 1 GB >= 1 GB on nccl at {world} ranks: sharding is faster")
    for below in (facts(at - 1, world=world, backend="nccl", memory=big),
                  facts(at, world=world - 1, backend="nccl", memory=big),
                  facts(at, world=64, backend="gloo", memory=big)):
        assert choose_dense_parallel(dense(), below).kind == "ddp", below


def test_state_copies_of_the_dense_optimizers() -> None:
    assert [state_copies(k) for k in ("adam", "adamw", "adagrad", "sgd")] == [2, 2, 1, 0]


@pytest.mark.parametrize("task", ["synthetic", "tables",
                                  "tests.testing.group_tables_task:TwoWidths"])
def test_plan_dense_parameters_are_the_built_dense_parts(task: str) -> None:
    cfg = TrainConfig.of(local_optimizer=True, task=task, num_rows=100, dim=8,
                         tables="a:50,b_wide:20:3")
    built = sum(p.numel() for p in build_task(cfg).build_dense().parameters())
    assert task_class(task).plan_dense_parameters(cfg) == built


def test_plan_shows_the_choice_and_why() -> None:
    cfg = TrainConfig.of(local_optimizer=True, num_rows=2000, dim=8, host_memory_gb=64.0)
    plan = plan_for_config(cfg, world_size=2, ranks_per_node=2, detect=False,
                           device_kind="cpu")
    line = next(x for x in format_plan(plan).splitlines() if x.startswith("dense part:"))
    assert line == ("dense part: 4,481 parameters, --dense-parallel ddp (auto: "
                    "params+grads+state 71.7 KB replicated <= 0.1 x 32 GB a rank; gloo: DDP "
                    "faster)")
    gpu = TrainConfig.of(local_optimizer=True, num_rows=2000, dim=8, device_memory_gb=80.0,
                         precision="bf16")
    plan = plan_for_config(gpu, world_size=8, detect=False, device_kind="cuda")
    assert "dense part: 4,481 parameters, --dense-parallel fsdp (auto: --precision bf16: " \
           "FSDP2 only)" in format_plan(plan)


@pytest.mark.e2e
@pytest.mark.timeout(200)
@pytest.mark.parametrize(("extra", "kind"), [([], "ddp"),
                                             (["--reshard-after-forward", "false"], "fsdp")])
def test_auto_is_bitwise_the_kind_it_chose(tmp_path: Path, extra: list[str], kind: str) -> None:
    auto_state, auto_res = run(tmp_path / "auto", extra)
    kind_state, kind_res = run(tmp_path / kind, ["--dense-parallel", kind, *extra])
    assert auto_res["dense"]["parallel"] == kind_res["dense"]["parallel"] == kind
    assert (auto_res["dense"]["asked"], kind_res["dense"]["asked"]) == ("auto", kind)
    because = auto_res["dense"]["because"]
    if extra:
        assert because == "--reshard-after-forward false: FSDP2 only"
    else:
        assert because.startswith("params+grads+state 71.7 KB replicated <= 0.1 x ")
        assert because.endswith(" a rank; gloo: DDP faster")
    # the run's summary says it too
    assert f"dense: parallel {kind}  asked auto  because {because}" in " ".join(
        line.strip() for line in summary(auto_res, "synthetic", width=None).splitlines())
    for name, rows in auto_state["tables"].items():
        assert torch.equal(rows, kind_state["tables"][name]), name
    assert set(auto_state["dense"]) == set(kind_state["dense"]) and auto_state["dense"]
    for key, value in auto_state["dense"].items():
        assert torch.equal(value, kind_state["dense"][key]), key
