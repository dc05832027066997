"""The row kernels against torch's own optimizers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from hybridps import optim
from hybridps.errors import InvalidArgument
from hybridps.optim import OptimizerSpec, apply_rows_, apply_update_

NUM_ROWS, DIM = 50, 6


def _sparse_grad_steps(steps: int, seed: int = 0) -> list[torch.Tensor]:
    """Index batches with repeated ids (so coalescing sums rows) and some untouched rows."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, NUM_ROWS // 2 + step, (12,), generator=gen) for step in range(steps)]


def _run_reference_and_kernel(spec: OptimizerSpec, reference_opt: type[torch.optim.Optimizer],
                              ref_kwargs: dict[str, object], steps: int, dense_all_rows: bool
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    emb = torch.nn.Embedding(NUM_ROWS, DIM, sparse=not dense_all_rows)
    weights = emb.weight.detach().clone()
    opt = reference_opt(emb.parameters(), **ref_kwargs)  # type: ignore[call-arg,arg-type]
    m = torch.zeros(NUM_ROWS, DIM) if spec.has_moments else None
    v = torch.zeros(NUM_ROWS, DIM) if spec.has_moments else None
    target = torch.randn(NUM_ROWS, DIM, generator=torch.Generator().manual_seed(2))
    for step, idx in enumerate(_sparse_grad_steps(steps), start=1):
        if dense_all_rows:
            idx = torch.cat([idx, torch.arange(NUM_ROWS)])
        opt.zero_grad()
        out = emb(idx)
        loss = ((out - target[idx]) ** 2).sum()
        loss.backward()
        grad = emb.weight.grad
        assert grad is not None
        if grad.is_sparse:
            grad = grad.coalesce()
            ids, rows = grad.indices()[0], grad.values()
        else:
            ids = torch.arange(NUM_ROWS)
            rows = grad
        opt.step()
        delta, decay = apply_rows_(spec, m, v, ids, rows.clone(), step)
        apply_update_(weights, ids, delta, decay)
    return emb.weight.detach(), weights


@pytest.fixture
def torch_kernel() -> Iterator[None]:
    """The torch row kernel: op for op SparseAdam's. (The native kernel's correctly rounded
    sqrtf may differ from torch's vectorized sqrt by an ulp; tests/hybridps/test_native_kernel.py
    holds it to a few ulps of SparseAdam instead.)"""
    before = optim.kernel_info()["requested"]
    optim.set_kernel("torch")
    yield
    optim.set_kernel(before)


@pytest.mark.usefixtures("torch_kernel")
def test_adam_kernel_is_sparse_adam_bitwise() -> None:
    spec = OptimizerSpec("adam", lr=0.01, beta1=0.8, beta2=0.95, eps=1e-7)
    ref, ours = _run_reference_and_kernel(
        spec, torch.optim.SparseAdam, {"lr": 0.01, "betas": (0.8, 0.95), "eps": 1e-7},
        steps=25, dense_all_rows=False)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)


def test_adamw_kernel_matches_adamw_when_every_row_is_touched() -> None:
    spec = OptimizerSpec("adamw", lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
    ref, ours = _run_reference_and_kernel(
        spec, torch.optim.AdamW,
        {"lr": 0.01, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1, "foreach": False},
        steps=20, dense_all_rows=True)
    torch.testing.assert_close(ours, ref)


def test_sgd_kernel_matches_sgd() -> None:
    spec = OptimizerSpec("sgd", lr=0.05, weight_decay=0.01)
    ref, ours = _run_reference_and_kernel(
        spec, torch.optim.SGD, {"lr": 0.05, "weight_decay": 0.01, "foreach": False},
        steps=20, dense_all_rows=True)
    torch.testing.assert_close(ours, ref)


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"kind": "rmsprop"}, "rmsprop"),
    ({"lr": -1.0}, "lr=-1.0"),
    ({"lr": float("nan")}, "lr=nan"),
    ({"eps": float("inf")}, "eps=inf"),
    ({"beta1": 1.0}, "beta1=1.0"),
    ({"beta2": -0.1}, "beta2=-0.1"),
    ({"kind": "adamw", "weight_decay": -0.5}, "weight_decay=-0.5"),
    ({"kind": "adam", "weight_decay": 0.1}, "weight_decay"),
])
def test_optimizer_spec_rejects_bad_values(kwargs: dict[str, object], named: str) -> None:
    with pytest.raises(InvalidArgument, match=named.replace("(", r"\(")):
        OptimizerSpec(**kwargs)  # type: ignore[arg-type]
