"""The paged store's swap (hybridps/paged_rows.py): random swaps against a model of what
it holds, a store that grows while full, and bad indices refused before anything
moves."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridps.paged_rows import PagedOut, PagedRows

DIM = 3
LAYOUT = [("m", 3), ("v", 1)]


def _out(ids: list[int], seed: int) -> PagedOut:
    g = torch.Generator().manual_seed(seed)
    n = len(ids)
    return PagedOut(torch.tensor(ids, dtype=torch.int64), torch.randn(n, DIM, generator=g),
                    {}, torch.arange(n, dtype=torch.int64) + seed,
                    torch.arange(n, dtype=torch.int64) * 3 + 1)


def _state(rows: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(rows, width, generator=g) for name, width in LAYOUT}


def test_a_store_that_grows_with_positions_taken_gives_them_all_back() -> None:
    """The free stack keeps room for every position: taking back more entries than were
    free before the pool grew must not overflow it."""
    store = PagedRows(DIM, LAYOUT)
    state = _state(200, 0)
    none = torch.empty(0, dtype=torch.int64)
    store.swap(_out(list(range(20)), 1), torch.arange(20), none, none, state)
    found, _ = store.swap(_out([], 2), none, torch.arange(10), torch.arange(10), state)
    assert bool(found.all())
    store.swap(_out(list(range(100, 130)), 3), torch.arange(30, 60), none, none, state)
    back = torch.tensor(list(range(10, 20)) + list(range(100, 130)))
    found, got = store.swap(_out([], 4), none, back, torch.arange(100, 140), state)
    assert bool(found.all()) and got.count == 40 and len(store) == 0
    assert store.n_free == store.capacity


def test_random_swaps_keep_what_went_out_and_give_it_back() -> None:
    """200 random swaps (ids going out and coming back, some never stored, growth): each
    id comes back with the row, state, step and frequency it left with, and the store
    holds exactly the ids out at the end."""
    rng = np.random.default_rng(5)
    store = PagedRows(DIM, LAYOUT)
    state = _state(64, 7)
    left: dict[int, tuple[torch.Tensor, ...]] = {}  # id -> what it left with
    next_id = -50
    for call in range(200):
        n_out = int(rng.integers(0, 9))
        out_ids = list(range(next_id, next_id + n_out))
        next_id += n_out
        back = sorted(left)
        pick = rng.choice(len(back), size=min(len(back), int(rng.integers(0, 7))),
                          replace=False) if back else np.empty(0, dtype=np.int64)
        in_list = [back[i] for i in pick] + [10_000 + call]  # the last one was never stored
        in_ids = torch.tensor(in_list, dtype=torch.int64)
        slots = rng.permutation(64)
        out_rows = torch.from_numpy(slots[:n_out].copy())
        in_rows = torch.from_numpy(slots[n_out:n_out + len(in_list)].copy())
        out = _out(out_ids, call)
        for k, ident in enumerate(out_ids):
            left[ident] = (out.rows[k].clone(), out.seen[k], out.freq[k],
                           *(state[n][out_rows[k]].clone() for n, _ in LAYOUT))
        found, got = store.swap(out, out_rows, in_ids, in_rows, state)
        assert found.tolist() == [True] * (len(in_list) - 1) + [False]
        for k, ident in enumerate(got.ids.tolist()):
            row, seen, freq, *moved = left.pop(ident)
            assert torch.equal(got.rows[k], row)
            assert int(got.seen[k]) == int(seen) and int(got.freq[k]) == int(freq)
            for (name, _), want in zip(LAYOUT, moved, strict=True):
                assert torch.equal(state[name][in_rows[k]], want)
        for name, _ in LAYOUT:  # the state of rows that went out is zeroed there
            assert not bool(state[name][out_rows].any())
    assert store.entries().ids.tolist() == sorted(left)


def test_a_row_outside_the_state_is_refused_before_anything_moves() -> None:
    store = PagedRows(DIM, LAYOUT)
    state = _state(8, 1)
    before = {k: v.clone() for k, v in state.items()}
    none = torch.empty(0, dtype=torch.int64)
    with pytest.raises(ValueError, match="an out row is outside the 8 rows"):
        store.swap(_out([1, 2], 0), torch.tensor([3, 8]), none, none, state)
    with pytest.raises(ValueError, match="an in row is outside"):
        store.swap(_out([], 0), none, torch.tensor([5]), torch.tensor([-1]), state)
    with pytest.raises(ValueError, match="1 out rows for 2 ids"):
        store.swap(_out([1, 2], 0), torch.tensor([3]), none, none, state)
    assert len(store) == 0
    assert all(torch.equal(state[k], before[k]) for k in state)
