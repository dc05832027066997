"""--task files in one process: columns by convention and by --features, the batches the
DataLoader workers make equal to the in-process ones, the Task's data_state /
load_data_state, evaluation over --valid-files, and its flags' checks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridps.dynamic import DynamicSpec
from tests.testing.files_data import write_parquet_set
from tests.testing.reference_trainer import LocalEmbedding
from worker.config.preflight import files_problem
from worker.config.train_config import TrainConfig
from worker.data.errors import DataError
from worker.data.loader import pin_host_memory
from worker.data.task import FilesTask
from worker.tasks import task_class
from worker.tasks.base import Batch, HybridModel, build_dense_seeded
from worker.tasks.metrics import log_loss, roc_auc
from worker.train.trainer import num_steps


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("files")
    write_parquet_set(folder / "train", [[40, 24], [36]])
    write_parquet_set(folder / "valid", [[30], [13]], seed=1, prefix="valid")
    return folder


def config(data: Path, **flags: object) -> TrainConfig:
    base: dict[str, object] = dict(
        local_optimizer=True, task="files", train_files=str(data / "train" / "*.parquet"),
        valid_files=str(data / "valid" / "*.parquet"), batch_size=8, num_rows=50, dim=4,
        shuffle_buffer=32)
    return TrainConfig.of(**{**base, **flags})


def same(a: Batch, b: Batch) -> bool:
    return (a.size == b.size and all(torch.equal(a.values[k], b.values[k]) for k in a.values)
            and all(torch.equal(a.ids[k], b.ids[k]) for k in a.ids)
            and all(torch.equal(x, y) for k in a.bags for x, y in zip(a.bags[k], b.bags[k],
                                                                       strict=True)))


def test_the_columns_by_convention(data: Path) -> None:
    assert task_class("files") is FilesTask
    task = FilesTask(config(data, pooling="sum"))
    assert [(t.name, t.num_rows, t.dim) for t in task.tables()] == [("cat_0", 50, 4),
                                                                    ("cat_1", 50, 4)]
    assert task.spec.dense == ("dense_0", "dense_1")
    assert task.steps_per_epoch(2) == 6  # 100 rows: 50 a rank, 6 full batches of 8
    b = task.batch(0, 1, 2)
    assert b.size == 8 and set(b.ids) == {"cat_0"} and set(b.bags) == {"cat_1"}
    assert b.values["dense"].shape == (8, 2)
    assert same(task.global_batch(0, 2).slice(8, 16), b)
    names, _, bags = task.lookup_inputs(b)
    assert names == ["cat_0", "cat_1"] and bags[0] is None and bags[1] is not None
    assert bags[1][1] == "sum"


def test_features_name_columns_and_tables(data: Path, tmp_path: Path) -> None:
    spec = tmp_path / "features.json"
    spec.write_text(json.dumps({
        "dense": ["dense_1"], "id_overflow": "hash",
        "tables": [{"column": "cat_1", "name": "item", "rows": 7, "dim": 3, "pooling": "sum"},
                   {"column": "cat_0", "name": "users", "rows": 100}]}))
    task = FilesTask(config(data, features=str(spec)))
    assert [(t.name, t.num_rows, t.dim) for t in task.tables()] == [("item", 7, 3),
                                                                    ("users", 100, 4)]
    assert task.input_width() == 3 + 4 + 1
    b = task.batch(2, 0, 1)
    assert int(b.bags["item"][0].max()) < 7  # hashed into the 7 rows
    emb = LocalEmbedding(task.tables(), seed=0, init_std=0.1)
    model = HybridModel(emb, build_dense_seeded(task, 0))
    assert task.forward(model, b).shape == (8,)


@pytest.mark.e2e
def test_data_workers_give_the_same_batches(data: Path) -> None:
    inproc = FilesTask(config(data))
    workers = FilesTask(config(data, data_workers=2))
    for step in [0, 1, 2, 3, 4, 5, 6, 7, 3, 4]:  # a step out of order restarts the workers
        assert same(workers.batch(step, 1, 2), inproc.batch(step, 1, 2)), step
    workers.source.close()


def test_the_task_state_resumes_at_another_world_size(data: Path) -> None:
    run = FilesTask(config(data))
    seen = [int(v) for step in range(4) for r in range(2)
            for v in run.batch(step, r, 2).values["dense"][:, 0]]
    states = []
    for r in range(2):
        run.batch(3, r, 2)  # the rank the task runs as: that of its last batch
        states.append(run.data_state(4))
    assert [s["rank"] for s in states] == [0, 1] and states[0]["epoch"] == 0  # type: ignore[index]
    resumed = FilesTask(config(data, epochs=2))
    resumed.load_data_state(states, 4)  # no process group: a world of one
    span = resumed.source.reader(1).config.spans[0].steps
    rest = [int(v) for step in range(4, 4 + span)
            for v in resumed.batch(step, 0, 1).values["dense"][:, 0]]
    assert not set(seen) & set(rest) and len(seen) + len(rest) > 90
    # --epochs 2: the rest of epoch 0 (the remainder), then one whole epoch of 1 rank
    per = resumed.steps_per_epoch(1)
    assert per == 12 and span == (100 - len(seen)) // 8
    assert num_steps(resumed.cfg.run, resumed, 1) == 4 + span + per
    epochs = [resumed.source.reader(1).locate(step)[0] for step in range(4, 4 + span + per)]
    assert epochs == [0] * span + [1] * per
    straight = FilesTask(config(data, epochs=2))
    assert num_steps(straight.cfg.run, straight, 2) == 2 * straight.steps_per_epoch(2) == 12


def test_features_yaml_dynamic_and_sharded_tables(tmp_path: Path) -> None:
    """A --features YAML file: a dynamic table takes raw ids as they are (none refused
    nor hashed), a table names its sharding; a bad entry is one line naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    raw = np.array([10**12, -7, 3, 2**40, 5, 10**12, 0, 99], dtype=np.int64)
    pq.write_table(pa.table({"label": np.array([0, 1] * 4, np.int8), "user": raw,
                             "item": np.arange(8, dtype=np.int64) % 4}), tmp_path / "d.parquet")
    spec = tmp_path / "features.yaml"
    spec.write_text(
        "tables:\n"
        "  - {column: user, rows: 16, dynamic: {eviction: lfu, admission: always}}\n"
        "  - {column: item, rows: 4, sharding: table_wise}\n")
    cfg = TrainConfig.of(local_optimizer=True, task="files", batch_size=8, dim=4,
                         train_files=str(tmp_path / "*.parquet"), features=str(spec))
    task = FilesTask(cfg)
    user, item = task.tables()
    assert user.dynamic == DynamicSpec(eviction="lfu") and user.num_rows == 16
    assert item.dynamic is None and item.sharding == "table_wise" and user.sharding == ""
    b = task.batch(0, 0, 1)
    assert sorted(b.ids["user"].tolist()) == sorted(raw.tolist())  # raw, unchanged
    for text, message in [
        ("tables: [{column: user, dynamic: {eviction: mru}}]",
         "tables[0]: dynamic table: unknown eviction policy 'mru'"),
        ("tables: [{column: user, dynamic: {evict: lru}}]",
         "tables[0]: dynamic: unknown keys ['evict']"),
        ("tables: [{column: user, dynamic: 3}]",
         "tables[0]: dynamic 3 must be true or an object of policies"),
        ("tables: [{column: item, sharding: diagonal}]",
         "tables[0]: sharding 'diagonal' is not one of row_wise, table_wise, auto"),
        ("tables: [{column: user", "cannot read it as YAML"),
    ]:
        spec.write_text(text)
        with pytest.raises(DataError) as info:
            FilesTask(cfg)
        line = str(info.value)
        assert line.startswith(f"--features {spec}: ") and message in line, line
        assert "\n" not in line
    # true: the default policies; the same document as JSON
    (tmp_path / "f.json").write_text(json.dumps(
        {"tables": [{"column": "user", "rows": 16, "dynamic": True}, {"column": "item"}]}))
    task = FilesTask(TrainConfig.of(local_optimizer=True, task="files", batch_size=8, dim=4,
                                    train_files=str(tmp_path / "*.parquet"),
                                    features=str(tmp_path / "f.json")))
    assert task.tables()[0].dynamic == DynamicSpec()


