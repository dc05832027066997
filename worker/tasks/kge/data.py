"""Knowledge-graph triples for link prediction: loading, ids, KvsAll targets, filters, negatives.

Pure numpy, no torch, no process group: every function here is deterministic from its inputs,
so every rank can build the same structures from the same files.

Files
    A dataset directory holds ``train.txt`` (required), ``valid.txt`` and ``test.txt`` (each
    optional; a missing one loads as an empty split), one triple per line,
    ``head<TAB>relation<TAB>tail``. A line that is not exactly three tab-separated non-empty
    fields (an empty line included) raises ``ValueError`` naming the file, the 1-based line
    number and the line. Only the line terminator (``\\n`` or ``\\r\\n``) is stripped; names may
    contain spaces.

Ids
    Entities (heads and tails) and relations get ids in **sorted order of their names** (Python
    / numpy code-point order) over the union of all three splits: the ids do not depend on the
    order of lines or on which split a name first appears in. ``save_id_maps(dir)`` writes
    ``entity_to_id.json`` and ``relation_to_id.json`` (name -> id); passing that directory to
    ``load_kg_dataset(..., id_maps_dir=...)`` reuses them (every name must be in the maps).

Reciprocal relations
    With ``R`` base relations, the reciprocal of ``(h, r, t)`` is ``(t, r + R, h)``, so models are
    built with ``2 R`` relations. Training adds reciprocals of every train triple; evaluation
    asks tail queries ``(h, r, ?)`` for each test triple and answers head prediction as the tail
    query ``(t, r + R, ?)`` (see ``eval_queries``).

TailIndex
    CSR map ``(h, r) -> sorted unique tails`` built with sort/unique (no per-triple Python). Used
    twice: over train + reciprocals it is the KvsAll label source (one training example per
    distinct ``(h, r)``); over train + valid + test + reciprocals it is the evaluation filter. Both
    answer ``block_mask(h, r, start, end)``: a ``[B, end - start]`` boolean mask restricted to the
    entity row range ``[start, end)`` a rank owns, so no rank ever builds a ``[B, num_entities]``
    array.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridps.datasets import resolve_data_dir

SPLITS = ("train", "valid", "test")
ENTITY_MAP_FILE = "entity_to_id.json"
RELATION_MAP_FILE = "relation_to_id.json"

StrPath = str | os.PathLike[str]


# --------------------------------------------------------------------------- reading


def read_triples_file(path: StrPath) -> np.ndarray:
    """Read a ``head<TAB>relation<TAB>tail`` file into an object array of names, shape [N, 3].

    Raises ``ValueError("<path>:<line>: ...")`` on the first malformed line.
    """
    rows: list[list[str]] = []
    with open(path, encoding="utf-8", newline="") as f:
        for lineno, raw in enumerate(f, start=1):
            line = raw[:-1] if raw.endswith("\n") else raw
            if line.endswith("\r"):
                line = line[:-1]
            fields = line.split("\t")
            if len(fields) != 3 or not all(fields):
                raise ValueError(
                    f"{path}:{lineno}: expected 3 tab-separated non-empty fields "
                    f"(head, relation, tail), got {len(fields)}: {line!r}"
                )
            rows.append(fields)
    out = np.empty((len(rows), 3), dtype=object)
    if rows:
        out[:] = rows
    return out


def _ids_for(names: np.ndarray, mapping: dict[str, int], kind: str, path: str) -> np.ndarray:
    if names.size == 0:
        return np.zeros(names.shape, dtype=np.int64)
    uniq, inv = np.unique(names.astype(str), return_inverse=True)
    try:
        ids = np.array([mapping[str(n)] for n in uniq], dtype=np.int64)
    except KeyError as e:
        raise ValueError(f"{path}: {kind} {e.args[0]!r} is not in the loaded id map") from None
    return ids[inv.reshape(names.shape)]


# --------------------------------------------------------------------------- dataset


@dataclass(frozen=True)
class KGDataset:
    """Integer triples per split ([N, 3] int64: head, relation, tail) plus the id maps."""

    train: np.ndarray
    valid: np.ndarray
    test: np.ndarray
    entity_to_id: dict[str, int]
    relation_to_id: dict[str, int]

    @property
    def num_entities(self) -> int:
        return len(self.entity_to_id)

    @property
    def num_relations(self) -> int:
        """Base relations R (models need ``2 * R`` with reciprocals)."""
        return len(self.relation_to_id)

    def split(self, name: str) -> np.ndarray:
        if name not in SPLITS:
            raise KeyError(f"unknown split {name!r}; expected one of {SPLITS}")
        arr: np.ndarray = getattr(self, name)
        return arr

    def all_triples(self) -> np.ndarray:
        return np.concatenate([self.train, self.valid, self.test], axis=0)

    def save_id_maps(self, directory: StrPath) -> None:
        save_id_maps(directory, self.entity_to_id, self.relation_to_id)

    def kvsall_index(self) -> TailIndex:
        """KvsAll labels: train triples plus their reciprocals."""
        return TailIndex.from_triples(
            add_reciprocal(self.train, self.num_relations),
            self.num_entities,
            2 * self.num_relations,
        )

    def filter_index(self) -> TailIndex:
        """Evaluation filter: every known triple (train + valid + test) plus reciprocals."""
        return TailIndex.from_triples(
            add_reciprocal(self.all_triples(), self.num_relations),
            self.num_entities,
            2 * self.num_relations,
        )


def save_id_maps(
    directory: StrPath, entity_to_id: dict[str, int], relation_to_id: dict[str, int]
) -> None:
    """Write ``entity_to_id.json`` and ``relation_to_id.json`` (name -> id) into ``directory``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for fname, mapping in ((ENTITY_MAP_FILE, entity_to_id), (RELATION_MAP_FILE, relation_to_id)):
        tmp = d / (fname + ".tmp")
        tmp.write_text(json.dumps(mapping, ensure_ascii=False, indent=0, sort_keys=False))
        tmp.replace(d / fname)


