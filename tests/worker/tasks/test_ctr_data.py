from __future__ import annotations

import gzip
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from worker.tasks.ctr import criteo
from worker.tasks.ctr.batch import NUM_DENSE, NUM_SPARSE, CTRBatch
from worker.tasks.ctr.criteo import CriteoFormatError, criteo_row, iter_criteo_batches
from worker.tasks.ctr.synthetic import SyntheticCTR
from worker.tasks.metrics import roc_auc

TABLES = [2, 3, 10, 1000] + [97] * (NUM_SPARSE - 4)


def _line(rng: np.random.Generator, idx: int, missing: float = 0.15) -> str:
    """A Criteo-like line; I1 holds the sample index so samples can be identified."""
    f = [str(int(rng.random() < 0.3)), str(idx)]
    for _ in range(NUM_DENSE - 1):
        f.append("" if rng.random() < missing else str(int(rng.integers(-3, 100000))))
    for _ in range(NUM_SPARSE):
        f.append("" if rng.random() < missing else f"{int(rng.integers(0, 2**32)):08x}")
    return "\t".join(f)


def _write(path: Path, lines: list[str], *, final_newline: bool = True, crlf: bool = False) -> Path:
    sep = "\r\n" if crlf else "\n"
    text = sep.join(lines) + (sep if final_newline else "")
    data = text.encode()
    if path.suffix == ".gz":
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)
    return path


