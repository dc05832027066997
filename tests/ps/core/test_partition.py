"""The transport-free core: Register, exactly-once pushes, chunking, validation, stats."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import hybridps.optim as optim
from hybridps import native
from hybridps.errors import (
    AnswerEvicted,
    Conflict,
    FlushTimeout,
    InvalidArgument,
    NonFiniteGradient,
    NotFound,
    NotRegistered,
    OutOfOrder,
    RowOutOfRange,
    ShardError,
    StaleIncarnation,
)
from hybridps.optim import OptimizerSpec, apply_rows_
from ps.core.partition import Answer, PushChunk, TableSpec
from ps.core.shard_core import ShardCore
from ps.core.store import Store

RUN = "run-a"
DIM = 4
# rank 1 of 2 owns rows [10, 20) of "emb" (20 rows) and [0, 3) of "small" (5 rows).
EMB = TableSpec("emb", num_rows=20, dim=DIM, row_start=10, row_end=20)
SMALL = TableSpec("small", num_rows=5, dim=2, row_start=0, row_end=3)
ADAM = OptimizerSpec("adam", lr=0.1)


def make_store(**kwargs: Any) -> Store:
    store = Store(server_id="test", **kwargs)
    store.register(RUN, 1, 2, 0, [EMB, SMALL], ADAM)
    return store


def push(step: int, ids: list[int], *, table: str = "emb", incarnation: int = 0,
         rank: int = 1, run: str = RUN, seed: int | None = None, dim: int = DIM,
         grads: torch.Tensor | None = None, chunk: int = 0, num_chunks: int = 1) -> PushChunk:
    ids_t = torch.tensor(ids, dtype=torch.int64)
    if grads is None:
        gen = torch.Generator().manual_seed(step if seed is None else seed)
        grads = torch.randn(len(ids), dim, generator=gen)
    return PushChunk(run, rank, incarnation, step, table, ids_t, grads, chunk, num_chunks)


def feed(store: Store, chunk: PushChunk) -> Answer | None:
    return store.open_session().feed(chunk)


def state(store: Store, run: str = RUN, rank: int = 1) -> dict[str, Any]:
    """A deep copy of everything a refused push must leave alone (not the refusal counts)."""
    part = store.partition(run, rank)
    assert part is not None
    out: dict[str, Any] = {"incarnation": part.incarnation}
    for name, t in part.tables.items():
        out[name] = {
            "m": None if t.m is None else t.m.clone(),
            "v": None if t.v is None else t.v.clone(),
            "touched": t.touched.clone(),
            "counters": (t.adam_step, t.last_step, t.pushes_applied, t.rows_updated,
                         t.distinct_touched, sorted(t.answers)),
        }
    return out


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            for field in ("m", "v", "touched"):
                if a[key][field] is None:
                    assert b[key][field] is None
                else:
                    assert torch.equal(a[key][field], b[key][field]), (key, field)
            assert a[key]["counters"] == b[key]["counters"], key
        else:
            assert a[key] == b[key], key


def assert_same_answer(a: Answer, b: Answer) -> None:
    assert (a.step, a.table, a.decay) == (b.step, b.table, b.decay)
    assert torch.equal(a.ids, b.ids)
    assert torch.equal(a.delta, b.delta)


# -- Register -------------------------------------------------------------------------

def test_register_creates_then_adopts_newer_incarnation() -> None:
    store = Store()
    tables = store.register(RUN, 1, 2, 0, [EMB, SMALL], ADAM)
    assert [(t.name, t.rows_held, t.last_step, t.created) for t in tables] == [
        ("emb", 10, -1, True), ("small", 3, -1, True)]
    part = store.partition(RUN, 1)
    assert part is not None and part.tables["emb"].m is not None
    assert part.tables["emb"].m.shape == (10, DIM)
    feed(store, push(0, [11]))
    # A newer process of the rank, with the partition's secret (nobody else may
    # take over a partition that has state); the order of tables is irrelevant.
    again = store.register(RUN, 1, 2, 3, [SMALL, EMB], ADAM, secret=store.secret(RUN, 1))
    assert {(t.name, t.last_step, t.created) for t in again} == {
        ("emb", 0, False), ("small", -1, False)}
    assert part.incarnation == 3
    with pytest.raises(StaleIncarnation, match=r"incarnation 2 is older .* 3"):
        store.register(RUN, 1, 2, 2, [EMB, SMALL], ADAM)


def test_register_sgd_allocates_no_moments() -> None:
    store = Store()
    store.register(RUN, 0, 1, 0, [EMB], OptimizerSpec("sgd", lr=0.1))
    part = store.partition(RUN, 0)
    assert part is not None
    assert part.tables["emb"].m is None and part.tables["emb"].v is None


@pytest.mark.parametrize(("kwargs", "exc", "named"), [
    ({"run_id": ""}, InvalidArgument, "run_id"),
    ({"rank": 2}, InvalidArgument, "rank=2"),
    ({"rank": -1}, InvalidArgument, "rank=-1"),
    ({"world_size": 0, "rank": 0}, InvalidArgument, "world_size=0"),
    ({"incarnation": -1}, InvalidArgument, "incarnation=-1"),
    ({"tables": []}, InvalidArgument, "at least one table"),
    ({"tables": [TableSpec("emb", 20, 0, 0, 10)]}, InvalidArgument, "dim=0"),
    ({"tables": [TableSpec("emb", 0, 4, 0, 0)]}, InvalidArgument, "num_rows=0"),
    ({"tables": [TableSpec("emb", 20, 4, 10, 21)]}, InvalidArgument, r"\[10, 21\)"),
    ({"tables": [TableSpec("emb", 20, 4, -1, 5)]}, InvalidArgument, r"\[-1, 5\)"),
    ({"tables": [TableSpec("emb", 20, 4, 8, 5)]}, InvalidArgument, r"\[8, 5\)"),
    ({"tables": [TableSpec("", 20, 4, 0, 5)]}, InvalidArgument, "name"),
    ({"tables": [EMB, EMB]}, InvalidArgument, "'emb' appears twice"),
    ({"optimizer": {"kind": "adam", "lr": -1.0}}, InvalidArgument, "lr=-1.0"),
    ({"optimizer": {"kind": "unspecified"}}, InvalidArgument, "unspecified"),
])
def test_register_validates(kwargs: dict[str, Any], exc: type[ShardError], named: str) -> None:
    store = Store()
    args: dict[str, Any] = {"run_id": RUN, "rank": 1, "world_size": 2, "incarnation": 0,
                            "tables": [EMB], "optimizer": ADAM, **kwargs}
    with pytest.raises(exc, match=named):
        store.register(**args)
    assert store.partitions() == []
    assert store.stats().refusals == {exc.reason: 1}


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"tables": [TableSpec("emb", 20, 8, 10, 20), SMALL]}, "dim=8"),
    ({"tables": [EMB]}, r"tables \['emb'\] != registered \['emb', 'small'\]"),
    ({"optimizer": OptimizerSpec("adam", lr=0.2)}, "lr=0.2"),
    ({"world_size": 3}, "world_size 3 != registered 2"),
])
def test_register_conflict_names_the_difference(kwargs: dict[str, Any], named: str) -> None:
    store = make_store()
    before = state(store)
    args: dict[str, Any] = {"run_id": RUN, "rank": 1, "world_size": 2, "incarnation": 5,
                            "tables": [EMB, SMALL], "optimizer": ADAM, **kwargs}
    with pytest.raises(Conflict, match=named):
        store.register(**args)
    assert_same_state(before, state(store))  # incarnation not adopted either


def test_register_refuses_rows_overlapping_another_rank() -> None:
    store = make_store()
    with pytest.raises(Conflict, match=r"overlap rows \[10, 20\) held by rank 1"):
        store.register(RUN, 0, 2, 0, [TableSpec("emb", 20, DIM, 0, 11)], ADAM)
    store.register(RUN, 0, 2, 0, [TableSpec("emb", 20, DIM, 0, 10)], ADAM)


# -- pushes: math, exactly once, step counting -----------------------------------------

def test_push_applies_sparse_adam_and_answers_the_update() -> None:
    store = make_store()
    p = push(0, [19, 10, 12])
    answer = feed(store, p)
    assert answer is not None and not answer.duplicate
    m, v = torch.zeros(10, DIM), torch.zeros(10, DIM)
    delta, decay = apply_rows_(ADAM, m, v, torch.tensor([9, 0, 2]), p.grads, 1)
    assert torch.equal(answer.ids, p.ids)
    assert torch.equal(answer.delta, delta) and answer.decay == decay == 1.0
    t = store.partition(RUN, 1).tables["emb"]  # type: ignore[union-attr]
    assert t.m is not None and t.v is not None
    assert torch.equal(t.m, m) and torch.equal(t.v, v)
    assert (t.adam_step, t.last_step, t.pushes_applied, t.rows_updated, t.distinct_touched) == (
        1, 0, 1, 3, 3)


def test_duplicate_push_returns_the_saved_answer_and_changes_nothing() -> None:
    store = make_store()
    first = feed(store, push(0, [10, 11]))
    second = feed(store, push(1, [11, 12]))
    assert first is not None and second is not None
    before = state(store)
    for step, original in ((0, first), (1, second)):
        ids = [10, 11] if step == 0 else [11, 12]
        replay = feed(store, push(step, ids))  # the same payload, re-sent
        assert replay is not None and replay.duplicate
        assert_same_answer(replay, original)
        # Another payload for an applied step is a client's bug (the saved answer would
        # hide it): refused by the payload digest, naming the step.
        with pytest.raises(Conflict, match=f"step {step} was applied with another payload"):
            feed(store, push(step, ids, seed=99))
    assert_same_state(before, state(store))
    # A newer incarnation of the rank (with the partition's secret) replaying an
    # applied step gets the saved answer.
    store.register(RUN, 1, 2, 1, [EMB, SMALL], ADAM, secret=store.secret(RUN, 1))
    replay = feed(store, push(1, [11, 12], incarnation=1))
    assert replay is not None and replay.duplicate
    assert_same_answer(replay, second)
    nxt = feed(store, push(2, [13], incarnation=1))
    assert nxt is not None and not nxt.duplicate


def test_old_and_unregistered_incarnations_are_refused() -> None:
    store = make_store()
    store.register(RUN, 1, 2, 4, [EMB, SMALL], ADAM)
    before = state(store)
    with pytest.raises(StaleIncarnation, match=r"incarnation 3 is older than .* 4"):
        feed(store, push(0, [10], incarnation=3))
    with pytest.raises(NotRegistered, match=r"incarnation 5 is newer .* register first"):
        feed(store, push(0, [10], incarnation=5))
    assert_same_state(before, state(store))


def test_out_of_order_push_is_refused() -> None:
    store = make_store()
    feed(store, push(0, [10]))
    before = state(store)
    with pytest.raises(OutOfOrder, match=r"step 2 skips ahead.* expected .* is 1"):
        feed(store, push(2, [10]))
    assert_same_state(before, state(store))


def test_evicted_duplicate_says_which_steps_are_held() -> None:
    store = make_store(answer_cache_steps=2)
    for step in range(4):
        feed(store, push(step, [10 + step]))
    before = state(store)
    with pytest.raises(AnswerEvicted, match=r"step 0 .* no longer held .*steps 2\.\.3"):
        feed(store, push(0, [10]))
    assert_same_state(before, state(store))
    replay = feed(store, push(2, [12]))
    assert replay is not None and replay.duplicate


def test_empty_push_advances_the_step_count_like_sparse_adam() -> None:
    store = make_store()
    empty = feed(store, push(0, []))
    assert empty is not None and empty.ids.shape == (0,) and empty.delta.shape == (0, DIM)
    p = push(1, [15])
    answer = feed(store, p)
    assert answer is not None
    t = store.partition(RUN, 1).tables["emb"]  # type: ignore[union-attr]
    assert (t.adam_step, t.last_step, t.pushes_applied, t.rows_updated) == (2, 1, 2, 1)
    # The kernel ran with step 2: SparseAdam's bias correction after two step() calls.
    delta, _ = apply_rows_(ADAM, torch.zeros(10, DIM), torch.zeros(10, DIM),
                           torch.tensor([5]), p.grads, 2)
    assert torch.equal(answer.delta, delta)


def test_empty_pushes_match_sparse_adam_with_an_empty_gradient() -> None:
    """SparseAdam.step() with an all-zero-nnz gradient still advances state['step']."""
    store = Store()
    table = TableSpec("t", 8, 3, 0, 8)
    store.register("r", 0, 1, 0, [table], ADAM)
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(8, 3))
    opt = torch.optim.SparseAdam([weight], lr=0.1)
    ours = weight.detach().clone()
    session = store.open_session()
    for step, ids in enumerate([[1, 3], [], [], [3, 7], [], [0]]):
        ids_t = torch.tensor(ids, dtype=torch.int64)
        grads = torch.randn(len(ids), 3)
        weight.grad = torch.sparse_coo_tensor(ids_t[None], grads, (8, 3), check_invariants=True)
        opt.step()
        answer = session.feed(PushChunk("r", 0, 0, step, "t", ids_t, grads))
        assert answer is not None
        ours.index_add_(0, answer.ids, answer.delta)
    assert torch.equal(ours, weight.detach())


# -- bad pushes: right exception, value named, state unchanged --------------------------

I64_MAX = 2**63 - 1
BAD_PUSHES: list[tuple[str, dict[str, Any], type[ShardError], str]] = [
    ("unknown run", {"run": "nope"}, NotRegistered, "run 'nope' rank 1 is not registered"),
    ("unknown rank", {"rank": 0}, NotRegistered, "rank 0 is not registered"),
    ("unknown table", {"table": "huh"}, NotFound, "table 'huh' is not registered"),
    ("negative id", {"ids": [10, -1]}, RowOutOfRange, r"id -1 .*\[10, 20\)"),
    ("id below range", {"ids": [9]}, RowOutOfRange, r"id 9 .*\[10, 20\)"),
    ("id too large", {"ids": [10, 20]}, RowOutOfRange, r"id 20 .*\[10, 20\)"),
    ("int64 max", {"ids": [I64_MAX]}, RowOutOfRange, rf"id {I64_MAX} \(int64 max\)"),
    ("duplicate ids", {"ids": [12, 13, 12]}, InvalidArgument, "id 12 appears more than once"),
    ("duplicate sorted ids", {"ids": [12, 13, 13]}, InvalidArgument,
     "id 13 appears more than once"),
    ("bad id after a duplicate", {"ids": [12, 12, 20]}, RowOutOfRange,
     r"id 20 at position 2 .*\[10, 20\)"),
    ("ids int32", {"ids_tensor": torch.tensor([10], dtype=torch.int32)}, InvalidArgument,
     "1-D int64 .* torch.int32"),
    ("ids 2-D", {"ids_tensor": torch.tensor([[10, 11]])}, InvalidArgument, r"shape \[1, 2\]"),
    ("grads dim", {"grads": torch.zeros(2, DIM + 1)}, InvalidArgument, r"shape \[2, 5\]"),
    ("grads 1-D", {"grads": torch.zeros(2)}, InvalidArgument, r"shape \[2\]"),
    ("grads dtype", {"grads": torch.zeros(2, DIM, dtype=torch.float64)}, InvalidArgument,
     "float64"),
    ("grads rows", {"grads": torch.zeros(3, DIM)}, InvalidArgument, "3 rows for 2 ids"),
    ("nan", {"grads": torch.tensor([[0.0] * DIM, [0, 0, float("nan"), 0]])},
     NonFiniteGradient, r"id 11 \(row 1, column 2\) is nan"),
    ("inf", {"grads": torch.tensor([[float("-inf")] + [0.0] * (DIM - 1), [0.0] * DIM])},
     NonFiniteGradient, "id 10 .* is -inf"),
    ("negative step", {"step": -1}, InvalidArgument, "step must be >= 0"),
    ("bad chunk index", {"chunk": 2, "num_chunks": 2}, InvalidArgument, "chunk=2 num_chunks=2"),
    ("chunk without start", {"chunk": 1, "num_chunks": 2}, InvalidArgument,
     "starting with chunk 0"),
]


@pytest.fixture(params=["native", "torch"])
def row_kernel(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each kernel choice: the push checks and row marks run in C or in torch."""
    if request.param == "native" and native.ext is None:
        pytest.skip(f"native kernels not built ({native.load_error})")
    before = optim.kernel_info()["requested"]
    optim.set_kernel(request.param)
    yield request.param
    optim.set_kernel(before)


