"""The record formats: each one's round trip (what was written is what a unit reads), the
registry, and the streaming TSV -> Parquet converter equal to reading the TSV itself."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.worker.tasks.test_dlrm_task import write_criteo_tsv
from worker.data.convert import convert_tsv, main
from worker.data.errors import DataError
from worker.data.formats import (
    FORMATS,
    CriteoNpyFormat,
    CriteoTsvFormat,
    Ragged,
    format_for,
    list_files,
)
from worker.tasks.ctr.batch import NUM_SPARSE
from worker.tasks.ctr.criteo import iter_criteo_batches


def test_parquet_round_trip_by_row_group(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    lists = [[1, 2], [], [7], [3, 3, 3]]
    table = pa.table({"label": np.array([0, 1, 1, 0], np.int8),
                      "x": np.array([0.5, 1.5, 2.5, 3.5], np.float32),
                      "ids": pa.array(lists, pa.list_(pa.int64()))})
    pq.write_table(table, path, row_group_size=2)
    fmt = format_for(path)
    assert fmt.name == "parquet"
    assert fmt.units(path) == [2, 2]
    assert fmt.schema(path) == {"label": "int", "x": "float", "ids": "list<int>"}
    second = fmt.read(path, 1, ["x", "ids"])
    np.testing.assert_array_equal(second["x"], [2.5, 3.5])
    rag = second["ids"]
    assert isinstance(rag, Ragged)
    np.testing.assert_array_equal(rag.values, [7, 3, 3, 3])
    np.testing.assert_array_equal(rag.offsets, [0, 1, 4])  # re-based on the row group


def test_criteo_npy_round_trip_memory_mapped(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    n = 10
    dense = rng.integers(-2, 50, (n, 13)).astype(np.int32)
    sparse = rng.integers(0, 1000, (n, NUM_SPARSE)).astype(np.int32)
    labels = rng.integers(0, 2, (n, 1)).astype(np.int32)
    for part, arr in (("dense", dense), ("sparse", sparse), ("labels", labels)):
        np.save(tmp_path / f"day_0_{part}.npy", arr)
    fmt = CriteoNpyFormat()
    fmt.unit_rows = 4
    files = list_files(str(tmp_path / "day_*.npy"))
    assert files == [tmp_path / "day_0_labels.npy"]  # the three files: one day
    path = files[0]
    assert format_for(path).name == "criteo_npy"
    assert fmt.units(path) == [4, 4, 2]
    schema = fmt.schema(path)
    assert schema["label"] == "int" and schema["dense_12"] == "float"
    assert schema["cat_25"] == "int"
    got = fmt.read(path, 2, ["label", "dense_3", "cat_7"])
    np.testing.assert_array_equal(got["label"], labels[8:, 0])
    np.testing.assert_array_equal(got["cat_7"], sparse[8:, 7])
    want = np.log1p(np.maximum(dense[8:, 3], 0).astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(got["dense_3"], want)


def test_criteo_tsv_units_equal_the_tsv_reader(tmp_path: Path) -> None:
    tsv = write_criteo_tsv(tmp_path / "day.tsv", lines=250)
    fmt = CriteoTsvFormat()
    fmt.unit_lines = 100
    assert fmt.units(tsv) == [100, 100, 50]
    whole = next(iter_criteo_batches(tsv, 250, (1 << 62) + 1))
    cols = ["label", "dense_0", "cat_5"]
    got = [fmt.read(tsv, u, cols) for u in range(3)]
    np.testing.assert_array_equal(np.concatenate([g["label"] for g in got]), whole.labels)
    np.testing.assert_array_equal(np.concatenate([g["dense_0"] for g in got]), whole.dense[:, 0])
    np.testing.assert_array_equal(np.concatenate([g["cat_5"] for g in got]), whole.sparse[:, 5])


def test_convert_streams_tsv_to_parquet_row_groups(tmp_path: Path) -> None:
    tsv = write_criteo_tsv(tmp_path / "day.tsv", lines=230)
    paths = convert_tsv([tsv], tmp_path / "pq", rows_per_group=50, rows_per_file=100,
                        table_rows=1000)
    assert [p.name for p in paths] == ["part-00000.parquet", "part-00001.parquet",
                                       "part-00002.parquet"]
    assert [pq.ParquetFile(p).metadata.num_row_groups for p in paths] == [2, 2, 1]
    back = pa.concat_tables([pq.read_table(p) for p in paths])
    whole = next(iter_criteo_batches(tsv, 230, 1000))
    np.testing.assert_array_equal(back.column("label").to_numpy(), whole.labels)
    np.testing.assert_array_equal(back.column("dense_12").to_numpy(), whole.dense[:, 12])
    np.testing.assert_array_equal(back.column("cat_25").to_numpy(), whole.sparse[:, 25])
    assert main(["convert", str(tsv), "--output", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "part-00000.parquet").exists()


def test_the_registry_and_file_lists(tmp_path: Path) -> None:
    assert list(FORMATS) == ["parquet", "criteo_npy", "criteo_tsv"]
    assert format_for("x/day_3.txt.gz").name == "criteo_tsv"
    assert format_for("x/day_23").name == format_for("day_0.gz").name == "criteo_tsv"
    with pytest.raises(DataError, match=r"b\.csv: no record format reads this file name"):
        format_for(tmp_path / "b.csv")
    with pytest.raises(DataError, match="--valid-files 'nothing-\\*': no file matches"):
        list_files("nothing-*", "--valid-files")
