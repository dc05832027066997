"""World size 1: the training loop leaves the dense part unwrapped when FSDP/DDP
would change nothing (worker/dense/parallel.py `wrapper_needed`), and the results are bitwise
those of the wrapped module: the same dense weights and the same rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import worker.train.trainer
from worker.config.train_config import TrainConfig
from worker.dense.parallel import build_dense_parallel, wrapper_needed
from worker.runtime.dist import DistContext
from worker.train.trainer import Trainer

STEPS = 6


def _train(ctx: DistContext, tmp_path: Path, dense_parallel: str) -> tuple[dict[str, Any], bool]:
    cfg = TrainConfig.of(local_optimizer=True, num_rows=500, batch_size=64, steps=STEPS, dim=8,
                         staleness=0, progress=False, eval_batches=1,
                         dense_parallel=dense_parallel, dump_state=str(tmp_path / "state.pt"))
    trainer = Trainer(cfg, ctx)
    try:
        trainer.train()
        trainer.dump_state(str(tmp_path / "state.pt"))
    finally:
        trainer.close()
    return torch.load(tmp_path / "state.pt"), trainer.dense_parallel.wrapped


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dense_parallel", ["fsdp", "ddp"])
def test_one_rank_without_the_wrapper_is_bitwise_the_wrapped_run(
        world_of_one: DistContext, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        dense_parallel: str) -> None:
    plain, plain_wrapped = _train(world_of_one, tmp_path / "plain", dense_parallel)

    def always_wrapped(*args: Any, **kwargs: Any) -> Any:
        return build_dense_parallel(*args, **{**kwargs, "plain_at_one_rank": False})

    monkeypatch.setattr(worker.train.trainer, "build_dense_parallel", always_wrapped)
    wrapped, wrapped_wrapped = _train(world_of_one, tmp_path / "wrapped", dense_parallel)
    assert plain_wrapped is False and wrapped_wrapped is True
    assert set(plain["tables"]) == set(wrapped["tables"])
    for name, rows in plain["tables"].items():
        assert torch.equal(rows, wrapped["tables"][name]), name
    assert set(plain["dense"]) == set(wrapped["dense"]) and plain["dense"]
    for key, value in plain["dense"].items():
        assert torch.equal(value, wrapped["dense"][key]), key


def test_what_still_needs_a_wrapper_at_one_rank() -> None:
    def dense(**kw: Any) -> Any:
        return TrainConfig.of(local_optimizer=True, **kw).dense

    assert not wrapper_needed(dense(), 1)
    assert not wrapper_needed(dense(dense_parallel="ddp"), 1)
    assert wrapper_needed(dense(), 2)
    assert wrapper_needed(dense(precision="bf16"), 1)
    assert wrapper_needed(dense(reduce_dtype="bf16"), 1)
    assert wrapper_needed(dense(dense_cpu_offload=True), 1)
    assert wrapper_needed(dense(prefetch_dense=True), 1)
