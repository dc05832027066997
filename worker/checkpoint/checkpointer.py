"""Step-consistent checkpoints of a training run, and resuming from one (any world size).

A checkpoint at step s (taken after step s's push, `--checkpoint-every N` -> steps
N-1, 2N-1, ...) holds the state a run has before step s+1 once every update of
steps <= s is in the rows. Each component saves and restores itself: the Checkpointer
holds the run's named parts (worker/checkpoint/parts.py; the list: run_parts.py) and
the sequence:

1. every rank applies what the forward of step s+1 sees (updates <= s-K) and waits
   for the updates of steps s-K+1..s (so every push <= s is applied on the server),
   without applying them: they are *pending* (worker/checkpoint/window.py);
2. every part writes this rank's files, in order (below: when): the rows it owns with the pending
   updates applied (`rows/<table>.r<rank>.pt`, canonical rows: every update <= s, what
   export and a re-shard read; the live rows are put back exactly, so the run goes on as
   if no checkpoint was taken: tables.py), a dynamic table's slot map, `pending/
   r<rank>.pt` (the pending updates, the rows they touch before them, the weight
   predictor's state), the sparse optimizer state (the update source saves its own:
   source.py), the dense part and its optimizer with torch.distributed.checkpoint (DCP,
   `dense/`: every rank writes its own FSDP shards; a resume at another world size
   re-shards them) and the fp16 GradScaler's state, and the data position (data.py);
3. every rank's account of what it saved is gathered; rank 0 has every part record its
   entries into the manifest (step, world size, tables, row ranges, files with sizes +
   crc32, data position, parts: hybridps/checkpoint.py `Manifest`) and renames
   `manifest.json` into place LAST; barrier.

--checkpoint-mode incremental (the default): a checkpoint whose parent is the previous one
this process completed (`since`; every --checkpoint-full-every-th, the first of a process
and the one after a failed save are full) has each part write only what changed since it
(the rows and optimizer state as delta shards; the other parts whole), and its manifest
names the parent and keeps the chain's id (`draft_manifest`); restore, re-sharding and
export read the chain composed (hybridps/checkpoint.py `load_table_rows`), and
--checkpoint-keep keeps every link a kept checkpoint needs (`prune`). The parts hold
what changed at the snapshot (below), and their marks of what changed restart there.

A directory without a manifest is torn and ignored. Before anything is loaded the
checkpoint is verified whole (worker/checkpoint/resume.py `resume_target`: every file
the manifest lists against its size and crc32, damaged ones skipped or refused), then
every part checks that this run can use it (`verify`) before any part restores. A resume
whose checkpoint is the run's last step (or beyond) trains nothing: it says so and exits 0.

Resuming: each part reads the saved ranges that overlap what this rank owns now, so the
world size may differ; the server loads the optimizer state the same way (Register with
`restore`), and sets last_step = s so no update is applied twice; training continues at
step s+1. A run with checkpoints therefore equals a run without them, for every
--staleness K, and a resumed run equals both (bitwise at the same world size). Resuming
with another --row-dtype takes the canonical rows (or the fp32 masters) and drops the
pending updates: the resumed run then sees every update <= s before step s+1.

A stop (SIGTERM/SIGINT: worker/runtime/lifecycle.py) ends the loop after a step every rank
agrees on; with --checkpoint-on-stop (the default) every rank then checkpoints that step
(`save_on_stop`; skipped when it was just checkpointed), so a `--resume` goes on from it.
A dynamic table's prefetch (--pipeline) is held back once a rank is signalled, and the
ranks agree on the flag as it was then (lifecycle.stop_agreed `requested`), so a stop's
checkpoint never follows a pending translation.

Steps 2 and 3 run in two phases (worker/checkpoint/writer.py): the snapshot at the step
boundary (every part holds the state it will write: `snapshot`), then the writes, the
gathering and the manifest, by the writer: at once (--checkpoint-async false), or in a
background thread while the step loop goes on (the default; the next checkpoint, a stop's
and the end of the run wait for it: `wait`). The manifest is renamed into place only after
every rank's files are durable, so a crash during the background write leaves the previous
checkpoint the newest complete one. results.json reports how long each save held the step
loop (`stall_s`; of it, waiting for the previous checkpoint's write: `behind_s`) and the
snapshot's host memory (`snapshot_bytes`).

Each phase of a save is a fault point (worker/runtime/faults.py: HYBRIDPS_FAULT_CHECKPOINT;
"rows" and later run in the writer's job).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from hybridps.checkpoint import (
    MANIFEST,
    STEP_DIR,
    Manifest,
    ParentEntry,
    chain_of,
    complete_checkpoints,
    step_dir,
)
from hybridps.errors import ShardError
from hybridps.logs import kv
from worker.checkpoint.dense import DENSE_DIR
from worker.checkpoint.parts import CheckpointPart, ManifestDraft
from worker.checkpoint.resume import dense_optimizer_record, resume_changes, resume_target
from worker.checkpoint.writer import SyncWriter, Writer, Written, make_writer
from worker.report.console import checkpoint_entry, human_bytes
from worker.runtime.faults import fault_point

if TYPE_CHECKING:
    from hybridps.optim import OptimizerSpec
    from worker.config.train_config import TrainConfig
    from worker.runtime.dist import DistContext

log = logging.getLogger("worker.checkpoint")

# The fault point (worker/runtime/faults.py CHECKPOINT_PHASES) reached after a part's files
# are written: "rows" once the rows, slot maps and pending updates are, and so on.
PHASE_AFTER = {"window": "rows", "source": "optim", "dense": "dense"}


def needed(points: Sequence[Path]) -> set[Path]:
    """The checkpoints `points` are composed of (their chains, hybridps/checkpoint.py
    chain_of), resolved. A point whose chain is damaged keeps what can still be read of
    it: its own directory and every parent its links name."""
    out: set[Path] = set()
    for point in points:
        try:
            out.update(link.directory.resolve() for link in chain_of(point))
        except (ShardError, OSError, ValueError):
            directory: Path | None = point
            while directory is not None and directory.resolve() not in out:
                out.add(directory.resolve())
                try:
                    parent = Manifest.read(directory).parent
                except (ShardError, OSError, ValueError):
                    parent = None
                directory = None if parent is None else directory.parent / parent.path
    return out


def prune(root: Path, keep: int) -> list[Path]:
    """--checkpoint-keep N (0: keep all): delete all but the newest N complete checkpoints
    under `root` and the older ones they are composed of (`needed`), and torn directories
    older than the newest complete one; returns the directories deleted."""
    if keep <= 0:
        return []
    complete = complete_checkpoints(root)
    kept = needed([d for _, d in complete[-keep:]])
    doomed = [d for _, d in complete[:-keep] if d.resolve() not in kept]
    newest = complete[-1][0] if complete else -1
    for child in root.iterdir():
        m = STEP_DIR.match(child.name)
        if m and int(m.group(1)) < newest and not (child / MANIFEST).exists():
            doomed.append(child)
    for d in doomed:
        (d / MANIFEST).unlink(missing_ok=True)  # first: never a half-deleted loadable one
        shutil.rmtree(d, ignore_errors=True)
    return doomed


class Checkpointer:
    """Saves (`save`) and restores (`restore_local`) a run's parts; see the module doc.

    Built before the update source (which checkpoint to resume from decides how the source
    registers: `resume_target`); the parts are attached once the run has built them."""

    def __init__(self, cfg: TrainConfig, ctx: DistContext, *, run_id: str,
                 sparse_spec: OptimizerSpec) -> None:
        self.cfg, self.opts = cfg, cfg.checkpoint
        self.rank, self.world = ctx.rank, ctx.world_size
        self.run_id, self.sparse_spec = run_id, sparse_spec
        self.root = Path(self.opts.checkpoint_dir).resolve() if self.opts.checkpoint_dir else None
        self.parts: list[CheckpointPart] = []
        self.resumed_step = -1
        self.save_s: list[float] = []
        self.written: list[dict[str, Any]] = []  # rank 0: step, path, bytes, seconds
        self.restore_s = 0.0
        self.saved_step = -1  # the step of this run's newest checkpoint
        self.stall_s: list[float] = []  # how long each save held the step loop
        self.behind_s: list[float] = []  # of it: waiting for the previous one's write
        self.writer: Writer = SyncWriter()  # attach: --checkpoint-async's
        # the chain being written (--checkpoint-mode incremental): the newest checkpoint
        # this process completed (None: the next is full), links since its full one, and
        # its id (rank 0 writes it into every manifest of the chain)
        self.parent_step: int | None = None
        self.links = 0
        self.chain_id = ""

    def attach(self, parts: Sequence[CheckpointPart]) -> None:
        """The run's parts, in the order they save and restore (run_parts.py)."""
        names = [p.name for p in parts]
        if len(set(names)) != len(names):
            raise ValueError(f"checkpoint parts {names} name a part twice")
        self.parts = list(parts)
        if self.root is not None:  # collective (a process group for the writes' own)
            self.writer = make_writer(self.opts.checkpoint_async, self.world)

    @property
    def snapshot_bytes(self) -> int:
        """The most host memory one checkpoint's snapshot held (0: written in place)."""
        return self.writer.snapshot_bytes

    # -- which checkpoint to resume from (called before the source starts) ----------
    def resume_target(self) -> tuple[Path, int] | None:
        """The (directory, step) every rank resumes from (resume.py), or None."""
        return resume_target(self.opts, self.rank, self.world, self._check_optimizer)

    def _check_optimizer(self, directory: str, manifest: Manifest) -> None:
        """ResumeError, one line naming both, unless the checkpoint was saved with this
        run's sparse and dense optimizers (`resume_changes`); rank 0 says which learning
        rates and weight decay this run changes."""
        changes = resume_changes(directory, manifest.optimizer,
                                 dataclasses.asdict(self.sparse_spec),
                                 (manifest.dense or {}).get("optimizer"),
                                 dense_optimizer_record(self.cfg.optim))
        if changes and self.rank == 0:
            log.info("rank 0: resume: %s", ", ".join(changes))

    def due(self, step: int) -> bool:
        every = self.opts.checkpoint_every
        return (self.root is not None and every > 0 and (step + 1) % every == 0
                and step != self.resumed_step)

    @property
    def on_stop(self) -> bool:
        """A stop writes a checkpoint (--checkpoint-dir with --checkpoint-on-stop)."""
        return self.root is not None and self.opts.checkpoint_on_stop

    def save_on_stop(self, step: int) -> Path | None:
        """The stop's checkpoint of `step` (collective; after the loop's last push), unless
        --checkpoint-on-stop is off or `step` was just checkpointed; rank 0 logs its time."""
        if not self.on_stop or step in (self.saved_step, self.resumed_step):
            return None
        directory = self.save(step)
        self.writer.wait()  # the process exits after this: every byte first
        if self.rank == 0:
            entry = self.written[-1]
            log.warning(kv("checkpoint_on_stop", step=step, seconds=f"{self.save_s[-1]:.2f}",
                           size=human_bytes(entry["bytes"]), path=directory))
        return directory

    # -- save -------------------------------------------------------------------------
    def since(self, step: int) -> int | None:
        """The parent step of the checkpoint of `step` (None: a full one). Full: with
        --checkpoint-mode full, the first checkpoint of a process (a resumed run starts a
        chain of its own), every --checkpoint-full-every-th one, and after a failed save.
        The same on every rank (the same history)."""
        parent = self.parent_step
        if (self.opts.checkpoint_mode == "full" or parent is None or parent >= step
                or self.links + 1 >= self.opts.checkpoint_full_every):
            return None
        return parent

    def save(self, step: int) -> Path:
        """A checkpoint of `step` (collective: every rank calls it after pushing `step`):
        the snapshot now, the writes, manifest and pruning by the writer (writer.py: at
        once, or in the background: `wait` or the next save waits for them)."""
        assert self.root is not None
        t0 = time.perf_counter()
        self.writer.wait()  # one checkpoint in flight
        self.behind_s.append(time.perf_counter() - t0)
        directory = step_dir(self.root, step)
        since = self.since(step)
        self.parent_step = None  # until this one completes: a failed save breaks the chain
        fault_point(self.rank, step, "start")
        if self.rank == 0:
            (directory / MANIFEST).unlink(missing_ok=True)  # re-saving a step
            shutil.rmtree(directory / DENSE_DIR, ignore_errors=True)  # no stale DCP files
        self._barrier()
        stage = self.writer.stage()
        held: dict[str, Written] = {}
        snapshot_s: dict[str, float] = {}
        for part in self.parts:
            t_part = time.perf_counter()
            held[part.name] = part.snapshot(directory, step, stage, since)
            snapshot_s[part.name] = time.perf_counter() - t_part
        group = stage.group
        self.writer.submit(lambda: self._write(step, since, directory, held, group, t0))
        self.saved_step = step
        self.stall_s.append(time.perf_counter() - t0)
        log.debug("rank %d: checkpoint step %d held the step loop %.3fs (snapshot: %s)",
                  self.rank, step, self.stall_s[-1],
                  ", ".join(f"{name} {s:.3f}s" for name, s in snapshot_s.items()))
        return directory

    def wait(self) -> None:
        """Until the checkpoint being written (if any) is complete (before the run ends)."""
        self.writer.close()

    def _write(self, step: int, since: int | None, directory: Path, held: dict[str, Written],
               group: Any, t0: float) -> None:
        """The job (writer.py): every part's files, then the manifest, last."""
        mine: dict[str, Any] = {}
        seconds: dict[str, float] = {}
        for part in self.parts:
            t_part = time.perf_counter()
            mine[part.name] = held[part.name].result()
            seconds[part.name] = time.perf_counter() - t_part
            if part.name in PHASE_AFTER:
                fault_point(self.rank, step, PHASE_AFTER[part.name])
        gathered: list[Any] = [mine]
        if self.world > 1:
            gathered = [None] * self.world
            dist.all_gather_object(gathered, mine, group=group)
        if self.rank == 0:
            manifest = self.draft_manifest(step, since, gathered)
            fault_point(self.rank, step, "manifest")
            self.write_manifest(manifest, directory)
            self._prune()
        self._barrier(group)
        fault_point(self.rank, step, "after")
        elapsed = time.perf_counter() - t0
        self.save_s.append(elapsed)
        # complete: the next one may be its child (read after the writer's `wait`)
        self.parent_step, self.links = step, (0 if since is None else self.links + 1)
        if self.rank == 0:
            entry = checkpoint_entry(step, directory, elapsed)
            entry["kind"] = "full" if since is None else "incremental"
            self.written.append(entry)
            log.info("checkpoint step %d -> %s: %s %s in %.2fs (%s; snapshot in host memory "
                     "%s)", step, directory, human_bytes(entry["bytes"]), entry["kind"],
                     elapsed, ", ".join(f"{name} {s:.2f}s" for name, s in seconds.items()),
                     human_bytes(self.writer.snapshot_bytes))

    def write_manifest(self, manifest: Manifest, directory: Path) -> None:
        """The manifest, renamed into place last: the checkpoint is complete (rank 0)."""
        manifest.write(directory)

    def draft_manifest(self, step: int, since: int | None,
                       gathered: Sequence[Any]) -> Manifest:
        """Rank 0: every part records every rank's account into the manifest; an
        incremental one names its parent (its manifest's size, crc32 and checksum) and
        keeps the chain's id, a full one starts a chain."""
        assert self.root is not None
        if since is None:
            self.chain_id = uuid.uuid4().hex
        parent = None if since is None else ParentEntry.describe(step_dir(self.root, since))
        draft = ManifestDraft(step=step, world_size=self.world, run_id=self.run_id,
                              task=self.cfg.run.task, seed=self.cfg.run.seed,
                              chain_id=self.chain_id, parent=parent)
        for part in self.parts:
            draft.part(part.name)
            part.record([g[part.name] for g in gathered], draft)
        return draft.build()

    def _prune(self) -> None:
        if self.root is not None:
            prune(self.root, self.opts.checkpoint_keep)

    def _barrier(self, group: Any = None) -> None:
        if self.world > 1:
            dist.barrier(group=group)

    # -- restore ----------------------------------------------------------------------
    def restore_local(self, directory: Path, step: int) -> None:
        """Every part's state from `directory` (before training): every part checks the
        checkpoint first (ValueError naming what this run cannot use), then each restores.

        The server-side optimizer state is loaded by the server when the ShardClient
        registers with restore=(directory, step).
        """
        t0 = time.perf_counter()
        manifest = Manifest.read(directory)
        for part in self.parts:
            problem = part.verify(directory, manifest)
            if problem is not None:
                raise ValueError(problem)
        for part in self.parts:
            part.restore(directory, manifest, step)
        self.resumed_step = step
        self.restore_s = time.perf_counter() - t0
        log.info("rank %d: resumed from %s (step %d, saved by world %d) in %.2fs", self.rank,
                 directory, step, manifest.world_size, self.restore_s)