def test_host_memory_is_pinned_only_for_a_cuda_device(data: Path) -> None:
    assert pin_host_memory("auto", cuda_available=True)
    assert pin_host_memory("cuda", cuda_available=True)
    assert not pin_host_memory("cpu", cuda_available=True)
    assert not pin_host_memory("auto", cuda_available=False)
    task = FilesTask(config(data, device="cpu"))
    assert not task.source.pin
    b = task.batch(0, 0, 1)
    assert not any(t.is_pinned() for t in [*b.ids.values(), *b.values.values()])
    if torch.cuda.is_available():  # on a GPU machine: pinned, and the copy non-blocking
        pinned = FilesTask(config(data, device="cuda"))
        assert pinned.source.pin
        got = pinned.batch(0, 0, 1)
        assert all(t.is_pinned() for t in [*got.ids.values(), *got.values.values()])
        assert same(got.to("cuda").to("cpu"), b)


def test_evaluation_over_the_valid_files(data: Path) -> None:
    task = FilesTask(config(data))
    emb = LocalEmbedding(task.tables(), seed=0, init_std=0.1)
    model = HybridModel(emb, build_dense_seeded(task, 0))
    got = task.evaluate_full(model, 0, 1)
    assert got is not None and got["heldout_samples"] == 43  # every valid row
    with torch.no_grad():
        batches = list(task.heldout_batches(0, 1, None))
        s = np.concatenate([task.forward(model, b).numpy() for b in batches])
    y = np.concatenate([b.values["label"].numpy() for b in batches])
    assert got["auc"] == pytest.approx(roc_auc(s, y), abs=1e-12)
    assert got["log_loss"] == pytest.approx(log_loss(s, y), rel=1e-6)
    quick = task.evaluate_full(model, 0, 1, quick=True)
    assert quick is not None and set(quick) == {"auc"}
    assert [b.size for b in task.heldout_batches(1, 2, None)] == [8, 8, 5]  # 21 rows a rank
    assert FilesTask(config(data, valid_files="")).evaluate_full(model, 0, 1) is None


