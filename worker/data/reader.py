"""The rows of step s on rank r (worker/data/sharding.py's order), and the reading position
saved with a checkpoint and given back on resume.

    reader = FileReader(ReaderConfig(catalog, spec, batch_size, seed, buffer, world_size))
    reader.samples(step, rank)           # that rank's Samples of the step
    state = reader.state(next_step, rank)
    reader = FileReader(reader.config.resumed([state_of_rank_0, ...], next_step))

A run's steps map to epochs of S = reader.steps_per_epoch steps each. Resuming at the
saved world size changes nothing (the order is a function of the step: bitwise the run
straight through). At another world size the old ranks' leftovers of the epoch (each from
its position on, in old-rank order) are cut into equal shares of the new ranks: one
remainder span of floor(floor(left / W') / B) steps, in which no row is read twice and none
is skipped but the new ragged tail (fewer than W' * (B + 1) rows); the next epoch starts
after it, in the new world's order (`epoch_start`: where --epochs ends the run).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from worker.data.errors import DataError
from worker.data.features import FeatureSpec
from worker.data.formats import RecordFormat, format_for
from worker.data.samples import Samples, concat, decode
from worker.data.sharding import (
    Catalog,
    Segment,
    check_steps,
    cut,
    epoch_streams,
    permutation,
    skip,
)

__all__ = ["STATE_VERSION", "FileReader", "ReaderConfig", "Span"]

STATE_VERSION = 1
SEGMENTS_KEPT = 2  # decoded segments cached (the current one and the next)

Streams = tuple[tuple[Segment, ...], ...]


@dataclass(frozen=True)
class Span:
    """Steps [first_step, first_step + steps) read `streams` (one per rank) of `epoch`."""

    first_step: int
    epoch: int
    streams: Streams
    steps: int


@dataclass(frozen=True)
class ReaderConfig:
    """All a process needs to read (picklable: DataLoader workers get it)."""

    catalog: Catalog
    spec: FeatureSpec
    batch_size: int
    seed: int
    buffer: int
    world_size: int
    spans: tuple[Span, ...] = ()
    what: str = "--train-files"

    def resumed(self, states: Sequence[dict[str, Any] | None], next_step: int) -> ReaderConfig:
        """This config resumed from every old rank's `state` before `next_step` (module doc)."""
        if not states or all(s is None for s in states):
            return self
        if any(s is None for s in states):
            missing = [r for r, s in enumerate(states) if s is None]
            raise DataError(f"{self.what}: the checkpoint has no data position of ranks "
                            f"{missing}")
        saved = [dict(s) for s in states if s is not None]
        self._check(saved, next_step)
        old_world = len(saved)
        epoch = int(saved[0]["epoch"])
        if old_world == self.world_size and all(s["remainder"] is None for s in saved):
            return self  # the straight schedule is the saved one
        if old_world == self.world_size:  # resumed inside a remainder span at its own size
            first = saved[0]["remainder"]
            streams = tuple(tuple(Segment.from_json(d) for d in s["remainder"]["stream"])
                            for s in saved)
            span = Span(int(first["first_step"]), epoch, streams, int(first["steps"]))
            return replace(self, spans=(span,))
        left: list[Segment] = []
        normal: list[list[Segment]] | None = None
        for rank, s in enumerate(saved):
            if s["remainder"] is not None:
                stream = [Segment.from_json(d) for d in s["remainder"]["stream"]]
            else:
                if normal is None:
                    normal = epoch_streams(self.catalog, self.seed, epoch, old_world,
                                           self.buffer)
                stream = normal[rank]
            left += skip(stream, int(s["position"]))
        streams = tuple(tuple(part) for part in cut(left, self.world_size))
        steps = min(sum(len(g) for g in st) for st in streams) // self.batch_size
        return replace(self, spans=(Span(next_step, epoch, streams, steps),))

    def _check(self, saved: list[dict[str, Any]], next_step: int) -> None:
        want = {"version": STATE_VERSION, "data": self.catalog.fingerprint(),
                "batch_size": self.batch_size, "seed": self.seed, "buffer": self.buffer}
        for rank, s in enumerate(saved):
            for key, value in want.items():
                if s.get(key) != value:
                    raise DataError(
                        f"{self.what}: the checkpoint's data position (rank {rank}) is for "
                        f"{key}={s.get(key)!r}, this run has {value!r}; resume with the same "
                        "files, --seed, --shuffle-buffer and --batch-size")
            if s.get("next_step") != next_step or s.get("rank") != rank:
                raise DataError(f"{self.what}: the checkpoint's data position of rank {rank} is "
                                f"before step {s.get('next_step')}, not {next_step}")
        if len({int(s["epoch"]) for s in saved}) != 1:
            raise DataError(f"{self.what}: the checkpoint's ranks are in different epochs")


