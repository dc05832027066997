"""A paged store whose rows and state spill (hybridps/paged_rows.py's spill_payload over
hybridps/spilled_rows.py): the same calls on a store held in memory and on one whose
payload pages through two frames give bitwise the same entries, answers, drops and
tombstones, through growth, quota drops, expiry and pool shrinking."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hybridps.paged_rows import PagedOut, PagedRows
from hybridps.spilled_rows import SpilledRows

DIM = 3
LAYOUT = [("m", 3), ("v", 1)]
SLOTS = 16


def _stores(tmp_path: Path, quota: int) -> tuple[PagedRows, PagedRows]:
    held = PagedRows(DIM, LAYOUT, ordered=True)
    spilled = PagedRows(DIM, LAYOUT, ordered=True)
    for store in (held, spilled):
        store.set_quota(quota, SLOTS)
    payload = SpilledRows(tmp_path / "p.pages", [("rows", DIM), *LAYOUT],
                          spilled.max_entries, 4, 2)
    spilled.spill_payload(payload)
    return held, spilled


@pytest.mark.parametrize("quota", [6_000, 0])
def test_a_spilled_payload_is_bitwise_the_held_one(tmp_path: Path, quota: int) -> None:
    if quota == 0:  # no quota: the payload needs a bound of its own
        held = PagedRows(DIM, LAYOUT, ordered=True)
        spilled = PagedRows(DIM, LAYOUT, ordered=True)
        spilled.spill_payload(SpilledRows(tmp_path / "p.pages", [("rows", DIM), *LAYOUT],
                                          4096, 4, 2))
    else:
        held, spilled = _stores(tmp_path, quota)
    g = torch.Generator().manual_seed(0)
    state = {n: torch.randn(SLOTS, w, generator=g) for n, w in LAYOUT}
    slots = {id(held): {n: t.clone() for n, t in state.items()},
             id(spilled): {n: t.clone() for n, t in state.items()}}
    out_ids = 0
    for step in range(80):
        n_out = int(torch.randint(0, 6, (1,), generator=g))
        out_slots = torch.randperm(SLOTS, generator=g)[:n_out]
        ids = torch.arange(out_ids, out_ids + n_out, dtype=torch.int64) * 7 + 3
        out_ids += n_out
        out = PagedOut(ids, torch.randn(n_out, DIM, generator=g), {},
                       torch.full((n_out,), step, dtype=torch.int64) - torch.randint(
                           0, 5, (n_out,), generator=g),
                       torch.randint(1, 9, (n_out,), generator=g))
        back = torch.randint(0, max(out_ids, 1), (4,), generator=g).unique() * 7 + 3
        in_slots = torch.randperm(SLOTS, generator=g)[:back.numel()]
        results = []
        for store in (held, spilled):
            found, got = store.swap(out, out_slots, back, in_slots, slots[id(store)])
            dropped = store.expire(step, 30)
            if quota and store.nbytes > quota:
                dropped = np.concatenate([dropped, store.drop_oldest(3, step)])
            store.fit_pools()
            results.append((found, got, dropped))
        (f1, g1, d1), (f2, g2, d2) = results
        assert torch.equal(f1, f2) and np.array_equal(d1, d2), step
        for a, b in ((g1.ids, g2.ids), (g1.rows, g2.rows), (g1.seen, g2.seen),
                     (g1.freq, g2.freq)):
            assert torch.equal(a, b), step
        for name in state:
            assert torch.equal(slots[id(held)][name], slots[id(spilled)][name]), step
        assert torch.equal(held.peek(back)[1], spilled.peek(back)[1])
    a, b = held.state_dict(), spilled.state_dict()
    for key in ("ids", "rows", "seen", "freq", "tomb_ids", "tomb_steps"):
        assert torch.equal(a[key], b[key]), key
    for name in state:
        assert torch.equal(a["state"][name], b["state"][name]), name
    assert spilled.spilled is not None
    counters = spilled.spilled.counters()
    assert counters["spills"] > 0 and counters["fills"] > 0  # the disk was used
    if quota:
        assert held.dropped > 0  # the quota decided, the same way for both
    assert spilled.spilled.disk_bytes > 0