def _expected(lines: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    labels, dense, sparse = [], [], []
    for ln in lines:
        f = ln.split("\t")
        labels.append(float(f[0]))
        dense.append([math.log1p(max(int(x), 0)) if x else 0.0 for x in f[1:14]])
        sparse.append([criteo_row(x, j, TABLES[j]) for j, x in enumerate(f[14:])])
    return (
        np.array(labels, np.float32),
        np.array(dense, np.float32),
        np.array(sparse, np.int64),
    )


def _collect(batches: list[CTRBatch]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (
        np.concatenate([b.labels for b in batches]),
        np.concatenate([b.dense for b in batches]),
        np.concatenate([b.sparse for b in batches]),
    )


def _lines(n: int, seed: int = 0, start: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [_line(rng, start + i) for i in range(n)]


def test_parse_values_missing_and_hash(tmp_path: Path) -> None:
    lines = _lines(50)
    lines.append("1" + "\t" * 39)  # everything missing
    p = _write(tmp_path / "day_0", lines)
    batches = list(iter_criteo_batches(p, 16, TABLES))
    assert [len(b) for b in batches] == [16, 16, 16, 3]
    b0 = batches[0]
    assert b0.labels.dtype == np.float32 and b0.dense.dtype == np.float32
    assert (
        b0.sparse.dtype == np.int64 and b0.dense.shape == (16, 13) and b0.sparse.shape == (16, 26)
    )
    got = _collect(batches)
    want = _expected(lines)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6)
    assert (got[2][-1] == 0).all() and (got[1][-1] == 0).all()
    assert (got[2] >= 0).all() and (got[2] < np.array(TABLES)).all()
    assert (got[2][:, 0] <= 1).all()  # a 2-row table: row 0 missing, row 1 everything else


def test_fast_and_exact_parsers_agree(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    lines = [_line(rng, i) for i in range(300)]
    # odd but valid integers: signs, leading zeros; and a token with non-hex bytes
    lines.append("0\t+5\t-0\t007" + "\t" * 10 + "\tzz-not-hex" + "\t" * 25)
    raw = [(ln + "\n").encode() for ln in lines]
    ts = np.array(TABLES, np.int64)
    fast = criteo._parse_fast(raw, ts)
    assert fast is not None
    exact = criteo._parse(raw, [criteo._Segment(Path("x"), 0, 1, None)], ts)
    for f in ("labels", "dense", "sparse"):
        np.testing.assert_array_equal(getattr(fast, f), getattr(exact, f))
    assert exact.sparse[-1, 0] == criteo_row(b"zz-not-hex", 0, TABLES[0])


def test_crlf_and_missing_final_newline(tmp_path: Path) -> None:
    lines = _lines(20)
    a = _collect(list(iter_criteo_batches(_write(tmp_path / "a", lines, crlf=True), 8, TABLES)))
    b = _collect(
        list(iter_criteo_batches(_write(tmp_path / "b", lines, final_newline=False), 8, TABLES))
    )
    want = _expected(lines)
    for x, y, w in zip(a, b, want, strict=True):
        np.testing.assert_allclose(x, w, rtol=1e-6)
        np.testing.assert_allclose(y, w, rtol=1e-6)


def test_gzip_and_directory_streams(tmp_path: Path) -> None:
    lines = _lines(70)
    d = tmp_path / "dir"
    d.mkdir()
    # name order is the stream order; a file without final newline in the middle
    _write(d / "part-0.gz", lines[:25])
    _write(d / "part-1", lines[25:40], final_newline=False)
    _write(d / "part-2.gz", lines[40:])
    (d / ".hidden").write_text("ignored\n")
    got = _collect(list(iter_criteo_batches(d, 16, TABLES)))  # batches span files
    want = _expected(lines)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6)
    # a list of paths works too
    got2 = _collect(list(iter_criteo_batches([d / "part-0.gz", d / "part-1"], 7, TABLES)))
    np.testing.assert_array_equal(got2[2], want[2][:40])


@pytest.mark.parametrize("split", ["interleave", "bytes"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_rank_split_covers_every_sample_once(tmp_path: Path, split: str, world_size: int) -> None:
    lines = _lines(203, seed=world_size)
    d = tmp_path / "d"
    d.mkdir()
    _write(d / "a.txt", lines[:61])
    _write(d / "b.txt", lines[61:62])
    _write(d / "c.txt", lines[62:], final_newline=False)
    seen: Counter[int] = Counter()
    per_rank = []
    for r in range(world_size):
        batches = list(
            iter_criteo_batches(d, 10, TABLES, rank=r, world_size=world_size, split=split)
        )
        assert all(len(b) <= 10 for b in batches)
        per_rank.append(len(batches))
        ids = np.rint(np.expm1(np.concatenate([b.dense[:, 0] for b in batches]))).astype(int)
        seen.update(ids.tolist())
    assert seen == Counter(range(203))
    if split == "interleave":
        assert max(per_rank) - min(per_rank) <= 1


def test_drop_last(tmp_path: Path) -> None:
    p = _write(tmp_path / "f", _lines(25))
    assert [len(b) for b in iter_criteo_batches(p, 10, TABLES, drop_last=True)] == [10, 10]


def test_bytes_split_rejects_gzip(tmp_path: Path) -> None:
    p = _write(tmp_path / "f.gz", _lines(5))
    with pytest.raises(ValueError, match="uncompressed"):
        list(iter_criteo_batches(p, 4, TABLES, split="bytes"))


@pytest.mark.parametrize("split", ["interleave", "bytes"])
@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ("1\t2\t3", "expected 40 tab-separated fields, got 3"),
        ("0" + "\t" * 40, "expected 40 tab-separated fields, got 41"),
        ("0\t1\t2.5" + "\t" * 37, "I2 .*b'2.5'"),
        ("0\tabc" + "\t" * 38, "I1 .*b'abc'"),
        ("0\t99999999999999999999999" + "\t" * 38, "I1"),
        ("2" + "\t" * 39, "label must be 0 or 1"),
        ("\t" * 39, "label must be 0 or 1"),
    ],
)
def test_malformed_line_reports_file_and_line(
    tmp_path: Path, split: str, bad: str, match: str
) -> None:
    d = tmp_path / "d"
    d.mkdir()
    _write(d / "a", _lines(13))
    lines = _lines(30, seed=1)
    lines[21] = bad  # line 22 of the second file
    _write(d / "b", lines)
    with pytest.raises(CriteoFormatError, match=match) as ei:
        for r in range(2):  # the bad line is on one of the ranks
            list(iter_criteo_batches(d, 8, TABLES, rank=r, world_size=2, split=split))
    assert str(ei.value).startswith(f"{d / 'b'}:22:")


def test_gz_malformed_line_number(tmp_path: Path) -> None:
    lines = _lines(12)
    lines[9] = "0\t1"
    p = _write(tmp_path / "x.gz", lines)
    with pytest.raises(CriteoFormatError, match=r"x\.gz:10:"):
        list(iter_criteo_batches(p, 4, TABLES))


def test_table_size_validation(tmp_path: Path) -> None:
    p = _write(tmp_path / "f", _lines(3))
    with pytest.raises(ValueError):
        list(iter_criteo_batches(p, 4, [1] * 26))
    with pytest.raises(ValueError):
        list(iter_criteo_batches(p, 4, [10] * 25))
    assert len(next(iter_criteo_batches(p, 4, 50))) == 3


# --------------------------------------------------------------------------- synthetic

SIZES = [2, 50, 1000, 10**7] + [500] * 22


def test_synthetic_deterministic_and_rank_slices() -> None:
    g = SyntheticCTR(SIZES, seed=3)
    a, b = g.batch(5, 301, "train"), SyntheticCTR(SIZES, seed=3).batch(5, 301, "train")
    for f in ("labels", "dense", "sparse"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
    assert not np.array_equal(g.batch(6, 301).sparse, a.sparse)
    assert not np.array_equal(g.batch(5, 301, "valid").sparse, a.sparse)
    assert not np.array_equal(SyntheticCTR(SIZES, seed=4).batch(5, 301).sparse, a.sparse)
    for w in (2, 3, 7):
        parts = [g.batch(5, 301, "train", rank=r, world_size=w) for r in range(w)]
        assert [len(p) for p in parts] == [len(x) for x in np.array_split(np.arange(301), w)]
        for f in ("labels", "dense", "sparse"):
            np.testing.assert_array_equal(
                np.concatenate([getattr(p, f) for p in parts]), getattr(a, f)
            )
    assert [len(x) for x in g.batches(3, 10, start_step=5)] == [10, 10, 10]


def test_synthetic_shapes_ranges_and_skew() -> None:
    g = SyntheticCTR(SIZES, seed=0)
    b = g.batch(0, 20000)
    assert b.labels.dtype == np.float32 and b.dense.shape == (20000, 13)
    assert b.sparse.dtype == np.int64 and b.sparse.shape == (20000, 26)
    assert set(np.unique(b.labels).tolist()) == {0.0, 1.0}
    assert (b.sparse >= 0).all() and (b.sparse < np.array(SIZES)).all()
    assert 0.005 < (b.sparse == 0).mean() < 0.05  # missing rate 2%
    assert (b.dense >= 0).all() and np.isfinite(b.dense).all()
    counts = np.bincount(b.sparse[:, 2], minlength=1000)[1:]
    top = np.sort(counts)[::-1]
    assert top[:10].sum() > 0.2 * counts.sum()  # Zipf-like: a few hot rows
    hot = np.argsort(counts)[::-1][:10] + 1
    assert hot.max() - hot.min() > 300  # hot rows spread over the table, not rows 1..10
    big = b.sparse[:, 3]
    assert big.max() > 10**6  # large tables are used across their range


def test_planted_model_auc_on_held_out_data() -> None:
    g = SyntheticCTR(SIZES, seed=11)
    held_out = g.batch(0, 20000, "test")
    auc = roc_auc(g.planted_logits(held_out), held_out.labels)
    assert auc > 0.75
    assert 0.15 < held_out.labels.mean() < 0.45
    # the planted logits are a function of the features only
    np.testing.assert_array_equal(g.planted_logits(held_out), g.planted_logits(held_out))
    # a model that ignores the sparse features does clearly worse
    dense_only = (held_out.dense - g.dense_center) @ g.dense_weights
    assert roc_auc(dense_only, held_out.labels) < auc - 0.05
