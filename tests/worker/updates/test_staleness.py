"""--staleness-compensation predict (worker/updates/staleness.py), in one process.

A scripted update source answers each push with an update chosen by the test, so every
number below can be worked out by hand: the forward's view of the rows (what the lookups
return) is the stored rows plus, for every pushed-but-unapplied step holding a row, that
row's effective update (new row - old row) in the newest applied step, if that step
updated it. The stored rows themselves must be exactly those of a window without
compensation, whatever the predictions were.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F

from hybridps.cli import parse_config
from worker.config.train_config import TrainConfig
from worker.embedding.rows import TableConfig
from worker.embedding.sharded import ShardedEmbedding
from worker.updates.source import Grads, RowUpdate, StalenessWindow, UpdateSource
from worker.updates.staleness import RowPredictor


class ScriptedSource(UpdateSource):
    """Answers the push of (ids, values) with rows[ids] = rows[ids]*decay + values, or, with
    `rows`, rows[ids] = values (a bf16-rows "rows" answer)."""

    def __init__(self, tables: Sequence[str], decay: float = 1.0, rows: bool = False) -> None:
        super().__init__(tables, timeout_s=5.0)
        self.decay, self.rows = decay, rows

    def push(self, step: int, grads: Grads) -> None:
        for name in self.buffer.tables:
            ids_U, values_UD = grads[name]
            self.buffer.put(RowUpdate(step, name, ids_U, values_UD, self.decay, rows=self.rows))


def make(rows: list[list[float]], staleness: int, *, predict: bool = True, decay: float = 1.0,
         as_rows: bool = False, dtype: torch.dtype = torch.float32,
         ) -> tuple[ShardedEmbedding, StalenessWindow]:
    table = TableConfig("t", len(rows), len(rows[0]))
    emb = ShardedEmbedding([table], row_dtype=dtype)
    emb.weights["t"].data.copy_(torch.tensor(rows))
    predictor = RowPredictor(emb, staleness) if predict else None
    window = StalenessWindow(ScriptedSource(["t"], decay, as_rows), emb, staleness, predictor)
    return emb, window


def push(window: StalenessWindow, step: int, ids: list[int], values: list[list[float]]) -> None:
    grads = {"t": (torch.tensor(ids, dtype=torch.int64), torch.tensor(values))}
    window.source.push(step, grads)
    window.pushed(step, grads)


def view(emb: ShardedEmbedding) -> torch.Tensor:
    """What the forward sees: the lookup of every row."""
    num_rows = emb.tables["t"].num_rows
    return emb.lookup("t", torch.arange(num_rows)).detach()


def test_prediction_matches_hand_computation_k1() -> None:
    emb, window = make([[0.0]] * 5, staleness=1)
    script = {0: ([1, 2], [[1.0], [2.0]]), 1: ([2, 3], [[10.0], [20.0]]),
              2: ([1, 2], [[100.0], [200.0]])}
    expected_views = {
        0: [0, 0, 0, 0, 0],
        1: [0, 0, 0, 0, 0],      # step 0 pending, but no row has an applied update yet
        2: [0, 1, 2 + 2, 0, 0],  # step 0 applied (deltas 1: 1, 2: 2); step 1 pending: row 2
        # step 1 applied (2: +10, 3: +20); step 2 pending holds rows 1 and 2, but step 1 did
        # not update row 1: only row 2 is predicted
        3: [0, 1, 12 + 10, 20, 0],
    }
    for step in range(3):
        window.before_step(step)
        assert view(emb).flatten().tolist() == expected_views[step], step
        push(window, step, *script[step])
    window.before_step(3)
    assert view(emb).flatten().tolist() == expected_views[3]
    assert emb.weights["t"].data.flatten().tolist() == [0, 1, 12, 20, 0]  # never predicted
    window.drain(2)
    assert emb.weights["t"].data.flatten().tolist() == [0, 101, 212, 20, 0]
    assert torch.equal(view(emb), emb.weights["t"].data)


def test_prediction_is_the_effective_update_once_per_missing_step_k2() -> None:
    """adamw-like decay: the effective update is rows*decay + delta - rows, not delta; a row
    pushed in both missing steps gets it twice."""
    emb, window = make([[0.0], [2.0], [0.0]], staleness=2, decay=0.5)
    script = {0: ([1], [[4.0]]), 1: ([1], [[2.0]]), 2: ([1, 2], [[0.0], [6.0]])}
    for step in range(3):
        window.before_step(step)
        push(window, step, *script[step])
    window.before_step(3)  # step 0 applied: row 1 = 2*0.5 + 4 = 5, effective update +3
    assert emb.weights["t"].data.flatten().tolist() == [0, 5, 0]
    # Row 1 misses steps 1 and 2: 5 + 2*3. Row 2 misses step 2 but has no applied update.
    assert view(emb).flatten().tolist() == [0, 11, 0]
    push(window, 3, [0], [[1.0]])
    window.before_step(4)  # step 1 applied: row 1 = 5*0.5 + 2 = 4.5, effective -0.5
    assert view(emb).flatten().tolist() == [0, 4.5 - 0.5, 0]


def test_stored_rows_are_those_of_a_window_without_compensation() -> None:
    """Same pushes, same updates: the stored rows are bitwise equal at every step with and
    without prediction, the view differs only while an update is missing, and not after
    drain."""
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(40, 3, generator=gen).tolist()
    with_p, win_p = make(init, staleness=2, decay=0.9)
    without, win_n = make(init, staleness=2, decay=0.9, predict=False)
    predicted_any = False
    for step in range(12):
        win_p.before_step(step)
        win_n.before_step(step)
        assert torch.equal(with_p.weights["t"].data, without.weights["t"].data), step
        assert torch.equal(view(without), without.weights["t"].data)
        predicted_any |= not torch.equal(view(with_p), with_p.weights["t"].data)
        ids = torch.unique(torch.randint(0, 40, (15,), generator=gen)).tolist()
        values = torch.randn(len(ids), 3, generator=gen).tolist()
        push(win_p, step, ids, values)
        push(win_n, step, ids, values)
    assert predicted_any
    win_p.drain(11)
    win_n.drain(11)
    assert torch.equal(with_p.weights["t"].data, without.weights["t"].data)
    assert torch.equal(view(with_p), with_p.weights["t"].data)


def test_gradient_reaches_the_stored_rows_unchanged() -> None:
    init = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    emb, window = make(init, staleness=1)
    for step in range(2):
        window.before_step(step)
        push(window, step, [0, 2], [[0.5, 0.5], [1.0, -1.0]])
    window.before_step(2)
    ids = torch.tensor([2, 0, 2, 1])
    weight_N = torch.tensor([1.0, -2.0, 3.0, 0.5]).unsqueeze(1)
    rows = emb.lookup("t", ids)
    assert not torch.equal(rows.detach(), emb.weights["t"].data[ids])  # predicted
    ((rows * rows.detach()) * weight_N).sum().backward()  # a gradient depending on the view
    got = emb.pop_grads()["t"]
    # d/dw of sum(weight_n * view_n . c_n) with c = the view (detached): sum over n of
    # weight_n * view_n, accumulated per row -- the prediction changes c, not the path.
    view_rows = rows.detach()
    expected = torch.zeros(3, 2).index_add_(0, ids, weight_N * view_rows)
    assert got[0].tolist() == [0, 1, 2]
    torch.testing.assert_close(got[1], expected, rtol=0, atol=0)


def test_every_lookup_path_sees_the_prediction() -> None:
    gen = torch.Generator().manual_seed(1)
    init = torch.randn(9, 4, generator=gen).tolist()
    emb, window = make(init, staleness=1)
    for step in range(3):
        window.before_step(step)
        push(window, step, [1, 4, 8], torch.randn(3, 4, generator=gen).tolist())
    window.before_step(3)
    expected_RD = view(emb)
    assert not torch.equal(expected_RD, emb.weights["t"].data)
    ids_N = torch.tensor([8, 0, 4, 4, 2])
    offsets_B = torch.tensor([0, 2])
    torch.testing.assert_close(emb.lookup("t", ids_N), expected_RD[ids_N], rtol=0, atol=0)
    torch.testing.assert_close(emb.lookup_bag("t", ids_N, offsets_B, "mean"),
                               F.embedding_bag(ids_N, expected_RD, offsets_B, mode="mean"))
    plain, bag = emb.lookup_many(["t", "t"], [ids_N, ids_N], [None, (offsets_B, "sum")])
    torch.testing.assert_close(plain, expected_RD[ids_N], rtol=0, atol=0)
    torch.testing.assert_close(bag, F.embedding_bag(ids_N, expected_RD, offsets_B, mode="sum"))
    start, block_RD = emb.local_block("t")
    assert start == 0
    torch.testing.assert_close(block_RD.detach(), expected_RD, rtol=0, atol=0)


def test_bf16_rows_answers_predict_the_difference_of_the_rows() -> None:
    emb, window = make([[1.0], [1.0]], staleness=1, as_rows=True, dtype=torch.bfloat16)
    window.before_step(0)
    push(window, 0, [0], [[1.5]])
    window.before_step(1)
    push(window, 1, [0], [[2.25]])
    window.before_step(2)  # row 0 set to 1.5 (a change of +0.5), step 1 pending
    assert emb.weights["t"].dtype == torch.bfloat16
    assert view(emb).flatten().tolist() == [2.0, 1.0]  # fp32 view: 1.5 + 0.5


def test_memory_is_bounded_by_the_rows_of_the_last_k_plus_1_steps() -> None:
    """Only the newest applied step's deltas are kept: rows touched once keep no state for
    long, and a row back after a gap gets no prediction."""
    emb, window = make([[0.0]] * 50, staleness=1)
    predictor = window.predictor
    assert predictor is not None
    for step in range(31):
        window.before_step(step)
        ids_L = predictor.deltas["t"][0]
        assert ids_L.numel() <= 1, (step, ids_L)  # the rows of step `applied_through`
        assert len(predictor.pushed) <= 2  # K pending steps (+ the newest push until refresh)
        push(window, step, [step] if step != 30 else [0], [[1.0]])
    window.before_step(31)
    # Row 0 was touched at step 0 and again at step 30: its update of step 0 is forgotten.
    assert view(emb)[0].item() == emb.weights["t"].data[0].item() == 1.0


def test_state_dict_round_trip_and_reshard() -> None:
    gen = torch.Generator().manual_seed(2)
    init = torch.randn(20, 2, generator=gen).tolist()
    emb, window = make(init, staleness=2)
    for step in range(6):
        window.before_step(step)
        ids = torch.unique(torch.randint(0, 20, (8,), generator=gen)).tolist()
        push(window, step, ids, torch.randn(len(ids), 2, generator=gen).tolist())
    # A checkpoint after the push of step 5: rows as step 6 sees them, the pending updates
    # and the predictor's state; a fresh window restored from them continues identically.
    pending = window.pending_at(5)
    assert window.predictor is not None
    state = window.predictor.state_dict()
    emb2, window2 = make(emb.weights["t"].data.tolist(), staleness=2)
    window2.restore_pending(window.applied_through, pending)
    assert window2.predictor is not None
    window2.predictor.load_state_dict(state)
    for step in range(6, 9):
        window.before_step(step)
        window2.before_step(step)
        assert torch.equal(view(emb2), view(emb)), step
        assert not torch.equal(view(emb), emb.weights["t"].data)
        ids = torch.unique(torch.randint(0, 20, (8,), generator=gen)).tolist()
        values = torch.randn(len(ids), 2, generator=gen).tolist()
        push(window, step, ids, values)
        push(window2, step, ids, values)
    # Re-sharded: each of 2 ranks keeps its own rows of the saved (global) state.
    table = TableConfig("t", 20, 2)
    for rank in (0, 1):
        part = ShardedEmbedding([table], rank=rank, world_size=2)
        predictor = RowPredictor(part, 2)
        predictor.load_state_dict([state])
        start, end = part.ranges["t"]
        ids_L, delta_LD = predictor.deltas["t"]
        mine = (state["deltas"]["t"]["ids"] >= start) & (state["deltas"]["t"]["ids"] < end)
        assert torch.equal(ids_L, state["deltas"]["t"]["ids"][mine])
        assert torch.equal(delta_LD, state["deltas"]["t"]["delta"][mine])
        for step, tables in predictor.pushed.items():
            saved = state["pushed"][step]["t"]
            assert torch.equal(tables["t"], saved[(saved >= start) & (saved < end)])
    with pytest.raises(ValueError, match="format"):
        predictor.load_state_dict({"format": "something else"})


def test_predictor_needs_staleness() -> None:
    emb = ShardedEmbedding([TableConfig("t", 3, 2)])
    with pytest.raises(ValueError, match="staleness=0"):
        RowPredictor(emb, 0)


def test_config_validates_and_maps_the_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="staleness_compensation='guess'"):
        TrainConfig.of(local_optimizer=True, staleness_compensation="guess")
    monkeypatch.setenv("HYBRIDPS_STALENESS_COMPENSATION", "none")
    assert parse_config(TrainConfig,
                        ["--local-optimizer"]).sync.staleness_compensation == "none"
    cfg = parse_config(TrainConfig, ["--local-optimizer", "--staleness-compensation", "predict"])
    assert cfg.sync.staleness_compensation == "predict"
