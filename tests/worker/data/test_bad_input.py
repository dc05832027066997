"""Bad input files: each problem is one DataError line naming the file, the row group
(where the problem is in one) and the column, before training (the files' metadata) or at
the batch that holds the bad row group; nothing is trained on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.testing.files_data import write_parquet_set
from worker.config.train_config import TrainConfig
from worker.data.errors import DataError
from worker.data.task import FilesTask


def task(folder: Path, **flags: object) -> FilesTask:
    cfg = TrainConfig.of(local_optimizer=True, task="files",
                         train_files=str(folder / "*.parquet"), batch_size=8, num_rows=50,
                         **flags)
    return FilesTask(cfg)


def error(folder: Path, *, steps: int = 0, **flags: object) -> str:
    """The one line a task over `folder` fails with (building it, or reading `steps` steps)."""
    with pytest.raises(DataError) as info:
        t = task(folder, **flags)
        for step in range(steps):
            t.batch(step, 0, 1)
    line = str(info.value)
    assert "\n" not in line, line
    return line


def test_a_missing_column_names_file_and_column(tmp_path: Path) -> None:
    write_parquet_set(tmp_path, [[20], [20]])
    second = tmp_path / "part-001.parquet"
    pq.write_table(pq.read_table(second).drop(["dense_1"]), second)
    assert error(tmp_path).startswith(f"{second}: column dense_1: missing (the file has ")


def test_a_wrong_dtype_names_file_and_column(tmp_path: Path) -> None:
    write_parquet_set(tmp_path, [[20]])
    path = tmp_path / "part-000.parquet"
    table = pq.read_table(path)
    table = table.set_column(table.schema.get_field_index("cat_0"), "cat_0",
                             pa.array(np.linspace(0, 1, 20)))
    pq.write_table(table, path)
    assert error(tmp_path) == (f"{path}: column cat_0: type float, expected table cat_0's "
                               "ids (int64, or list<int64>)")
    table = table.set_column(table.schema.get_field_index("cat_0"), "cat_0",
                             pa.array(["a"] * 20))
    pq.write_table(table, path)
    assert "column cat_0: type other (string)" in error(tmp_path)


def test_an_id_beyond_its_table_is_refused_or_hashed(tmp_path: Path) -> None:
    write_parquet_set(tmp_path, [[20, 20]], rows=1000, seed=3)
    line = error(tmp_path, steps=5, shuffle_buffer=0)
    assert line.startswith(f"{tmp_path / 'part-000.parquet'}: row group 0: column cat_0: id ")
    assert "outside table cat_0's 50 rows" in line and "--id-overflow hash" in line
    hashed = task(tmp_path, id_overflow="hash")
    for step in range(5):
        b = hashed.batch(step, 0, 1)
        assert int(b.ids["cat_0"].min()) >= 0 and int(b.ids["cat_0"].max()) < 50
        bag_ids = b.bags["cat_1"][0]
        assert bag_ids.numel() == 0 or int(bag_ids.max()) < 50
    # the bad row group is the second one: the first batches train, its batch fails
    write_parquet_set(tmp_path, [[20, 20]], rows=50)
    path = tmp_path / "part-000.parquet"
    first, second = (pq.ParquetFile(path).read_row_group(i) for i in range(2))
    second = second.set_column(3, "cat_0", pa.array(np.full(20, 77, np.int64)))
    with pq.ParquetWriter(path, first.schema) as w:
        w.write_table(first)
        w.write_table(second)
    ok = task(tmp_path, shuffle_buffer=0)
    ok.batch(0, 0, 1)
    ok.batch(1, 0, 1)  # rows 8..15: row group 0
    with pytest.raises(DataError, match=r"part-000.parquet: row group 1: column cat_0: id 77 "):
        ok.batch(2, 0, 1)  # rows 16..23 reach into row group 1


def test_empty_and_corrupt_files(tmp_path: Path) -> None:
    write_parquet_set(tmp_path, [[20], [20]])
    empty = tmp_path / "part-001.parquet"
    empty.write_bytes(b"")
    assert error(tmp_path) == f"{empty}: an empty file"
    # no rows: a valid file with a schema and nothing in it
    pq.write_table(pq.read_table(tmp_path / "part-000.parquet").slice(0, 0), empty)
    assert error(tmp_path) == f"{empty}: no rows"
    # a truncated file: no footer
    good = (tmp_path / "part-000.parquet").read_bytes()
    empty.write_bytes(good[: len(good) // 2])
    assert error(tmp_path).startswith(f"{empty}: not a readable Parquet file (")
    # the footer is intact, a data page is not: found at the row group's batch
    empty.unlink()
    path = tmp_path / "part-000.parquet"
    meta = pq.ParquetFile(path).metadata.row_group(0)
    column = meta.column(3)  # cat_0's chunk
    data = bytearray(good)
    lo = column.data_page_offset
    data[lo + 8: lo + column.total_compressed_size - 8] = bytes(
        column.total_compressed_size - 16)
    path.write_bytes(bytes(data))
    line = error(tmp_path, steps=1)
    assert line.startswith(f"{path}: row group 0: column cat_0: cannot decode (")


def test_bad_values_in_a_row_group(tmp_path: Path) -> None:
    write_parquet_set(tmp_path, [[20]])
    path = tmp_path / "part-000.parquet"
    table = pq.read_table(path)
    labels = table.column("label").to_numpy().copy()
    labels[5] = 2
    pq.write_table(table.set_column(0, "label", pa.array(labels)), path)
    assert error(tmp_path, steps=1, shuffle_buffer=0) == (
        f"{path}: row group 0: column label: label 2 (row 5 of the row group) is not 0 or 1")
    dense = table.column("dense_1").to_numpy().copy()
    dense[3] = np.nan
    pq.write_table(table.set_column(2, "dense_1", pa.array(dense)), path)
    assert error(tmp_path, steps=1) == (
        f"{path}: row group 0: column dense_1: value nan (row 3 of the row group) is not finite")
    ids = pa.array([None, *range(19)], pa.int64())
    pq.write_table(table.set_column(3, "cat_0", ids), path)
    assert error(tmp_path, steps=1) == f"{path}: row group 0: column cat_0: 1 null values"


def test_features_file_problems(tmp_path: Path) -> None:
    write_parquet_set(tmp_path, [[20]])
    spec = tmp_path / "f.json"
    spec.write_text('{"tables": [{"column": "cat_0", "rows": 0}]}')
    assert error(tmp_path, features=str(spec)) == (
        f"--features {spec}: tables[0]: rows 0 must be an int >= 1")
    spec.write_text('{"tables": [{"column": "cat_0", "pooling": "max"}]}')
    assert "pooling 'max' is not one of mean, sum" in error(tmp_path, features=str(spec))
    spec.write_text('{"tables": [{"column": "nope"}]}')
    assert error(tmp_path, features=str(spec)).startswith(
        f"{tmp_path / 'part-000.parquet'}: column nope: missing")
