"""ShardCore.feed_all: a message's pushes (a PushBatch's entries) applied in one hop to the
update pool, bitwise as if each had been fed alone, in order."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from hybridps.errors import ShardError
from hybridps.optim import OptimizerSpec
from ps.core import shard_core
from ps.core.partition import TableSpec
from ps.core.push import Answer, PushChunk
from ps.core.shard_core import ShardCore
from ps.core.store import Store

RUN = "run-feed-all"
BIG = TableSpec("big", num_rows=4096, dim=32, row_start=0, row_end=4096)
WIDE = TableSpec("wide", num_rows=4096, dim=48, row_start=0, row_end=4096)
ADAM = OptimizerSpec("adam", lr=0.05)


def _store() -> Store:
    store = Store(server_id="test")
    store.register(RUN, 0, 1, 0, [BIG, WIDE], ADAM)
    return store


def _push(step: int, spec: TableSpec, rows: int) -> PushChunk:
    gen = torch.Generator().manual_seed(1000 * step + spec.dim)
    ids = torch.randperm(spec.num_rows, generator=gen)[:rows].sort().values
    grads = torch.randn(rows, spec.dim, generator=gen)
    return PushChunk(RUN, 0, 0, step, spec.name, ids, grads)


def _step(step: int) -> list[PushChunk]:
    # 2500 x 32 and 2500 x 48 elements: both above INLINE_FEED_ELEMENTS, so each went to
    # the update pool on its own before
    return [_push(step, BIG, 2500), _push(step, WIDE, 2500)]


async def _run_all(store: Store, batches: list[list[PushChunk]], together: bool,
                   hops: list[int]) -> list[Answer | None]:
    core = ShardCore(store, update_threads=2)
    real_run = core._run

    async def counted(fn: Any, *args: Any) -> Any:
        hops.append(1)
        return await real_run(fn, *args)

    core._run = counted  # type: ignore[method-assign]
    session = core.open_session()
    out: list[Answer | None] = []
    try:
        for chunks in batches:
            for chunk in chunks:
                session.received(chunk)
            if together:
                out += await core.feed_all(session, chunks)
            else:
                for chunk in chunks:
                    out.append(await core.feed(session, chunk))
    finally:
        session.close()
        core.shutdown()
    return out


def test_feed_all_is_bitwise_one_by_one_in_one_hop() -> None:
    assert BIG.dim * 2500 > shard_core.INLINE_FEED_ELEMENTS
    steps = [_step(s) for s in range(4)]
    alone, together = _store(), _store()
    hops_alone: list[int] = []
    hops_together: list[int] = []
    want = asyncio.run(_run_all(alone, steps, False, hops_alone))
    got = asyncio.run(_run_all(together, [_step(s) for s in range(4)], True, hops_together))
    assert len(hops_alone) == 8 and len(hops_together) == 4
    assert len(got) == len(want) == 8
    for a, b in zip(got, want, strict=True):
        assert a is not None and b is not None
        assert (a.step, a.table, a.decay) == (b.step, b.table, b.decay)
        assert torch.equal(a.ids, b.ids)
        assert torch.equal(a.delta.view(torch.int32), b.delta.view(torch.int32))
    for spec in (BIG, WIDE):
        pa, pb = alone.partition(RUN, 0), together.partition(RUN, 0)
        assert pa is not None and pb is not None
        sa, sb = pa.tables[spec.name].state, pb.tables[spec.name].state
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(sa[key], sb[key]), (spec.name, key)


def test_feed_all_refuses_a_bad_entry_after_applying_the_ones_before() -> None:
    store = _store()
    good = _push(0, BIG, 2500)
    bad = _push(0, WIDE, 2500)
    bad.grads = bad.grads[:, :7]  # not the table's width
    with pytest.raises(ShardError, match="wide"):
        asyncio.run(_run_all(store, [[good, bad]], True, []))
    part = store.partition(RUN, 0)
    assert part is not None
    assert part.tables["big"].last_step == 0
    assert part.tables["wide"].last_step == -1