@pytest.mark.parametrize(("case", "changes", "exc", "named"), BAD_PUSHES,
                         ids=[c[0] for c in BAD_PUSHES])
@pytest.mark.usefixtures("row_kernel")
def test_bad_push_is_refused_without_state_change(case: str, changes: dict[str, Any],
                                                  exc: type[ShardError], named: str) -> None:
    store = make_store()
    feed(store, push(0, [10, 11]))
    before = state(store)
    args: dict[str, Any] = {"step": 1, "ids": [10, 11], **changes}
    ids_tensor = args.pop("ids_tensor", None)
    chunk = push(args.pop("step"), args.pop("ids"), **args)
    if ids_tensor is not None:
        chunk.ids = ids_tensor
    with pytest.raises(exc, match=named) as info:
        feed(store, chunk)
    assert type(info.value) is exc
    assert_same_state(before, state(store))
    stats = store.stats()
    assert stats.refusals == {exc.reason: 1}
    # Counted on the partition's table when the push names one that exists.
    emb_row = next(r for r in stats.partitions if r.table == "emb")
    owned = changes.get("run", RUN) == RUN and changes.get("rank", 1) == 1 and (
        changes.get("table", "emb") == "emb")
    assert emb_row.refusals == ({exc.reason: 1} if owned else {})
    assert emb_row.queue_depth == 0
    # The next good push is answered as if the bad one had never been sent.
    good = push(1, [10, 12])
    answer = feed(store, good)
    reference = make_store()
    feed(reference, push(0, [10, 11]))
    expected = feed(reference, push(1, [10, 12]))
    assert answer is not None and expected is not None
    assert_same_answer(answer, expected)


