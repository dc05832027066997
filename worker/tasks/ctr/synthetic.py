"""Synthetic CTR data with a planted model (``SyntheticCTR``), for --task dlrm without data.

Same batch shape, generated from a counter-based hash RNG: every value of sample i of global
batch ``step`` of split s is a pure function of (seed, s, step, i), so a rank can generate
exactly its slice of a global batch (``rank=``/``world_size=``) and slices concatenate to the
global batch. Categorical ids are Zipf-like per table (rank k with P ~ k^-a, then an affine
bijection spreads the hot ranks over the whole row range so row-wise shards share the hot
rows), with a small missing rate mapped to row 0. Labels are Bernoulli(sigmoid(logit)) of a
planted model: per-row weights (hash-derived Gaussian, no per-row storage, so tables of any
size), a dense linear term and FM-style pairwise interactions between chosen tables.
``planted_logits(batch)`` recomputes that logit from the features, so the planted model's
own AUC on held-out data is the achievable ceiling.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np

from worker.tasks.ctr.batch import (
    NUM_DENSE,
    CTRBatch,
    check_table_sizes,
    fnv1a_bytes_matrix,
    splitmix64,
)

__all__ = ["SyntheticCTR"]

_SPLIT_IDS = {"train": 0, "valid": 1, "test": 2}


def _uniform(bits: np.ndarray) -> np.ndarray:
    """uint64 -> float64 uniform in (0, 1)."""
    return ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))


def _gauss(key: np.ndarray) -> np.ndarray:
    """Standard normal from a uint64 key (Box-Muller on two hashed uniforms)."""
    u1 = _uniform(splitmix64(key ^ np.uint64(0x5851F42D4C957F2D)))
    u2 = _uniform(splitmix64(key ^ np.uint64(0x14057B7EF767814F)))
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2)


class SyntheticCTR:
    """Deterministic synthetic CTR data with a planted logistic model (see module docstring).

    table_sizes:        rows per categorical table (row 0 = missing), any size >= 2.
    zipf_exponent:      P(popularity rank k) ~ k^-a within each table.
    missing_rate:       probability that a categorical (or dense) value is missing.
    sparse_scale:       std of the planted per-row weights.
    dense_scale:        std of the planted dense weights.
    interactions:       table pairs (a, b) with a planted FM term <v_a[row_a], v_b[row_b]>.
    interaction_dim, interaction_scale: size and std of the FM factor vectors' dot product.
    bias:               planted intercept (defaults: 25-30% positives, planted AUC ~0.83).
    """

    def __init__(
        self,
        table_sizes: Sequence[int],
        *,
        seed: int = 0,
        num_dense: int = NUM_DENSE,
        zipf_exponent: float = 1.1,
        missing_rate: float = 0.02,
        sparse_scale: float = 0.25,
        dense_scale: float = 0.2,
        interactions: Sequence[tuple[int, int]] = ((0, 1), (2, 3)),
        interaction_dim: int = 4,
        interaction_scale: float = 0.5,
        bias: float = -1.4,
    ):
        self.table_sizes = check_table_sizes(list(table_sizes), len(table_sizes))
        self.num_tables = len(self.table_sizes)
        self.num_dense = num_dense
        self.seed = int(seed)
        self.zipf_exponent = float(zipf_exponent)
        self.missing_rate = float(missing_rate)
        self.sparse_scale = float(sparse_scale)
        self.interactions = [(int(a), int(b)) for a, b in interactions]
        for a, b in self.interactions:
            if not (0 <= a < self.num_tables and 0 <= b < self.num_tables):
                raise ValueError(f"interaction tables {(a, b)} out of range")
        self.interaction_dim = int(interaction_dim)
        self.interaction_scale = float(interaction_scale)
        self.bias = float(bias)
        rng = np.random.default_rng([self.seed, 0xC7])
        self.dense_weights = rng.normal(0.0, dense_scale, size=num_dense)
        self.dense_mu = rng.normal(1.5, 0.5, size=num_dense)
        self.dense_center = np.log1p(np.exp(self.dense_mu))  # rough mean of the feature
        # affine bijection k -> (mult * k + shift) mod m on the m = n - 1 non-missing rows
        self._mult = np.empty(self.num_tables, dtype=np.uint64)
        self._shift = np.empty(self.num_tables, dtype=np.uint64)
        for j, n in enumerate(self.table_sizes):
            m = int(n) - 1
            a = int(rng.integers(1 << 19, 1 << 20)) % m or 1
            while math.gcd(a, m) != 1:
                a = a % m + 1
            self._mult[j] = a
            self._shift[j] = int(rng.integers(0, m))
        self._key = splitmix64(np.array([self.seed], dtype=np.uint64))[0]

    # -- keys
    def _sample_keys(self, split: str, step: int, gidx: np.ndarray) -> np.ndarray:
        sid = _SPLIT_IDS.get(split)
        if sid is None:
            sid = 3 + int(fnv1a_bytes_matrix(np.frombuffer(split.encode(), np.uint8)))
        k = splitmix64(np.array([self._key ^ np.uint64(sid)], dtype=np.uint64))
        k = splitmix64(k ^ np.uint64(step))
        return splitmix64(k ^ gidx.astype(np.uint64))

    @staticmethod
    def _field(keys: np.ndarray, field: int) -> np.ndarray:
        return splitmix64(keys ^ np.uint64((field + 1) * 0x2545F4914F6CDD1D % (1 << 64)))

    def _row_key(self, table: int, rows: np.ndarray, salt: int) -> np.ndarray:
        k = self._key ^ np.uint64((table + 1) * 0x9E3779B1 + salt * 0x85EBCA77)
        return splitmix64(splitmix64(np.array([k], np.uint64)) ^ rows.astype(np.uint64))

    # -- generation
    def batch(
        self, step: int, batch_size: int, split: str = "train", rank: int = 0, world_size: int = 1
    ) -> CTRBatch:
        """This rank's contiguous slice of global batch ``step`` (``np.array_split`` sizes)."""
        if not 0 <= rank < world_size:
            raise ValueError("need 0 <= rank < world_size")
        q, r = divmod(batch_size, world_size)
        lo = rank * q + min(rank, r)
        hi = lo + q + (1 if rank < r else 0)
        keys = self._sample_keys(split, step, np.arange(lo, hi, dtype=np.uint64))
        b = hi - lo

        sparse = np.empty((b, self.num_tables), dtype=np.int64)
        a = self.zipf_exponent
        for j in range(self.num_tables):
            m = int(self.table_sizes[j]) - 1
            u = _uniform(self._field(keys, j))
            if abs(a - 1.0) < 1e-9:
                k = np.floor(np.exp(u * math.log(m + 1.0)))
            else:
                top = (m + 1.0) ** (1.0 - a)
                k = np.floor((1.0 + u * (top - 1.0)) ** (1.0 / (1.0 - a)))
            k0 = np.clip(k, 1, m).astype(np.uint64) - np.uint64(1)
            rows = (k0 * self._mult[j] + self._shift[j]) % np.uint64(m)
            miss = _uniform(self._field(keys, 100 + j)) < self.missing_rate
            sparse[:, j] = np.where(miss, 0, rows.astype(np.int64) + 1)

        dense = np.empty((b, self.num_dense), dtype=np.float32)
        for i in range(self.num_dense):
            z = _gauss(self._field(keys, 200 + i))
            raw = np.floor(np.exp(self.dense_mu[i] + 1.2 * z))
            miss = _uniform(self._field(keys, 300 + i)) < self.missing_rate
            dense[:, i] = np.where(miss, 0.0, np.log1p(raw))

        batch = CTRBatch(np.zeros(b, np.float32), dense, sparse)
        p = 1.0 / (1.0 + np.exp(-self.planted_logits(batch)))
        labels = (_uniform(self._field(keys, 999)) < p).astype(np.float32)
        return CTRBatch(labels, dense, sparse)

    def batches(
        self,
        num_steps: int,
        batch_size: int,
        split: str = "train",
        rank: int = 0,
        world_size: int = 1,
        start_step: int = 0,
    ) -> Iterator[CTRBatch]:
        for step in range(start_step, start_step + num_steps):
            yield self.batch(step, batch_size, split, rank, world_size)

    # -- planted model
    def row_weights(self, table: int, rows: np.ndarray) -> np.ndarray:
        """Planted weight of each row of a table (0 for the missing row)."""
        w = self.sparse_scale * _gauss(self._row_key(table, rows, 1))
        return np.where(np.asarray(rows) == 0, 0.0, w)

    def row_factors(self, table: int, rows: np.ndarray) -> np.ndarray:
        """Planted FM factor vectors [len(rows), interaction_dim] (zero for the missing row)."""
        rows = np.asarray(rows)
        scale = math.sqrt(self.interaction_scale / math.sqrt(self.interaction_dim))
        out = np.stack(
            [_gauss(self._row_key(table, rows, 10 + d)) for d in range(self.interaction_dim)],
            axis=1,
        )
        return np.where((rows == 0)[:, None], 0.0, scale * out)

    def planted_logits(self, batch: CTRBatch) -> np.ndarray:
        """The planted model's logit for each sample of a batch, float64 [B]."""
        logit = np.full(len(batch), self.bias)
        logit += (batch.dense.astype(np.float64) - self.dense_center) @ self.dense_weights
        for j in range(self.num_tables):
            logit += self.row_weights(j, batch.sparse[:, j])
        for a, b in self.interactions:
            fa = self.row_factors(a, batch.sparse[:, a])
            fb = self.row_factors(b, batch.sparse[:, b])
            logit += (fa * fb).sum(axis=1)
        return logit
