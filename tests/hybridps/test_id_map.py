"""hybridps/id_map.py sized once (`fix_capacity`, a paged store under a quota): under
inserts and removes it keeps its size (tombstones cleared in place), gives every id its
value, and grows only past the entries it was sized for; the C and numpy probes alike."""

from __future__ import annotations

import numpy as np
import pytest

from hybridps.id_map import _NATIVE, FIXED_LOAD, IdMap, fixed_size_for

MODES = [False, True] if _NATIVE else [False]


@pytest.mark.parametrize("native", MODES)
def test_a_map_sized_once_keeps_its_size_through_churn(native: bool) -> None:
    m = IdMap(native=native)
    m.fix_capacity(300)
    size = fixed_size_for(300)
    assert m.size == size and size * FIXED_LOAD >= 300 > size * FIXED_LOAD / 2
    held = m.held_bytes
    rng = np.random.default_rng(3)
    live: dict[int, int] = {}
    for _ in range(200):  # about 300 entries at most; thousands of removals in all
        fresh = np.setdiff1d(rng.integers(-10**12, 10**12, size=40), list(live))
        room = 300 - len(live)
        fresh = fresh[:room]
        values = rng.integers(0, 10**9, size=fresh.size)
        m.insert(fresh, values)
        live.update(zip(fresh.tolist(), values.tolist(), strict=True))
        gone = rng.choice(list(live), size=min(len(live), 35), replace=False)
        assert m.remove(gone).all()
        for k in gone.tolist():
            del live[k]
        assert m.size == size and m.held_bytes == held and len(m) == len(live)
    keys = np.array(list(live), dtype=np.int64)
    assert m.find(keys).tolist() == list(live.values())
    m.insert(np.arange(10**13, 10**13 + size), np.zeros(size, dtype=np.int64))
    assert m.size > size  # beyond what it was sized for it still takes every entry
    assert m.find(keys).tolist() == list(live.values())