# -- chunked pushes --------------------------------------------------------------------

def chunks_of(step: int, ids: list[int], sizes: list[int], seed: int = 7) -> list[PushChunk]:
    whole = push(step, ids, seed=seed)
    out, start = [], 0
    for i, size in enumerate(sizes):
        out.append(push(step, ids[start:start + size], grads=whole.grads[start:start + size],
                        chunk=i, num_chunks=len(sizes)))
        start += size
    return out


def test_chunked_push_applies_once_when_the_last_chunk_arrives() -> None:
    store, reference = make_store(), make_store()
    ids = [10, 14, 11, 19, 17, 12]
    expected = feed(reference, push(0, ids, seed=7))
    session = store.open_session()
    parts = chunks_of(0, ids, [2, 3, 1])
    before = state(store)
    for c in parts[:-1]:
        assert session.feed(c) is None
        assert_same_state(before, state(store))  # nothing applied while chunks buffer
    answer = session.feed(parts[-1])
    assert answer is not None and expected is not None
    assert_same_answer(answer, expected)
    assert_same_state(state(reference), state(store))


@pytest.mark.parametrize(("bad_index", "mutate", "exc", "named"), [
    (1, {"grads_nan": True}, NonFiniteGradient, "chunk 1 of 3"),
    (2, {"ids": [99]}, RowOutOfRange, "id 99"),
    (2, {"ids": [10]}, InvalidArgument, "id 10 appears in more than one chunk"),
    (1, {"step": 5}, InvalidArgument, "waits for chunk 1 of 3"),
    (1, {"chunk": 2}, InvalidArgument, "expected chunk 1 of 3"),
])
def test_bad_chunk_drops_the_whole_push(bad_index: int, mutate: dict[str, Any],
                                        exc: type[ShardError], named: str) -> None:
    store = make_store()
    session = store.open_session()
    parts = chunks_of(0, [10, 11, 12, 13, 14], [2, 2, 1])
    bad = parts[bad_index]
    if mutate.get("grads_nan"):
        bad.grads = bad.grads.clone()
        bad.grads[0, 0] = float("nan")
    if "ids" in mutate:
        bad.ids = torch.tensor(mutate["ids"], dtype=torch.int64)
    if "step" in mutate:
        bad.step = mutate["step"]
    if "chunk" in mutate:
        bad.chunk = mutate["chunk"]
    for c in parts[:bad_index]:
        session.received(c)
        assert session.feed(c) is None
    session.received(bad)
    before = state(store)
    with pytest.raises(exc, match=named):
        session.feed(bad)
    assert_same_state(before, state(store))
    assert session.buffered_chunks == 0
    assert all(r.queue_depth == 0 for r in store.stats().partitions)
    # The session continues with a fresh push: the same answer as an unchunked reference.
    fresh = chunks_of(0, [10, 11, 12, 13, 14], [3, 2])
    assert session.feed(fresh[0]) is None
    answer = session.feed(fresh[1])
    reference = make_store()
    expected = feed(reference, push(0, [10, 11, 12, 13, 14], seed=7))
    assert answer is not None and expected is not None
    assert_same_answer(answer, expected)


