"""A dynamic table's slot map and paged-out rows as deltas in an incremental checkpoint
(hybridps/paged_rows.py `checkpoint_state`/`compose_paged`, worker/embedding/dynamic/slots.py
`delta_state_dict`, hybridps/dynamic_files.py's chain composition):

- a paged store's deltas, composed oldest first, are its whole payload of the newest
  step bitwise, through puts, takes, drops, an id taken and evicted again within one
  interval, and an id dropped then stored again later;
- a slot table driven by random steps (admission, eviction, page-ins, expiry), saved as a
  chain of links on disk: `restore_plan` of each link is its slots and store exactly, at
  the saving world size, and at 2 and 3 ranks the same plan a whole checkpoint of that
  step gives;
- a delta read without its chain, or on a parent it was not written against, is refused
  naming its file.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hybridps.checkpoint import (
    FileEntry,
    Manifest,
    ManifestShard,
    ManifestTable,
    OptimState,
    ParentEntry,
    rows_file,
    save_optim_state,
    save_shard,
)
from hybridps.dynamic import DynamicSpec
from hybridps.dynamic_files import DynamicRestore, restore_plan, save_ids, save_paged_state
from hybridps.errors import CorruptCheckpoint
from hybridps.paged_rows import PagedOut, PagedRows, compose_paged, paged_from_dict
from hybridps.step_dirs import step_dir
from worker.embedding.dynamic.slots import PageAnswer, PageRequest, SlotTable

DIM = 3
LAYOUT = (("m", DIM), ("v", DIM))  # adam's


def _entries(ids: list[int], seen: list[int], salt: float) -> PagedOut:
    ids_t = torch.tensor(ids, dtype=torch.int64)
    base = ids_t.double().unsqueeze(1) * 1e-3 + salt
    return PagedOut(ids_t, (base + torch.arange(DIM)).float(),
                    {"m": (base * 2 + torch.arange(DIM)).float(),
                     "v": (base * 3 + torch.arange(DIM)).float()},
                    torch.tensor(seen, dtype=torch.int64),
                    torch.tensor([len(ids) + i for i in range(len(ids))], dtype=torch.int64))


def _same_paged(got: tuple[PagedOut, tuple[np.ndarray, np.ndarray], dict[str, int]],
                want: tuple[PagedOut, tuple[np.ndarray, np.ndarray], dict[str, int]],
                where: Any) -> None:
    (a, ta, ca), (b, tb, cb) = got, want
    assert torch.equal(a.ids, b.ids), where
    assert torch.equal(a.rows, b.rows), where
    assert set(a.state) == set(b.state), where
    for name in b.state:
        assert torch.equal(a.state[name], b.state[name]), (where, name)
    assert torch.equal(a.seen, b.seen) and torch.equal(a.freq, b.freq), where
    assert np.array_equal(ta[0], tb[0]) and np.array_equal(ta[1], tb[1]), where
    assert ca == cb, where


def test_paged_deltas_compose_to_the_whole_store_bitwise() -> None:
    """Each interval: some ids put (never stored, or stored before and dropped), some taken
    back onto slots, one taken and evicted again (looked up meanwhile), some expired; the
    chain composed at every link is the store's whole payload of that step."""
    rng = np.random.default_rng(3)
    store = PagedRows(DIM, LAYOUT)
    on_slots: dict[int, int] = {i: 0 for i in range(60)}  # id -> last step seen
    chain: list[tuple[Mapping[str, Any], str]] = []
    since: int | None = None
    reput = dropped_back = 0
    next_id = 1000
    for interval in range(12):
        step = 10 * (interval + 1)
        for sub in range(3):
            t = step - 3 + sub
            stored = sorted(store.index.items()[0].tolist())
            back = [int(i) for i in rng.choice(stored, size=min(len(stored), 2),
                                               replace=False)] if stored else []
            _, got = store.take(torch.tensor(back, dtype=torch.int64))
            assert got.count == len(back)
            for i in back:
                on_slots[i] = t  # paged in: looked up at this step
            if back and sub == 1:  # taken and evicted again in the same interval
                i = back[0]
                store.put(_entries([i], [t], float(t)))
                del on_slots[i]
                reput += 1
            out = sorted(int(i) for i in rng.choice(sorted(on_slots), size=5, replace=False))
            was_dropped = set(out) & set(store.tombstones()[0].tolist())
            dropped_back += len(was_dropped)
            store.put(_entries(out, [on_slots[i] for i in out], float(t)))
            for i in out:
                del on_slots[i]
            for i in store.expire(t, 80).tolist():
                on_slots[i] = t  # comes back as a new id later
            for i in range(5):  # new ids admitted
                on_slots[next_id + i] = t
            next_id += 5
        payload = store.checkpoint_state(step, since)
        assert ("since" in payload) == (since is not None)
        chain.append((payload, f"link-{step}"))
        _same_paged(compose_paged(chain), paged_from_dict(store.state_dict(), "whole"), step)
        since = step
    assert reput and dropped_back and len(store.tombstones()[0])
    assert sum(int(p["deleted"].numel()) for p, _ in chain[1:])  # deletions recorded
    last = chain[-1][0]
    assert int(last["ids"].numel()) * 3 < len(store)  # a delta holds less than the store