def test_the_flags(data: Path) -> None:
    with pytest.raises(ValueError, match="task='files' needs --train-files"):
        TrainConfig.of(local_optimizer=True, task="files")
    assert files_problem(config(data)) is None
    assert files_problem(config(data, valid_files=str(data / "none-*"))) == (
        f"--valid-files '{data / 'none-*'}': no file matches")
    assert files_problem(config(data, features="/nonexistent.json")) == (
        "--features '/nonexistent.json': no such file")


def test_the_npy_and_tsv_formats_feed_the_same_task(tmp_path: Path) -> None:
    from tests.worker.tasks.test_dlrm_task import write_criteo_tsv

    rng = np.random.default_rng(0)
    n = 40
    np.save(tmp_path / "day_0_dense.npy", rng.random((n, 13)).astype(np.float32))
    np.save(tmp_path / "day_0_sparse.npy", rng.integers(0, 50, (n, 26)).astype(np.int32))
    np.save(tmp_path / "day_0_labels.npy", rng.integers(0, 2, (n, 1)).astype(np.int32))
    npy = FilesTask(config(tmp_path, train_files=str(tmp_path / "day_*.npy"), valid_files=""))
    assert len(npy.tables()) == 26 and len(npy.spec.dense) == 13
    assert npy.batch(0, 0, 1).ids["cat_25"].max() < 50
    tsv = write_criteo_tsv(tmp_path / "day_1.tsv", lines=40)
    flags = dict(train_files=str(tsv), valid_files="")
    with pytest.raises(DataError, match=r"day_1.tsv: row group 0: column cat_0: id \d+ is "
                                        r"outside table cat_0's 50 rows"):
        FilesTask(config(tmp_path, **flags)).batch(0, 0, 1)
    hashed = FilesTask(config(tmp_path, id_overflow="hash", **flags)).batch(0, 0, 1)
    assert hashed.size == 8 and int(hashed.ids["cat_0"].max()) < 50