def test_chunked_duplicate_is_answered_after_its_last_chunk() -> None:
    store = make_store()
    ids = [10, 11, 12, 13]
    first = feed(store, push(0, ids, seed=7))
    session = store.open_session()
    parts = chunks_of(0, ids, [2, 2])
    assert session.feed(parts[0]) is None
    replay = session.feed(parts[1])
    assert replay is not None and replay.duplicate and first is not None
    assert_same_answer(replay, first)


def test_num_chunks_zero_means_one() -> None:
    store = make_store()
    answer = feed(store, push(0, [10], num_chunks=0))
    assert answer is not None and answer.step == 0


# -- queue depth, stats, flush ---------------------------------------------------------

def test_queue_depth_counts_received_pushes_until_answered() -> None:
    store = make_store()
    session = store.open_session()
    a, b = push(0, [10]), chunks_of(1, [11, 12], [1, 1])
    for c in (a, b[0]):
        session.received(c)

    def depth() -> int:
        return next(r.queue_depth for r in store.stats().partitions if r.table == "emb")

    assert depth() == 2
    session.feed(a)
    assert depth() == 1
    session.feed(b[0])
    session.received(b[1])
    assert depth() == 1  # a chunked push counts once
    session.feed(b[1])
    assert depth() == 0
    session.received(push(2, [13]))
    session.close()  # stream ended before the push was fed
    assert depth() == 0