def test_a_delta_against_another_parent_is_whole_and_one_off_its_chain_is_refused() -> None:
    store = PagedRows(DIM, LAYOUT)
    store.put(_entries([1, 2, 3], [1, 1, 1], 0.5))
    w5 = store.checkpoint_state(5)
    store.put(_entries([4], [2], 0.5))
    assert "since" in store.checkpoint_state(9, since=5)
    w13 = store.checkpoint_state(13, since=7)  # its mark is of step 9: whole
    assert "since" not in w13
    d17 = store.checkpoint_state(17, since=13)
    with pytest.raises(ValueError, match="link-b is a delta since step 13"):
        paged_from_dict(d17, "link-b")
    store.drop_oldest(1, 18)
    d21 = store.checkpoint_state(21, since=17)
    assert d21["deleted"].tolist() == [1] and d21["tomb_ids"].tolist() == [1]
    _same_paged(compose_paged([(w13, "a"), (d17, "b"), (d21, "c")]),
                paged_from_dict(store.state_dict(), "whole"), 21)
    with pytest.raises(ValueError, match="link-c: composed with its chain it holds 2 "
                                         "paged ids, the store held 3"):
        compose_paged([(w5, "link-a"), (d21, "link-c")])
    with pytest.raises(ValueError, match="link-d: a delta on 0 tombstones; its chain has 1"):
        compose_paged([(w13, "a"), (d17, "b"), (d21, "c"), (d21, "link-d")])


# -- a slot table's chain on disk ------------------------------------------------------

CAPACITY, SPEC = 8, DynamicSpec(eviction="lru", expire_steps=4)


class _Run:
    """One owner's slots and in-process store, driven step by step (the local pager's
    moves: evicted rows in with their state, paged-in ones out)."""

    def __init__(self) -> None:
        self.slots = SlotTable("u", SPEC, 0, CAPACITY, seed=0, table_index=0, native=False)
        self.store = PagedRows(DIM, LAYOUT)
        self.slots.share_paged(self.store)
        self.rows = torch.zeros(CAPACITY, DIM)
        self.state = {n: torch.zeros(CAPACITY, w) for n, w in LAYOUT}

    def step(self, ids: np.ndarray, step: int) -> None:
        def pager(req: PageRequest) -> PageAnswer:
            out = torch.from_numpy(req.out_slots)
            self.store.put(PagedOut(torch.from_numpy(req.out_ids),
                                    self.rows.index_select(0, out),
                                    {n: t.index_select(0, out) for n, t in self.state.items()},
                                    torch.from_numpy(req.out_seen),
                                    torch.from_numpy(req.out_freq)))
            found, got = self.store.take(torch.from_numpy(req.in_ids))
            at = torch.from_numpy(req.in_slots)[found]
            self.rows[at] = got.rows
            for n, t in self.state.items():
                t[at] = got.state[n]
            return PageAnswer(found.numpy(), got.seen.numpy(), got.freq.numpy(),
                              self.store.expire(step, SPEC.expire_steps))

        slots, req = self.slots.translate(ids, step, step - 1, pager)
        new = torch.from_numpy(req.new_slots)
        self.rows[new] = torch.from_numpy(req.new_ids).float().unsqueeze(1) + 0.25
        for t in self.state.values():
            t[new] = 0.0
        hit = torch.from_numpy(slots[slots >= 0])
        self.rows[hit] += 0.5 * step  # the step's update
        for t in self.state.values():
            t[hit] += 0.125

    def save(self, directory: Path, step: int, since: int | None, parent: Path | None
             ) -> Path:
        """A checkpoint of step `step` (its slot map and store a delta since `since`; the
        rows and optimizer state whole: their deltas are tested with the static tables)."""
        slot_state = (self.slots.state_dict() if since is None
                      else self.slots.delta_state_dict(since))
        files = {
            "rows": save_shard(directory, rows_file("u", 0), kind="rows", table="u", rank=0,
                               num_rows=CAPACITY, dim=DIM, row_start=0, row_end=CAPACITY,
                               tensors={"weight": self.rows}),
            "optim": save_optim_state(directory, table="u", rank=0, num_rows=CAPACITY,
                                      dim=DIM, row_start=0, row_end=CAPACITY,
                                      state=OptimState(dict(self.state), step, step),
                                      optimizer={"kind": "adam"}),
            "ids": save_ids(directory, table="u", rank=0, start=0, end=CAPACITY,
                            state=slot_state, step=step),
            "paged": save_paged_state(directory, table="u", rank=0, start=0, end=CAPACITY,
                                      state=self.store.checkpoint_state(step, since),
                                      step=step)}
        shard = ManifestShard(0, 0, CAPACITY, {k: FileEntry(f.file, f.bytes, f.crc32, f.delta)
                                               for k, f in files.items()})
        Manifest(step=step, tables={"u": ManifestTable(CAPACITY, DIM, (shard,),
                                                       {"dynamic": {}})},
                 world_size=1, run_id="run", chain_id="c",
                 parent=None if parent is None else ParentEntry.describe(parent)
                 ).write(directory)
        return directory


