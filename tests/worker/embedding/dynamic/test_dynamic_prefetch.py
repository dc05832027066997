"""Prefetching a dynamic table's next ids (worker/embedding/dynamic/prefetch.py): the translation of
step t+1 that ran on the helper thread during step t leaves every array bitwise as the
same loop translating at each lookup under the same pin rule (pin_lag 1), for each
eviction policy, with admission filters and expiry, at staleness 0, 1 and 2, on the
fused step (helper thread) and the Python steps (at the call); and a loop that breaks
the rules gets an error naming the step."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import worker.embedding.dynamic.ids as dynamic_ids
from tests.testing.spawn_helpers import run_ranks
from tests.worker.embedding.dynamic.test_dynamic_fused import _assert_same
from tests.worker.embedding.dynamic.test_dynamic_train import DIM, POOL, Run, batches, dynamic_table
from tests.worker.train.test_worker_e2e import small_config
from worker.config.train_config import TrainConfig
from worker.embedding.dynamic.slots import NATIVE, SlotTable
from worker.embedding.rows import TableConfig
from worker.embedding.sharded import ShardedEmbedding
from worker.runtime.dist import DistContext
from worker.train.trainer import Trainer


class PrefetchRun(Run):
    """Run's loop, handing step t+1's ids over after step t's lookup."""

    def after_lookup(self, step: int, data: list[torch.Tensor],
                     ids_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if step + 1 < len(data):
            self.emb.prefetch(step + 1, [self.name], [ids_of(data[step + 1])])


@pytest.mark.parametrize(("staleness", "spec", "fused"), [
    (0, {"eviction": "lru"}, True),
    (0, {"eviction": "lfu", "expire_steps": 3}, True),
    (1, {"admission": "threshold", "threshold": 2, "sketch_width": 64}, True),
    (2, {"eviction": "lru", "expire_steps": 6}, True),
    (2, {"admission": "probability", "probability": 0.5, "eviction": "lfu"}, True),
    (0, {"eviction": "lru"}, False),
    (2, {"eviction": "lfu"}, False),
])
def test_a_prefetched_step_is_the_step_translated_at_its_lookup(
        staleness: int, spec: dict[str, object], fused: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    if fused and not NATIVE:
        pytest.skip("the native extension is not built")
    threads: list[str] = []
    serve = dynamic_ids.serve_fused

    def recorded(*args: object, **kwargs: object) -> np.ndarray:
        threads.append(threading.current_thread().name)
        return serve(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(dynamic_ids, "serve_fused", recorded)
    data = batches(40, 12)
    ahead = PrefetchRun(dynamic_table(30, **spec), staleness)
    reference = Run(dynamic_table(30, **spec), staleness)
    reference.dynamic.pin_lag = 1
    for run in (ahead, reference):
        run.dynamic.fused = fused
        run.train(data)
    _assert_same(ahead, reference)
    stats = ahead.dynamic.tables[ahead.name].slots.stats
    assert stats.evictions > 0 and stats.page_ins > 0  # the stream did move rows
    if fused:  # every step but the first translated on the helper thread
        assert sum(t.startswith("hybridps-prefetch") for t in threads) == len(data) - 1
    else:
        assert not threads


@pytest.mark.skipif(not NATIVE, reason="the native extension is not built")
@pytest.mark.parametrize("staleness", [0, 1])
def test_an_evaluation_before_the_prefetched_step_reads_what_it_would_without(
        staleness: int) -> None:
    """After each step (its successor prefetched or not), every id of the pool is looked
    up without autograd: ids new at the prefetched step read zeros, ids that step expires
    still read their stored rows, victims read their rows from the store."""
    data = batches(40, 12)
    pool = torch.from_numpy(POOL)
    spec = {"eviction": "lru", "expire_steps": 2}
    runs = {"ahead": PrefetchRun(dynamic_table(26, **spec), staleness),
            "inline": Run(dynamic_table(26, **spec), staleness)}
    runs["inline"].dynamic.pin_lag = 1
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in runs}
    for step in range(len(data)):
        for name, run in runs.items():
            run.train_steps(data, range(step, min(step + 1, len(data))))
            if name == "ahead" and step + 1 < len(data):  # the evaluation comes after it
                assert run.dynamic.prefetched.pending_step == step + 1
            with torch.no_grad():
                seen[name].append(run.emb.lookup(run.name, pool))
    for step, (a, b) in enumerate(zip(seen["ahead"], seen["inline"], strict=True)):
        assert torch.equal(a, b), f"the evaluation after step {step} differs"
    assert runs["ahead"].dynamic.tables["user"].slots.stats.dropped_paged > 0


@pytest.mark.skipif(not NATIVE, reason="the native extension is not built")
def test_with_prefetch_the_previous_steps_slots_are_never_evicted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each translation keeps the ids of the slots the step before looked up (its update
    may still be landing on them): capacity 26 for 12 distinct ids a step."""
    serve = dynamic_ids.serve_fused
    kept = {"checked": 0, "evictions": 0}

    def checked(slots: SlotTable, *args: object, **kwargs: object) -> np.ndarray:
        step = args[4]
        assert isinstance(step, int)
        before_id, before_seen = slots.slot_id.copy(), slots.seen.copy()
        evictions = slots.stats.evictions
        codes = serve(slots, *args, **kwargs)  # type: ignore[arg-type]
        previous = np.flatnonzero((before_seen == step - 1) & (before_seen >= 0))
        assert np.array_equal(slots.slot_id[previous], before_id[previous]), step
        kept["checked"] += previous.size
        kept["evictions"] += slots.stats.evictions - evictions
        return codes

    monkeypatch.setattr(dynamic_ids, "serve_fused", checked)
    PrefetchRun(dynamic_table(26), 0).train(batches(30, 12))
    assert kept["checked"] > 0 and kept["evictions"] > 0


needs_native = pytest.mark.skipif(not NATIVE, reason="the native extension is not built")


def _prefetching_run() -> PrefetchRun:
    run = PrefetchRun(dynamic_table(30), 0)
    run.train_steps(batches(2, 12), range(2))  # nothing prefetched after step 1
    return run


@needs_native
def test_prefetch_needs_the_next_step_and_one_at_a_time() -> None:
    run = _prefetching_run()
    data = batches(5, 12, seed=2)
    run.window.before_step(2)
    with pytest.raises(ValueError, match=r"prefetch\(step=4\): the next step is 3"):
        run.emb.prefetch(4, [run.name], [data[4]])
    run.emb.prefetch(3, [run.name], [data[3]])
    with pytest.raises(RuntimeError, match="step 3's ids were prefetched and not looked up"):
        run.emb.prefetch(3, [run.name], [data[3]])


def _step_2_with_3_prefetched() -> tuple[PrefetchRun, list[torch.Tensor], torch.Tensor]:
    """A run at step 2, after its lookup, with step 3's ids prefetched: (run, data, the
    step's rows)."""
    run = _prefetching_run()
    data = batches(5, 12, seed=2)
    run.window.before_step(2)
    rows = run.emb.lookup(run.name, data[2])
    run.emb.prefetch(3, [run.name], [data[3]])
    return run, data, rows


def _finish_step_2(run: PrefetchRun, rows: torch.Tensor) -> None:
    rows.sum().backward()
    run.source.push(2, run.emb.pop_grads())
    run.window.before_step(3)


@needs_native
def test_a_lookup_of_other_ids_than_the_prefetched_ones_is_an_error() -> None:
    run, data, rows = _step_2_with_3_prefetched()
    with pytest.raises(RuntimeError, match="step 2: a lookup of dynamic tables after step 3"):
        run.emb.lookup(run.name, data[2])
    _finish_step_2(run, rows)
    with pytest.raises(RuntimeError, match="step 3: the first dynamic lookup"):
        run.emb.lookup(run.name, data[4])


@needs_native
def test_no_checkpoint_of_the_slots_while_a_prefetch_is_pending() -> None:
    run, data, rows = _step_2_with_3_prefetched()
    with pytest.raises(RuntimeError, match="step 3's ids are prefetched"):
        run.dynamic.slot_state(run.name)
    with torch.no_grad():  # an evaluation waits for the translation, then reads
        assert run.emb.lookup(run.name, data[3]).shape == (data[3].numel(), DIM)
    _finish_step_2(run, rows)
    run.emb.lookup(run.name, data[3])
    assert run.dynamic.slot_state(run.name)["slot_id"].shape == (30,)


def test_prefetch_without_dynamic_tables_is_an_error() -> None:
    emb = ShardedEmbedding([TableConfig("t", 10, DIM)], seed=0)
    with pytest.raises(ValueError, match=r"no dynamic table among \['t'\]"):
        emb.prefetch(1, ["t"], [torch.arange(3)])


# -- the trainer's --pipeline (worker/train/pipeline.py after_forward) --------------------------
TRAINER_TABLES = "user:40:dynamic:lfu:expire=6,ad:30:3:dynamic:threshold=2,s:50"


def _train(ctx: DistContext, cfg: TrainConfig, *, expect_prefetch: bool = False
           ) -> tuple[dict[str, torch.Tensor], Trainer]:
    trainer = Trainer(cfg, ctx)
    try:
        if expect_prefetch:  # the unpipelined loop under the prefetching pin rule
            assert trainer.embedding.dynamic is not None
            trainer.embedding.dynamic.expect_prefetch()
        trainer.train()
        tables = trainer.embedding.gather_full(dst=0)
    finally:
        trainer.close()
    return tables or {}, trainer


def _pipeline_scenario(ctx: DistContext, tmp: str) -> None:
    cfg = small_config(task="tables", tables=TRAINER_TABLES, num_rows=300, steps=20,
                       batch_size=32 // ctx.world_size, staleness=1, eval_every=3,
                       eval_batches=1, progress=False, log_every=5)
    ck = f"{tmp}/ck"
    on, piped = _train(ctx, cfg.replace(pipeline=True, checkpoint_every=10,
                                        checkpoint_dir=ck))
    # at their lookup: steps 0 and 1 (the plan is learned on step 0) and step 10 (after
    # the checkpoint of step 9); at world size 2 every step (the module doc)
    assert piped.embedding.dynamic is not None
    assert piped.embedding.dynamic.prefetched.taken == (17 if ctx.world_size == 1 else 0)
    off, plain = _train(ctx, cfg.replace(pipeline=False), expect_prefetch=True)
    resumed, _ = _train(ctx, cfg.replace(pipeline=True, checkpoint_dir=f"{tmp}/ck2",
                                         resume_from=f"{ck}/step-0000000009"))
    assert piped.record.loss_curve == plain.record.loss_curve
    assert piped.record.eval_curve == plain.record.eval_curve
    assert len(piped.record.eval_curve) == 7
    for name in off:
        assert torch.equal(on[name], off[name]), f"table {name}: pipelined != in-step"
        assert torch.equal(on[name], resumed[name]), f"table {name}: resumed != straight"
    stats = piped.embedding.dynamic.gathered_stats()["user"]
    assert stats["evictions"] > 0 and stats["page_ins"] > 0


@pytest.mark.e2e
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [1, 2])
def test_the_pipeline_prefetches_and_changes_no_result(world: int, tmp_path: Path) -> None:
    """--pipeline with dynamic tables (local optimizer, K=1, an evaluation every 3 steps
    while the next step's translation is done, expiry after 6 steps unseen, checkpoints
    at steps 9 and 19): the same tables, losses and evaluations as the loop translating
    in the step under the same pin rule, and a resume from step 9 ends bitwise where the
    straight run ends. World 1 translates on the helper thread; world 2 in the step (the
    ids' exchange is a collective)."""
    run_ranks("tests.worker.embedding.dynamic.test_dynamic_prefetch:_pipeline_scenario",
              world, str(tmp_path))