def load_id_maps(directory: StrPath) -> tuple[dict[str, int], dict[str, int]]:
    """Read the maps written by ``save_id_maps``; checks ids are exactly 0..n-1."""
    d = Path(directory)
    out: list[dict[str, int]] = []
    for fname in (ENTITY_MAP_FILE, RELATION_MAP_FILE):
        raw = json.loads((d / fname).read_text(encoding="utf-8"))
        mapping = {str(k): int(v) for k, v in raw.items()}
        if sorted(mapping.values()) != list(range(len(mapping))):
            raise ValueError(f"{d / fname}: ids are not a permutation of 0..{len(mapping) - 1}")
        out.append(mapping)
    return out[0], out[1]


def load_kg_dataset(data_dir: StrPath, id_maps_dir: StrPath | None = None) -> KGDataset:
    """Load ``train/valid/test.txt`` from ``data_dir`` (a directory, or the name of a set
    shipped in hybridps/data: ``umls``, ``kinship``) into int64 triples.

    Ids are assigned in sorted name order over all splits, unless ``id_maps_dir`` names a
    directory written by ``save_id_maps``, whose maps are then used as they are.
    """
    d = resolve_data_dir(data_dir)
    if not (d / "train.txt").is_file():
        raise FileNotFoundError(f"{d / 'train.txt'} not found")
    names: dict[str, np.ndarray] = {}
    for s in SPLITS:
        p = d / f"{s}.txt"
        names[s] = read_triples_file(p) if p.is_file() else np.empty((0, 3), dtype=object)

    if id_maps_dir is not None:
        ent_map, rel_map = load_id_maps(id_maps_dir)
    else:
        stacked = np.concatenate([names[s] for s in SPLITS], axis=0).astype(str)
        ents = np.unique(np.concatenate([stacked[:, 0], stacked[:, 2]]))
        rels = np.unique(stacked[:, 1])
        ent_map = {str(n): i for i, n in enumerate(ents)}
        rel_map = {str(n): i for i, n in enumerate(rels)}

    triples: dict[str, np.ndarray] = {}
    for s in SPLITS:
        arr = names[s]
        path = str(d / f"{s}.txt")
        out = np.empty((len(arr), 3), dtype=np.int64)
        out[:, 0] = _ids_for(arr[:, 0], ent_map, "entity", path)
        out[:, 1] = _ids_for(arr[:, 1], rel_map, "relation", path)
        out[:, 2] = _ids_for(arr[:, 2], ent_map, "entity", path)
        triples[s] = out
    return KGDataset(
        train=triples["train"],
        valid=triples["valid"],
        test=triples["test"],
        entity_to_id=ent_map,
        relation_to_id=rel_map,
    )


# --------------------------------------------------------------------------- reciprocals


