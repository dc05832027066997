"""hybridps/row_deltas.py: the weight prediction's native row kernels against their torch
path, bitwise (the prediction's results must not depend on which kernels ran)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import hybridps.optim as optim
from hybridps import native
from hybridps.row_deltas import add_offsets_, apply_update_measured_, pick_offsets

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


@needs_native
@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("ids_sorted", [True, False])
def test_pick_offsets_is_bitwise_the_torch_path(ids_sorted: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    keys = torch.sort(torch.randperm(4000, generator=gen)[:1500]).values
    src = torch.randn(1500, 16, generator=gen)
    src[0] = -0.0  # a picked -0.0 stays -0.0; an id without a key gets +0.0
    src[1, 3] = float("nan")
    ids = torch.sort(torch.randperm(4000, generator=gen)[:1200]).values
    ids = torch.unique(torch.cat([ids, keys[:2], keys[-1:]]))  # the first and last keys hit
    if not ids_sorted:
        ids = ids[torch.randperm(ids.numel(), generator=gen)]

    def run(keys_L: torch.Tensor, src_LD: torch.Tensor, ids_N: torch.Tensor
            ) -> tuple[torch.Tensor, int]:
        out, hits = pick_offsets(keys_L, src_LD, ids_N)
        return out, int(hits)

    (native_out, native_hits), (torch_out, torch_hits) = both(run, keys, src, ids)
    assert torch.equal(native_out.view(torch.int32), torch_out.view(torch.int32))  # bitwise
    hit = torch.isin(ids, keys)
    assert native_hits == torch_hits == int(hit.sum()) and (~hit).any()
    assert native_out[~hit].view(torch.int32).eq(0).all()  # +0.0, not -0.0
    pos = torch.searchsorted(keys, ids[hit])
    assert torch.equal(native_out[hit].view(torch.int32), src[pos].view(torch.int32))


@pytest.mark.usefixtures("kernels")
def test_the_torch_path_runs_without_native_kernels() -> None:
    optim.set_kernel("torch")
    rows = torch.zeros(4, 2)
    effect = apply_update_measured_(rows, torch.tensor([0, 2]), torch.ones(2, 2), 1.0)
    assert torch.equal(effect, torch.ones(2, 2)) and rows.sum() == 4
    ids = torch.tensor([2, 3])
    out = add_offsets_(rows.index_select(0, ids), ids, torch.tensor([3]), torch.full((1, 2), 5.0))
    assert out.tolist() == [[1.0, 1.0], [5.0, 5.0]]
    picked, hits = pick_offsets(torch.tensor([1, 3]), torch.tensor([[7.0], [9.0]]),
                                torch.tensor([0, 3]))
    assert picked.tolist() == [[0.0], [9.0]] and int(hits) == 1
