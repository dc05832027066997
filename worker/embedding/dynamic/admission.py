"""Admission of unknown ids into a dynamic table's slots (docs/dynamic_ids.md).

An id that is neither on a slot nor paged out asks to be admitted each step it is looked
up in (ids arrive deduplicated per step and owner):
- `always`: admitted;
- `threshold N`: admitted from the step it was seen in for the N-th time, counted by a
  count-min sketch (`CountMinSketch`): bounded memory (depth x width int32 counters),
  never under-counting, over-counting by at most e/width x (the sightings counted) with
  probability >= 1 - e^-depth (Cormode and Muthukrishnan 2005);
- `probability p`: admitted when a hash of (seed, id, step) falls below p: reproducible,
  and an id seen in n steps is admitted with probability 1 - (1-p)^n.

A refused id reads a row of zeros and gets no update (worker/embedding/dynamic/ids.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hybridps.dynamic import SKETCH_DEPTH, DynamicSpec, mix64, salted, unit_floats

SKETCH_FORMAT = "hybridps-count-min-v1"
_ROW_SALTS = (0x243F6A8885A308D3, 0x13198A2E03707344, 0xA4093822299F31D0,
              0x082EFA98EC4E6C89, 0x452821E638D01377, 0xBE5466CF34E90C6C)


class CountMinSketch:
    """depth x width int32 counters; add(ids) counts each id once, estimate(ids) is the
    smallest of its depth counters (module doc for the error bound)."""

    def __init__(self, width: int, depth: int = SKETCH_DEPTH) -> None:
        if not 1 <= depth <= len(_ROW_SALTS):
            raise ValueError(f"count-min depth {depth} must be in [1, {len(_ROW_SALTS)}]")
        self.width, self.depth = width, depth
        self.counts = np.zeros((depth, width), dtype=np.int32)
        self.added = 0  # sightings counted (the N of the error bound)

    @property
    def nbytes(self) -> int:
        return int(self.counts.nbytes)

    def clear(self) -> None:
        """Nothing counted."""
        self.counts[:] = 0
        self.added = 0

    def _columns(self, ids: np.ndarray) -> list[np.ndarray]:
        u = np.ascontiguousarray(ids, dtype=np.int64).view(np.uint64)
        return [(salted(u, _ROW_SALTS[r]) % np.uint64(self.width)).astype(np.int64)
                for r in range(self.depth)]

    def add(self, ids: np.ndarray) -> np.ndarray:
        """Count each id once; returns the new estimates."""
        cols = self._columns(ids)
        for r, c in enumerate(cols):
            np.add.at(self.counts[r], c, 1)
        self.added += int(ids.size)
        return self._estimate(cols)

    def estimate(self, ids: np.ndarray) -> np.ndarray:
        return self._estimate(self._columns(ids))

    def _estimate(self, cols: list[np.ndarray]) -> np.ndarray:
        if not cols or cols[0].size == 0:
            return np.zeros(0, dtype=np.int64)
        return np.min(np.stack([self.counts[r][c] for r, c in enumerate(cols)]), axis=0
                      ).astype(np.int64)

    def error_bound(self) -> float:
        """The over-count bound e/width x sightings (holds w.p. >= 1 - e^-depth)."""
        return float(np.e / self.width * self.added)

    def state_dict(self) -> dict[str, Any]:
        return {"format": SKETCH_FORMAT, "counts": self.counts.copy(), "added": self.added}

    def merge(self, state: dict[str, Any]) -> None:
        """Add another sketch's counts (same width and depth): still an upper bound."""
        counts = np.asarray(state["counts"])
        if state.get("format") != SKETCH_FORMAT or counts.shape != self.counts.shape:
            raise ValueError(f"count-min sketch of shape {list(counts.shape)} cannot merge "
                             f"into {list(self.counts.shape)}")
        self.counts += counts.astype(np.int32)
        self.added += int(state.get("added", 0))


class Admission:
    """`admit(ids, step)`: which of these unknown ids (distinct) are admitted this step."""

    def __init__(self, spec: DynamicSpec, seed: int, table_index: int) -> None:
        self.spec = spec
        self.salt = int(mix64(np.array([seed * 0x10001 + table_index + 1],
                                       dtype=np.uint64))[0])
        self.sketch = (CountMinSketch(spec.sketch_width) if spec.admission == "threshold"
                       else None)

    @property
    def nbytes(self) -> int:
        return 0 if self.sketch is None else self.sketch.nbytes

    def admit(self, ids: np.ndarray, step: int) -> np.ndarray:
        spec = self.spec
        if ids.size == 0 or spec.admission == "always":
            return np.ones(ids.size, dtype=bool)
        if spec.admission == "threshold":
            assert self.sketch is not None
            return self.sketch.add(ids) >= spec.threshold
        u = np.ascontiguousarray(ids, dtype=np.int64).view(np.uint64)
        step_salt = int(mix64(np.array([self.salt ^ (step * 0x9E3779B97F4A7C15 % 2**64)],
                                       dtype=np.uint64))[0])
        return unit_floats(salted(u, step_salt)) <= spec.probability

    def state_dict(self) -> dict[str, Any]:
        return {} if self.sketch is None else {"sketch": self.sketch.state_dict()}

    def load_state_dicts(self, states: list[dict[str, Any]]) -> None:
        """The saved states of every saving rank: their sketches summed (a re-shard)."""
        if self.sketch is None:
            return
        self.sketch.clear()
        for state in states:
            if "sketch" in state:
                self.sketch.merge(state["sketch"])