def add_reciprocal(triples: np.ndarray, num_relations: int) -> np.ndarray:
    """Return ``triples`` followed by ``(t, r + num_relations, h)`` for each of them: [2N, 3]."""
    t = np.asarray(triples, dtype=np.int64).reshape(-1, 3)
    rec = np.stack([t[:, 2], t[:, 1] + num_relations, t[:, 0]], axis=1)
    return np.concatenate([t, rec], axis=0)


def eval_queries(triples: np.ndarray, num_relations: int) -> np.ndarray:
    """Evaluation queries for both directions, [2N, 3] rows ``(query_entity, rel, true_entity)``.

    Row i < N is tail prediction ``(h, r, ?)`` with answer t; row N + i is head prediction of the
    same triple expressed as the tail query ``(t, r + R, ?)`` with answer h.
    """
    return add_reciprocal(triples, num_relations)


# --------------------------------------------------------------------------- tail index


@dataclass(frozen=True)
class TailIndex:
    """CSR map from (h, r) pairs to their sorted unique tails.

    ``pair_keys[i] = h * num_relations + r`` (sorted ascending); the tails of pair i are
    ``tails[offsets[i]:offsets[i + 1]]`` (sorted ascending, unique).
    """

    num_entities: int
    num_relations: int
    pair_keys: np.ndarray  # [P] int64, sorted
    offsets: np.ndarray  # [P + 1] int64
    tails: np.ndarray  # [nnz] int64
    flat_keys: np.ndarray  # [nnz] int64: pair_index * num_entities + tail, sorted

    @classmethod
    def from_triples(cls, triples: np.ndarray, num_entities: int, num_relations: int) -> TailIndex:
        t = np.asarray(triples, dtype=np.int64).reshape(-1, 3)
        if t.size and (
            t[:, [0, 2]].min() < 0
            or t[:, [0, 2]].max() >= num_entities
            or t[:, 1].min() < 0
            or t[:, 1].max() >= num_relations
        ):
            raise ValueError("triple ids out of range for num_entities / num_relations")
        # Unique (pair, tail) combos, sorted by pair then tail, via one flat int64 key.
        pair = t[:, 0] * num_relations + t[:, 1]
        combo = np.unique(pair * num_entities + t[:, 2])
        pair_of, tails = np.divmod(combo, num_entities)
        pair_keys, starts = np.unique(pair_of, return_index=True)
        offsets = np.append(starts, len(combo)).astype(np.int64)
        pair_index = np.repeat(np.arange(len(pair_keys), dtype=np.int64), np.diff(offsets))
        flat = pair_index * num_entities + tails
        return cls(num_entities, num_relations, pair_keys, offsets, tails.astype(np.int64), flat)

    def __len__(self) -> int:
        return len(self.pair_keys)

    @property
    def num_pairs(self) -> int:
        return len(self.pair_keys)

    @property
    def nnz(self) -> int:
        return len(self.tails)

    def pairs(self) -> np.ndarray:
        """[P, 2] (head, relation) of every pair, in index order."""
        h, r = np.divmod(self.pair_keys, self.num_relations)
        return np.stack([h, r], axis=1)

    def lookup(self, heads: np.ndarray, rels: np.ndarray) -> np.ndarray:
        """Pair index of each (h, r), or -1 where the pair has no known tail."""
        key = np.asarray(heads, dtype=np.int64) * self.num_relations + np.asarray(
            rels, dtype=np.int64
        )
        if len(self.pair_keys) == 0:
            return np.full(key.shape, -1, dtype=np.int64)
        pos = np.minimum(np.searchsorted(self.pair_keys, key), len(self.pair_keys) - 1)
        return np.where(self.pair_keys[pos] == key, pos, -1).astype(np.int64)

    def block_coo_by_pair(
        self, pair_idx: np.ndarray, start: int = 0, end: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Known tails of each pair inside ``[start, end)`` as (batch_row, tail - start) arrays.

        ``pair_idx`` may contain -1 (no tails). Vectorized: two searchsorted calls on the flat
        key ``pair_index * num_entities + tail``, which is globally sorted.
        """
        end = self.num_entities if end is None else end
        if not 0 <= start <= end <= self.num_entities:
            raise ValueError(f"bad entity range [{start}, {end}) for {self.num_entities} entities")
        p = np.asarray(pair_idx, dtype=np.int64).reshape(-1)
        if len(self.pair_keys) and p.size and p.max() >= len(self.pair_keys):
            raise IndexError("pair index out of range")
        base = p * self.num_entities
        lo = np.searchsorted(self.flat_keys, base + start)
        hi = np.searchsorted(self.flat_keys, base + end)
        counts = np.where(p >= 0, hi - lo, 0)
        total = int(counts.sum())
        rows = np.repeat(np.arange(len(p), dtype=np.int64), counts)
        if total == 0:
            return rows, np.zeros(0, dtype=np.int64)
        # position of each output element inside self.tails
        first = np.repeat(lo - (np.cumsum(counts) - counts), counts)
        cols = self.tails[first + np.arange(total, dtype=np.int64)] - start
        return rows, cols

    def block_mask_by_pair(
        self, pair_idx: np.ndarray, start: int = 0, end: int | None = None
    ) -> np.ndarray:
        """[B, end - start] bool: True where the entity is a known tail of the pair."""
        end = self.num_entities if end is None else end
        rows, cols = self.block_coo_by_pair(pair_idx, start, end)
        out = np.zeros((len(np.asarray(pair_idx).reshape(-1)), end - start), dtype=bool)
        out[rows, cols] = True
        return out

    def block_mask(
        self, heads: np.ndarray, rels: np.ndarray, start: int = 0, end: int | None = None
    ) -> np.ndarray:
        """[B, end - start] bool mask of the known tails of each (h, r) within ``[start, end)``.

        As an evaluation filter it includes the query's own true tail: ``metrics`` excludes
        that column itself (``block_rank_counts(..., true_ids=...)``).
        """
        return self.block_mask_by_pair(self.lookup(heads, rels), start, end)


# --------------------------------------------------------------------------- batching


def epoch_batches(
    num_items: int,
    batch_size: int,
    *,
    seed: int,
    epoch: int,
    rank: int = 0,
    world_size: int = 1,
    shuffle: bool = True,
    drop_last: bool = False,
) -> list[np.ndarray]:
    """Index batches of one epoch for this rank.

    A permutation of ``range(num_items)`` seeded by (seed, epoch) is cut into global batches of
    ``batch_size``; each global batch is split into ``world_size`` contiguous near-equal parts and
    this rank gets part ``rank``. All ranks get the same number of steps; the union over ranks
    of all batches is every item exactly once (unless ``drop_last`` drops a short final batch).
    """
    if batch_size <= 0 or world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError("need batch_size > 0 and 0 <= rank < world_size")
    if shuffle:
        order = np.random.default_rng([seed, epoch]).permutation(num_items).astype(np.int64)
    else:
        order = np.arange(num_items, dtype=np.int64)
    out = []
    for s in range(0, num_items, batch_size):
        g = order[s : s + batch_size]
        if drop_last and len(g) < batch_size:
            break
        out.append(np.array_split(g, world_size)[rank])
    return out


# --------------------------------------------------------------------------- negatives


def sample_negatives(
    triples: np.ndarray,
    num_entities: int,
    ratio: int,
    rng: np.random.Generator | int,
    mode: str = "both",
) -> np.ndarray:
    """Uniform corruption: ``ratio`` negatives per positive, [B * ratio, 3] int64.

    Negatives of positive i are rows ``i * ratio .. (i + 1) * ratio - 1``. ``mode`` is "both"
    (head or tail with probability 1/2 each), "head" or "tail" ("tail" is the usual choice with
    reciprocal relations). The replacement is uniform over the entities other than the one
    replaced; negatives are not filtered against known triples (standard "unfiltered" sampling).
    """
    if mode not in ("both", "head", "tail"):
        raise ValueError(f"mode must be 'both', 'head' or 'tail', got {mode!r}")
    if ratio < 0 or num_entities < 2:
        raise ValueError("need ratio >= 0 and at least 2 entities")
    g = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    pos = np.asarray(triples, dtype=np.int64).reshape(-1, 3)
    neg = np.repeat(pos, ratio, axis=0)
    n = len(neg)
    if mode == "both":
        col = np.where(g.random(n) < 0.5, 0, 2)
    else:
        col = np.full(n, 0 if mode == "head" else 2)
    rows = np.arange(n)
    old = neg[rows, col]
    new = g.integers(0, num_entities - 1, size=n, dtype=np.int64)
    new = new + (new >= old)  # skip the original entity: uniform over the other E - 1
    neg[rows, col] = new
    return neg


__all__ = [
    "KGDataset",
    "TailIndex",
    "add_reciprocal",
    "epoch_batches",
    "eval_queries",
    "load_id_maps",
    "load_kg_dataset",
    "read_triples_file",
    "sample_negatives",
    "save_id_maps",
]