def _plans(directory: Path, world: int) -> list[DynamicRestore]:
    out = []
    for rank in range(world):
        lo, hi = rank * CAPACITY // world, (rank + 1) * CAPACITY // world
        out.append(restore_plan(directory, Manifest.read(directory), "u", DIM, LAYOUT, rank,
                                world, lo, hi))
    return out


def _same_plan(a: DynamicRestore, b: DynamicRestore, where: Any) -> None:
    for x, y in ((a.slot_id, b.slot_id), (a.seen, b.seen), (a.freq, b.freq),
                 *zip(a.tombstones, b.tombstones, strict=True)):
        assert np.array_equal(x, y), where
    _same_paged((a.paged, a.tombstones, a.counters), (b.paged, b.tombstones, b.counters), where)
    assert a.admission == b.admission, where


def test_a_chain_of_slot_maps_and_stores_restores_each_step_exactly(tmp_path: Path) -> None:
    """28 steps of 5 ids from 30 (evictions, page-ins, expiry, ids dropped and admitted
    again), a checkpoint every 4 steps (the first whole, then deltas): each link restores
    to its step's slots and store bitwise; at 2 and 3 ranks, to the plan of a whole
    checkpoint of the same step."""
    rng = np.random.default_rng(11)
    run = _Run()
    parent: Path | None = None
    since: int | None = None
    deltas = 0
    for step in range(28):
        ids = rng.choice(30, size=5, replace=False).astype(np.int64) * 7919 - 50_000
        run.step(ids, step)
        if step % 4 != 3:
            continue
        link = run.save(step_dir(tmp_path / "chain", step), step, since, parent)
        whole = run.save(step_dir(tmp_path / "whole", step), step, None, None)
        entry = Manifest.read(link).table("u").shards[0].files
        assert entry["ids"].delta == entry["paged"].delta == (since is not None)
        deltas += entry["ids"].delta
        (plan,) = _plans(link, 1)
        used = run.slots.seen >= 0
        assert np.array_equal(plan.seen, run.slots.seen), step
        assert np.array_equal(plan.slot_id[used], run.slots.slot_id[used]), step
        assert np.array_equal(plan.freq, run.slots.freq), step
        _same_paged((plan.paged, plan.tombstones, plan.counters),
                    (run.store.entries(), run.store.tombstones(),
                     {"expired": run.store.expired, "dropped": run.store.dropped,
                      "last_expiry": run.store.last_expiry}), step)
        for world in (2, 3):
            for a, b in zip(_plans(link, world), _plans(whole, world), strict=True):
                _same_plan(a, b, (step, world))
        parent, since = link, step
    stats = run.slots.stats
    assert deltas == 6 and stats.evictions and stats.page_ins and stats.dropped_paged
    live = set(run.slots.slot_id[run.slots.seen >= 0].tolist()) | set(
        run.store.index.items()[0].tolist())
    assert live & set(run.store.tombstones()[0].tolist())  # dropped, then admitted again


def test_a_slot_delta_without_its_whole_file_is_refused_naming_it(tmp_path: Path) -> None:
    run = _Run()
    for step in range(4):
        run.step(np.arange(step, step + 5, dtype=np.int64), step)
    full = run.save(step_dir(tmp_path, 3), 3, None, None)
    for step in range(4, 8):
        run.step(np.arange(step, step + 5, dtype=np.int64), step)
    link = run.save(step_dir(tmp_path, 7), 7, 3, full)
    restore_plan(link, Manifest.read(link), "u", DIM, LAYOUT, 0, 1, 0, CAPACITY)
    ids = torch.load(link / "ids" / "u.r00000.pt", weights_only=True)
    ids["used"] = ids["used"] + 1  # a delta that does not fit its parent
    torch.save(ids, link / "ids" / "u.r00000.pt")
    with pytest.raises(CorruptCheckpoint, match=str(link / "ids" / "u.r00000.pt")):
        restore_plan(link, Manifest.read(link), "u", DIM, LAYOUT, 0, 1, 0, CAPACITY,
                     verify=False)