class FileReader:
    """Reads the rows of (step, rank); caches the last decoded segments."""

    def __init__(self, config: ReaderConfig, *, check: bool = True) -> None:
        """`check`: DataError when a rank's share makes no full batch (training)."""
        self.config = config
        self._formats: list[RecordFormat] = [format_for(p) for p in config.catalog.files]
        self._epochs: OrderedDict[int, Streams] = OrderedDict()
        self._segments: OrderedDict[Segment, Samples] = OrderedDict()
        self.steps_per_epoch = (check_steps(self._epoch(0), config.batch_size, config.what)
                                if check else 0)

    # -- where a step reads -------------------------------------------------------------
    def _epoch(self, epoch: int) -> Streams:
        if epoch not in self._epochs:
            c = self.config
            self._epochs[epoch] = tuple(tuple(s) for s in epoch_streams(
                c.catalog, c.seed, epoch, c.world_size, c.buffer))
            while len(self._epochs) > 2:
                self._epochs.popitem(last=False)
        return self._epochs[epoch]

    def locate(self, step: int) -> tuple[int, int, Streams, Span | None]:
        """(epoch, its first step, the ranks' streams, the span when a remainder)."""
        spans = self.config.spans
        for span in reversed(spans):
            if span.first_step <= step < span.first_step + span.steps:
                return span.epoch, span.first_step, span.streams, span
        base_step, base_epoch = 0, 0
        if spans and step >= spans[-1].first_step + spans[-1].steps:
            base_step = spans[-1].first_step + spans[-1].steps
            base_epoch = spans[-1].epoch + 1
        per = max(self.steps_per_epoch, 1)  # 0: a reader of held-out data (one epoch)
        epoch = base_epoch + (step - base_step) // per
        first = base_step + (epoch - base_epoch) * per
        return epoch, first, self._epoch(epoch), None

    def epoch_start(self, epoch: int) -> int:
        """The first step of `epoch` (--epochs E: the run ends before epoch_start(E)). After
        a remainder span of epoch e, epoch e + 1 starts at its end; an epoch the span is
        past (or in) started before it: the span's first step stands for it."""
        spans = self.config.spans
        per = self.steps_per_epoch
        if not spans:
            return epoch * per
        span = spans[-1]
        if epoch <= span.epoch:
            return span.first_step
        return span.first_step + span.steps + (epoch - span.epoch - 1) * per

    # -- reading ------------------------------------------------------------------------
    def _load(self, seg: Segment) -> Samples:
        got = self._segments.get(seg)
        if got is not None:
            self._segments.move_to_end(seg)
            return got
        c = self.config
        parts = []
        for f, u, lo, hi in seg.pieces:
            path = c.catalog.files[f]
            unit = decode(self._formats[f].read(path, u, c.spec.columns()), c.spec, path, u)
            if len(unit) != c.catalog.rows[f][u]:
                raise DataError(f"{path}: row group {u}: {len(unit)} rows, its metadata says "
                                f"{c.catalog.rows[f][u]}")
            parts.append(unit if (lo, hi) == (0, len(unit)) else unit.take(np.arange(lo, hi)))
        rows = concat(parts)
        index = (np.arange(seg.start, seg.stop) if seg.key is None
                 else permutation(c.seed, seg.key, seg.rows)[seg.start:seg.stop])
        out = rows.take(index)
        self._segments[seg] = out
        while len(self._segments) > SEGMENTS_KEPT:
            self._segments.popitem(last=False)
        return out

    def rows(self, stream: Sequence[Segment], lo: int, hi: int) -> Samples:
        """Rows [lo, hi) of a stream."""
        parts: list[Samples] = []
        base = 0
        for seg in stream:
            n = len(seg)
            if base + n > lo and base < hi:
                a, b = max(lo - base, 0), min(hi - base, n)
                got = self._load(seg)
                parts.append(got if (a, b) == (0, n) else got.take(np.arange(a, b)))
            base += n
            if base >= hi:
                break
        if sum(len(p) for p in parts) != hi - lo:
            raise DataError(f"{self.config.what}: rows [{lo}, {hi}) past the end of a rank's "
                            "share (the data changed while reading?)")
        return concat(parts)

    def samples(self, step: int, rank: int) -> Samples:
        _, first, streams, _ = self.locate(step)
        b = self.config.batch_size
        p = (step - first) * b
        return self.rows(streams[rank], p, p + b)

    def global_samples(self, step: int) -> Samples:
        return concat([self.samples(step, r) for r in range(self.config.world_size)])

    # -- the position -------------------------------------------------------------------
    def state(self, next_step: int, rank: int) -> dict[str, Any]:
        c = self.config
        epoch, first, streams, span = self.locate(next_step)
        position = (next_step - first) * c.batch_size
        stream = streams[rank]
        index, offset = len(stream), 0
        base = 0
        for i, seg in enumerate(stream):
            if position < base + len(seg):
                index, offset = i, position - base
                break
            base += len(seg)
        at = stream[min(index, len(stream) - 1)]
        # the unit holding the offset (in read order before the segment's permutation)
        f, u = at.pieces[0][0], at.pieces[0][1]
        row = at.start + offset
        for pf, pu, lo, hi in at.pieces:
            if row < hi - lo:
                f, u = pf, pu
                break
            row -= hi - lo
        return {
            "version": STATE_VERSION, "rank": rank, "world_size": c.world_size,
            "next_step": next_step, "epoch": epoch, "epoch_first_step": first,
            "position": position, "segment": index, "offset": offset,
            "file": str(c.catalog.files[f]), "row_group": u,
            "shuffle": None if at.key is None else list(at.key),
            "data": c.catalog.fingerprint(), "batch_size": c.batch_size, "seed": c.seed,
            "buffer": c.buffer,
            "remainder": None if span is None else {
                "first_step": span.first_step, "steps": span.steps,
                "stream": [s.to_json() for s in stream]},
        }