def test_stats_snapshot() -> None:
    store = make_store()
    store.register(RUN, 0, 2, 0, [TableSpec("emb", 20, DIM, 0, 10)], ADAM)
    for step, ids in enumerate([[10, 11], [11, 12, 13], []]):
        feed(store, push(step, ids))
    feed(store, push(0, [2], table="small", dim=2))
    with pytest.raises(RowOutOfRange):
        feed(store, push(3, [5]))
    with pytest.raises(NotRegistered):
        feed(store, push(0, [1], run="other"))
    stats = store.stats()
    rows = {(r.rank, r.table): r for r in stats.partitions}
    assert set(rows) == {(0, "emb"), (1, "emb"), (1, "small")}
    emb = rows[(1, "emb")]
    assert (emb.pushes_applied, emb.rows_updated, emb.distinct_rows_touched) == (3, 5, 4)
    assert (emb.last_step, emb.lag_steps, emb.rows_held) == (2, 0, 10)
    assert emb.state_bytes == 2 * 10 * DIM * 4 + 2 * 10  # m and v; two flags a row
    assert emb.refusals == {"row_out_of_range": 1}
    assert emb.rows_per_second > 0
    assert emb.optimizer.startswith("adam(lr=0.1")
    assert (rows[(1, "small")].last_step, rows[(1, "small")].lag_steps) == (0, 2)
    assert (rows[(0, "emb")].last_step, rows[(0, "emb")].lag_steps) == (-1, 3)
    assert stats.refusals == {"row_out_of_range": 1, "not_registered": 1}
    assert (stats.pushes_applied_total, stats.rows_updated_total) == (4, 6)
    assert store.stats(run_id="other").partitions == []


