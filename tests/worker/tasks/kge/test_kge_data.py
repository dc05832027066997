from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hybridps.datasets import shipped_dataset
from worker.tasks.kge.data import (
    TailIndex,
    add_reciprocal,
    epoch_batches,
    eval_queries,
    load_kg_dataset,
    read_triples_file,
    sample_negatives,
)

UMLS = shipped_dataset("umls")  # hybridps/data/umls: in the repository and the package


def _write(d: Path, **splits: list[str]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for name, lines in splits.items():
        (d / f"{name}.txt").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return d


def test_load_umls_counts_and_sorted_ids() -> None:
    ds = load_kg_dataset(UMLS)
    assert (ds.num_entities, ds.num_relations) == (135, 46)
    assert ds.train.shape == (5216, 3) and ds.valid.shape == (652, 3) and ds.test.shape == (661, 3)
    assert ds.train.dtype == np.int64
    names = list(ds.entity_to_id)
    assert [ds.entity_to_id[n] for n in sorted(names)] == list(range(135))
    assert ds.kvsall_index().nnz == len(np.unique(add_reciprocal(ds.train, 46), axis=0))


def test_ids_sorted_and_independent_of_line_order(tmp_path: Path) -> None:
    lines = ["b\tr2\tc", "a\tr1\tb", "c\tr1\ta"]
    d1 = _write(tmp_path / "x", train=lines, valid=["d\tr0\ta"], test=[])
    d2 = _write(tmp_path / "y", train=lines[::-1], valid=["d\tr0\ta"], test=[])
    a, b = load_kg_dataset(d1), load_kg_dataset(d2)
    assert a.entity_to_id == b.entity_to_id == {"a": 0, "b": 1, "c": 2, "d": 3}
    assert a.relation_to_id == {"r0": 0, "r1": 1, "r2": 2}
    assert a.train.tolist() == [[1, 2, 2], [0, 1, 1], [2, 1, 0]]
    assert a.valid.tolist() == [[3, 0, 0]] and a.test.shape == (0, 3)


def test_missing_optional_splits_and_names_with_spaces(tmp_path: Path) -> None:
    d = _write(tmp_path, train=["new york\tlocated in\tusa", "usa\tpart of\tamerica"])
    ds = load_kg_dataset(d)
    assert ds.valid.shape == (0, 3) and ds.test.shape == (0, 3)
    assert "new york" in ds.entity_to_id and "located in" in ds.relation_to_id


def test_id_maps_roundtrip(tmp_path: Path) -> None:
    d = _write(tmp_path / "data", train=["a\tr\tb", "b\tr\tc"], valid=["c\tq\ta"], test=["a\tq\tc"])
    ds = load_kg_dataset(d)
    ds.save_id_maps(tmp_path / "maps")
    again = load_kg_dataset(d, id_maps_dir=tmp_path / "maps")
    assert again.entity_to_id == ds.entity_to_id and again.relation_to_id == ds.relation_to_id
    for s in ("train", "valid", "test"):
        np.testing.assert_array_equal(again.split(s), ds.split(s))
    # a name unknown to the saved maps is an error, not a silent new id
    d2 = _write(tmp_path / "data2", train=["a\tr\tzzz"])
    with pytest.raises(ValueError, match="zzz"):
        load_kg_dataset(d2, id_maps_dir=tmp_path / "maps")


@pytest.mark.parametrize(
    ("bad", "nfields"),
    [("a\tr", 2), ("a\tr\tb\tc", 4), ("a\t\tb", 3), ("", 1), ("a r b", 1)],
)
def test_malformed_line_names_file_line_and_content(tmp_path: Path, bad: str, nfields: int) -> None:
    d = _write(tmp_path, train=["a\tr\tb", "b\tr\tc", bad, "c\tr\ta"])
    with pytest.raises(ValueError) as ei:
        load_kg_dataset(d)
    msg = str(ei.value)
    assert f"{d / 'train.txt'}:3:" in msg
    assert repr(bad) in msg and f"got {nfields}" in msg


def test_crlf_lines_are_accepted(tmp_path: Path) -> None:
    p = tmp_path / "t.txt"
    p.write_bytes(b"a\tr\tb\r\nb\tr\tc\r\n")
    assert read_triples_file(p).tolist() == [["a", "r", "b"], ["b", "r", "c"]]


def test_reciprocal_and_eval_queries() -> None:
    t = np.array([[0, 1, 2], [3, 0, 4]])
    rec = add_reciprocal(t, 5)
    assert rec.tolist() == [[0, 1, 2], [3, 0, 4], [2, 6, 0], [4, 5, 3]]
    np.testing.assert_array_equal(eval_queries(t, 5), rec)


def _random_triples(rng: np.random.Generator, n: int, e: int, r: int) -> np.ndarray:
    return np.stack(
        [rng.integers(0, e, n), rng.integers(0, r, n), rng.integers(0, e, n)], axis=1
    ).astype(np.int64)


def test_tail_index_matches_dict_of_sets() -> None:
    rng = np.random.default_rng(0)
    e, r = 50, 4
    triples = _random_triples(rng, 400, e, r)
    triples = np.concatenate([triples, triples[:50]])  # duplicates
    idx = TailIndex.from_triples(triples, e, r)
    truth: dict[tuple[int, int], set[int]] = {}
    for h, rel, t in triples.tolist():
        truth.setdefault((h, rel), set()).add(t)
    assert idx.num_pairs == len(truth) and idx.nnz == sum(map(len, truth.values()))
    assert {tuple(p) for p in idx.pairs().tolist()} == set(truth)
    qh, qr = rng.integers(0, e, 200), rng.integers(0, r, 200)  # some pairs absent
    for start, end in [(0, e), (0, 17), (17, 33), (33, e), (10, 10)]:
        mask = idx.block_mask(qh, qr, start, end)
        assert mask.shape == (200, end - start)
        for i in range(200):
            want = {t - start for t in truth.get((int(qh[i]), int(qr[i])), ()) if start <= t < end}
            assert set(np.flatnonzero(mask[i]).tolist()) == want
    assert (idx.lookup(np.array([e - 1]), np.array([r - 1])) >= -1).all()


def test_tail_index_empty_and_range_checks() -> None:
    idx = TailIndex.from_triples(np.zeros((0, 3), np.int64), 5, 2)
    assert idx.block_mask(np.array([0, 1]), np.array([1, 0]), 1, 4).shape == (2, 3)
    assert not idx.block_mask(np.array([0]), np.array([1])).any()
    with pytest.raises(ValueError):
        TailIndex.from_triples(np.array([[0, 2, 1]]), 5, 2)
    with pytest.raises(ValueError):
        idx.block_mask(np.array([0]), np.array([0]), 3, 6)


def test_filter_index_contains_kvsall_index(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    lines = [f"e{h}\tr{r}\te{t}" for h, r, t in _random_triples(rng, 300, 30, 3).tolist()]
    d = _write(tmp_path, train=lines[:200], valid=lines[200:250], test=lines[250:])
    ds = load_kg_dataset(d)
    kv, filt = ds.kvsall_index(), ds.filter_index()
    q = eval_queries(ds.test, ds.num_relations)
    fm = filt.block_mask(q[:, 0], q[:, 1])
    assert fm[np.arange(len(q)), q[:, 2]].all()  # every test answer is in its own filter
    pairs = kv.pairs()
    assert (
        filt.block_mask(pairs[:, 0], pairs[:, 1]) >= kv.block_mask_by_pair(np.arange(len(kv)))
    ).all()


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_epoch_batches_cover_items_once(world_size: int) -> None:
    per_rank = [
        epoch_batches(103, 10, seed=3, epoch=2, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) == 11
    allidx = np.concatenate([x for b in per_rank for x in b])
    assert sorted(allidx.tolist()) == list(range(103))
    again = epoch_batches(103, 10, seed=3, epoch=2, rank=0, world_size=world_size)
    assert all((a == b).all() for a, b in zip(again, per_rank[0], strict=True))
    other = epoch_batches(103, 10, seed=3, epoch=3, rank=0, world_size=world_size)
    assert not all((a == b).all() for a, b in zip(other, per_rank[0], strict=True))
    assert len(epoch_batches(103, 10, seed=0, epoch=0, drop_last=True)) == 10


def test_sample_negatives() -> None:
    rng = np.random.default_rng(0)
    pos = _random_triples(rng, 500, 20, 3)
    neg = sample_negatives(pos, 20, 4, rng=7)
    assert neg.shape == (2000, 3) and neg.dtype == np.int64
    rep = np.repeat(pos, 4, axis=0)
    head_changed = neg[:, 0] != rep[:, 0]
    tail_changed = neg[:, 2] != rep[:, 2]
    assert (head_changed ^ tail_changed).all()  # exactly one side, never to the same entity
    assert (neg[:, 1] == rep[:, 1]).all()
    assert 0.4 < head_changed.mean() < 0.6
    assert neg.min() >= 0 and neg[:, [0, 2]].max() < 20
    np.testing.assert_array_equal(neg, sample_negatives(pos, 20, 4, rng=7))
    tails_only = sample_negatives(pos, 20, 2, rng=np.random.default_rng(1), mode="tail")
    assert (tails_only[:, 0] == np.repeat(pos, 2, axis=0)[:, 0]).all()
    # uniform over the other 19 entities
    many = sample_negatives(np.array([[0, 0, 5]]), 20, 19000, rng=2, mode="tail")[:, 2]
    counts = np.bincount(many, minlength=20)
    assert counts[5] == 0 and counts[np.arange(20) != 5].min() > 800
