"""Sharding, order and resume of the file reader (worker/data/sharding.py, reader.py).

The sets' dense_0 is each row's sample number, so a test sees which rows a rank read:
every epoch each row is read at most once over all ranks, the ranks agree on the step
count at uneven ends, the order is a function of the seed; resuming at the same world size
gives the same batches bitwise, at another world size no row of the epoch is read twice
and none is skipped but the new ragged tail.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.testing.files_data import write_parquet_set
from worker.data.errors import DataError
from worker.data.features import FeatureSpec, TableSpec
from worker.data.formats import list_files
from worker.data.reader import FileReader, ReaderConfig
from worker.data.samples import Samples
from worker.data.sharding import epoch_streams
from worker.data.source import scan

GROUPS = [[30, 20], [25], [40, 10, 5], [7, 13]]  # 150 rows, uneven files and row groups
TOTAL = 150
SPEC = FeatureSpec("label", ("dense_0", "dense_1"),
                   (TableSpec("cat_0", "cat_0", 50, 4), TableSpec("cat_1", "cat_1", 50, 4)))


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("pq")
    write_parquet_set(folder, GROUPS)
    return folder


def config(folder: Path, world: int, *, batch: int = 8, seed: int = 0,
           buffer: int = 16) -> ReaderConfig:
    catalog, _ = scan(str(folder / "*.parquet"), "--train-files", SPEC)
    return ReaderConfig(catalog, SPEC, batch, seed, buffer, world)


def ids(s: Samples) -> list[int]:
    return [int(v) for v in s.dense[:, 0]]


def epoch_rows(reader: FileReader, epoch: int) -> list[list[int]]:
    """Each rank's sample numbers over one epoch, in step order."""
    per = reader.steps_per_epoch
    return [[i for step in range(epoch * per, (epoch + 1) * per)
             for i in ids(reader.samples(step, rank))]
            for rank in range(reader.config.world_size)]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_row_once_an_epoch_and_the_ranks_agree_on_the_steps(data: Path,
                                                                 world: int) -> None:
    reader = FileReader(config(data, world))
    per_rank = TOTAL // world
    assert reader.steps_per_epoch == per_rank // 8  # the ragged tail is dropped
    for epoch in (0, 1):
        rows = epoch_rows(reader, epoch)
        flat = [i for r in rows for i in r]
        assert len(flat) == len(set(flat)) == world * reader.steps_per_epoch * 8
        assert set(flat) <= set(range(TOTAL))
    assert epoch_rows(reader, 0) != epoch_rows(reader, 1)  # reshuffled each epoch


def test_a_rank_reads_only_its_files_and_row_groups(data: Path) -> None:
    cfg = config(data, 3, buffer=0)
    streams = epoch_streams(cfg.catalog, 0, 0, 3, 0)
    units = [{(f, u) for seg in s for f, u, _, _ in seg.pieces} for s in streams]
    # contiguous ranges of 50 rows over the files in order: only border row groups shared
    assert units[0] == {(0, 0), (0, 1)}
    assert units[1] == {(1, 0), (2, 0)}
    assert units[2] == {(2, 0), (2, 1), (2, 2), (3, 0), (3, 1)}
    reader = FileReader(cfg)
    assert ids(reader.samples(0, 1)) == list(range(50, 58))  # in order without a buffer


def test_the_order_is_a_function_of_the_seed(data: Path) -> None:
    a, b = FileReader(config(data, 2, seed=1)), FileReader(config(data, 2, seed=1))
    c = FileReader(config(data, 2, seed=2))
    assert epoch_rows(a, 0) == epoch_rows(b, 0)
    assert epoch_rows(a, 0) != epoch_rows(c, 0)
    np.testing.assert_array_equal(a.global_samples(3).dense,
                                  np.concatenate([b.samples(3, 0).dense,
                                                  b.samples(3, 1).dense]))


@pytest.mark.parametrize("stop", [3, 9, 13])  # mid-epoch, at an epoch's start, in epoch 1
def test_resume_at_the_same_world_size_is_bitwise(data: Path, stop: int) -> None:
    straight = FileReader(config(data, 2))
    states = [straight.state(stop, r) for r in range(2)]
    resumed = FileReader(config(data, 2).resumed(states, stop))
    assert resumed.epoch_start(3) == straight.epoch_start(3) == 3 * straight.steps_per_epoch
    for step in range(stop, stop + 2 * straight.steps_per_epoch):
        for rank in range(2):
            a, b = straight.samples(step, rank), resumed.samples(step, rank)
            for x, y in ((a.label, b.label), (a.dense, b.dense), (a.ids["cat_0"], b.ids["cat_0"])):
                np.testing.assert_array_equal(x, y)
            ra, rb = a.ids["cat_1"], b.ids["cat_1"]
            np.testing.assert_array_equal(ra.values, rb.values)  # type: ignore[union-attr]
            np.testing.assert_array_equal(ra.offsets, rb.offsets)  # type: ignore[union-attr]


@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 2), (2, 1)])
def test_resume_at_another_world_size_loses_and_repeats_no_row(data: Path, old: int,
                                                               new: int) -> None:
    before = FileReader(config(data, old))
    per = before.steps_per_epoch
    stop = per + 2  # in epoch 1, two steps in
    read = [i for step in range(per, stop) for r in range(old)
            for i in ids(before.samples(step, r))]
    states = [before.state(stop, r) for r in range(old)]
    epoch_share = [i for stream in epoch_streams(before.config.catalog, 0, 1, old, 16)
                   for seg in stream for i in range(len(seg))]
    left = len(epoch_share) - len(read)  # what the old ranks had not read of epoch 1
    after = FileReader(config(data, new).resumed(states, stop))
    span = after.config.spans[0]
    assert span.first_step == stop and span.epoch == 1
    assert span.steps == (left // new) // 8
    rest = [i for step in range(stop, stop + span.steps) for r in range(new)
            for i in ids(after.samples(step, r))]
    assert len(set(read + rest)) == len(read) + len(rest)  # no row twice
    assert left - len(rest) < new * (8 + 1)  # only the new ragged tail is skipped
    # --epochs counts the remainder as the rest of epoch 1: epoch 2 starts after it
    assert after.epoch_start(2) == stop + span.steps
    assert after.epoch_start(3) == stop + span.steps + after.steps_per_epoch
    assert after.epoch_start(1) == stop  # (resumed inside epoch 1: it ends the run at once)
    assert after.locate(stop + span.steps - 1)[0] == 1 and after.locate(stop + span.steps)[0] == 2
    # the run goes on into epoch 2 in the new world's order
    nxt = ids(after.samples(stop + span.steps, 0))
    assert nxt == ids(FileReader(config(data, new)).samples(2 * after.steps_per_epoch, 0))
    # resumed again inside the remainder at its own size: bitwise
    mid = stop + 1
    again = FileReader(config(data, new).resumed([after.state(mid, r) for r in range(new)],
                                                 mid))
    for step in range(mid, stop + span.steps + 2):
        assert ids(again.samples(step, 0)) == ids(after.samples(step, 0))


def test_a_position_for_other_data_is_refused(data: Path) -> None:
    states = [FileReader(config(data, 2)).state(4, r) for r in range(2)]
    with pytest.raises(DataError, match="seed=0, this run has 5"):
        config(data, 2, seed=5).resumed(states, 4)
    with pytest.raises(DataError, match="before step 4, not 5"):
        config(data, 2).resumed(states, 5)
    assert list_files(str(data / "*.parquet"))[0].name == "part-000.parquet"
