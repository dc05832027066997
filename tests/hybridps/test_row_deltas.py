"""hybridps/row_deltas.py: the weight prediction's native row kernels against their torch
path, bitwise (the prediction's results must not depend on which kernels ran)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import hybridps.optim as optim
from hybridps import native
from hybridps.row_deltas import add_offsets_, apply_update_measured_

needs_native = pytest.mark.skipif(
    native.ext is None, reason=f"native kernels not built ({native.load_error})")


@pytest.fixture
def kernels() -> Iterator[None]:
    before = optim.kernel_info()["requested"]
    yield
    optim.set_kernel(before)


def both(fn, *args):  # type: ignore[no-untyped-def]
    """fn(*clones of args) with the native kernels, then with torch's."""
    out = []
    for kernel in ("native", "torch"):
        optim.set_kernel(kernel)
        out.append(fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args]))
    return out


@needs_native
@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("decay", [1.0, 0.999])
@pytest.mark.parametrize("dim", [7, 64])
def test_apply_update_measured_is_bitwise_the_torch_path(dim: int, decay: float) -> None:
    gen = torch.Generator().manual_seed(dim)
    rows = torch.randn(5000, dim, generator=gen)
    ids = torch.randperm(5000, generator=gen)[:3000]
    delta = torch.randn(3000, dim, generator=gen) * 1e-3

    def run(rows_RD: torch.Tensor, ids_U: torch.Tensor, delta_UD: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
        before = rows_RD.clone()
        effect = apply_update_measured_(rows_RD, ids_U, delta_UD, decay)
        # what it returns is what it did: new - old, computed in float32
        assert torch.equal(effect, rows_RD.index_select(0, ids_U) - before.index_select(0, ids_U))
        return rows_RD, effect

    (rows_n, effect_n), (rows_t, effect_t) = both(run, rows, ids, delta)
    assert torch.equal(rows_n, rows_t)
    assert torch.equal(effect_n, effect_t)
    if decay == 1.0:  # rounding: the effective update is not the delta itself
        assert not torch.equal(effect_n, delta)


@needs_native
@pytest.mark.usefixtures("kernels")
def test_apply_update_measured_refuses_a_bad_row_before_writing() -> None:
    optim.set_kernel("native")
    rows = torch.zeros(10, 4)
    with pytest.raises(IndexError, match="10"):
        apply_update_measured_(rows, torch.tensor([1, 10]), torch.ones(2, 4), 1.0)
    assert not rows.any()


@needs_native
@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("ids_sorted", [True, False])
def test_add_offsets_is_bitwise_the_torch_path(ids_sorted: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    table = torch.randn(2000, 16, generator=gen)
    keys = torch.sort(torch.randperm(2000, generator=gen)[:500]).values
    offsets = torch.randn(500, 16, generator=gen)
    ids = torch.randint(0, 2000, (3000,), generator=gen)
    if ids_sorted:  # an owner's distinct rows
        ids = torch.unique(ids)
    ids = torch.cat([ids, keys[:1], keys[-1:]])  # the first and last key are hit too

    def run(rows: torch.Tensor, ids_M: torch.Tensor, keys_P: torch.Tensor,
            offset_PD: torch.Tensor) -> torch.Tensor:
        return add_offsets_(rows, ids_M, keys_P, offset_PD)

    gathered = table.index_select(0, ids)
    native_rows, torch_rows = both(run, gathered, ids, keys, offsets)
    assert torch.equal(native_rows, torch_rows)
    hit = torch.isin(ids, keys)
    assert hit.any() and (~hit).any()
    assert torch.equal(native_rows[~hit], gathered[~hit])  # rows without an offset: as is
    assert not torch.equal(native_rows[hit], gathered[hit])


@pytest.mark.usefixtures("kernels")
def test_the_torch_path_runs_without_native_kernels() -> None:
    optim.set_kernel("torch")
    rows = torch.zeros(4, 2)
    effect = apply_update_measured_(rows, torch.tensor([0, 2]), torch.ones(2, 2), 1.0)
    assert torch.equal(effect, torch.ones(2, 2)) and rows.sum() == 4
    ids = torch.tensor([2, 3])
    out = add_offsets_(rows.index_select(0, ids), ids, torch.tensor([3]), torch.full((1, 2), 5.0))
    assert out.tolist() == [[1.0, 1.0], [5.0, 5.0]]