def test_flush_waits_for_the_step_and_times_out_naming_who_is_behind() -> None:
    async def scenario() -> None:
        store = make_store()
        core = ShardCore(store, update_threads=1, flush_timeout_s=5.0)
        try:
            session = core.open_session()
            waiter = asyncio.create_task(core.flush(RUN, -1, 0))
            await asyncio.sleep(0.05)
            assert not waiter.done()
            await core.feed(session, push(0, [10]))
            await core.feed(session, push(0, [1], table="small", dim=2))
            applied = await asyncio.wait_for(waiter, 5)
            assert {(r.rank, r.table, r.last_step) for r in applied} == {
                (1, "emb", 0), (1, "small", 0)}
            await core.feed(session, push(1, [10]))
            with pytest.raises(FlushTimeout, match=re.escape(
                    "still behind after 0.1s: rank 1 table 'small' at step 0")):
                await core.flush(RUN, 1, 1, timeout_s=0.1)
            with pytest.raises(NotRegistered, match="rank 0 is not registered"):
                await core.flush(RUN, 0, 0)
            with pytest.raises(NotRegistered, match="no rank of it"):
                await core.flush("other", -1, 0)
        finally:
            core.shutdown()

    asyncio.run(scenario())


def _record_feed_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of the thread of every ps.core.shard_core._feed_float32 call, as they happen."""
    import threading

    import ps.core.shard_core

    threads: list[str] = []
    feed = ps.core.shard_core._feed_float32

    def spy(session: Any, chunk: PushChunk) -> Any:
        threads.append(threading.current_thread().name)
        return feed(session, chunk)

    monkeypatch.setattr(ps.core.shard_core, "_feed_float32", spy)
    return threads


@pytest.mark.parametrize("inline_elements", [0, 1 << 16])
def test_small_pushes_apply_on_the_loop_and_large_ones_in_the_pool_alike(
        monkeypatch: pytest.MonkeyPatch, inline_elements: int) -> None:
    """Pushes up to INLINE_FEED_ELEMENTS gradient elements skip the update pool; both
    paths give the answers of the Store fed directly."""
    import threading

    import ps.core.shard_core

    monkeypatch.setattr(ps.core.shard_core, "INLINE_FEED_ELEMENTS", inline_elements)
    threads = _record_feed_threads(monkeypatch)
    pushes = [push(step, [10, 12 + step, 19]) for step in range(3)]

    async def scenario() -> list[Any]:
        core = ShardCore(make_store(), update_threads=1)
        try:
            session = core.open_session()
            return [await core.feed(session, p) for p in pushes]
        finally:
            core.shutdown()

    got = asyncio.run(scenario())
    direct = make_store().open_session()
    for answer, p in zip(got, pushes, strict=True):
        want = direct.feed(p)
        assert answer is not None and want is not None
        assert torch.equal(answer.ids, want.ids) and torch.equal(answer.delta, want.delta)
    on_loop = [name == threading.main_thread().name for name in threads]
    assert on_loop == [bool(inline_elements)] * 3, threads


def test_chunked_push_applies_in_the_pool_however_small_its_chunks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The last chunk applies the whole push, so a chunked push never runs on the loop."""
    import threading

    threads = _record_feed_threads(monkeypatch)

    async def scenario() -> Any:
        core = ShardCore(make_store(), update_threads=1)
        try:
            session = core.open_session()
            assert await core.feed(session, push(0, [10, 11], chunk=0, num_chunks=2)) is None
            return await core.feed(session, push(0, [12], chunk=1, num_chunks=2))
        finally:
            core.shutdown()

    answer = asyncio.run(scenario())
    assert answer is not None and answer.ids.tolist() == [10, 11, 12]
    assert threading.main_thread().name not in threads and len(threads) == 2, threads
