"""Step-consistent checkpoints of a training run, and resuming from one (any world size).

A checkpoint at step s (taken after step s's push, `--checkpoint-every N` -> steps
N-1, 2N-1, ...) holds the state a run has before step s+1 once every update of
steps <= s is in the rows:

1. every rank applies what the forward of step s+1 sees (updates <= s-K) and waits
   for the updates of steps s-K+1..s (so every push <= s is applied on the server),
   without applying them: they are *pending*;
2. every rank writes the rows it owns (`rows/<table>.r<rank>.pt`) with the pending
   updates applied (canonical rows: every update <= s, what export and a re-shard
   read), and `pending/r<rank>.pt`: the pending updates plus the values the rows they
   touch have before them (and, with --staleness-compensation predict, the weight
   predictor's state: worker/updates/staleness.py). The live rows are put back exactly, so the
   run goes on as if no checkpoint was taken; a resume restores the same rows, pending
   updates and predictions;
3. the sparse optimizer state, which the update source saves itself
   (`UpdateSource.save_to`; the checkpointer never reads a source's fields): the shard
   client asks ITS shard server to save its own partition (Checkpoint RPC,
   ranks=[rank]: the server waits until the pushes <= s are applied, then writes m, v,
   step count, last_step); --local-optimizer writes the same files itself
   (worker/updates/local_state.py). A resume hands it back (`restore_from`);
4. the dense part and its optimizer with torch.distributed.checkpoint (DCP, `dense/`:
   every rank writes its own FSDP shards; a resume at another world size re-shards
   them), plus the fp16 GradScaler's state (scale, growth tracker) in the manifest;
5. barrier; rank 0 renames `manifest.json` into place LAST (step, world size,
   tables, row ranges, files with sizes + crc32, data position: hybridps/checkpoint.py
   `Manifest`); barrier.

A directory without a manifest is torn and ignored. Before anything is loaded the
checkpoint is verified whole: the manifest against its own checksum and every file it
lists (rows, optim, pending, dense) against its size and crc32, the files split among
the ranks, which then agree on the verdict (`resume_target`), so every rank resumes
from the same checkpoint. `--resume` takes the newest intact one: a damaged newer one
is skipped with a warning naming the bad file. `--resume-from` a step directory takes
exactly that one: damaged or missing, the worker exits 2 with one line saying why
(ResumeError; a root directory behaves like --resume). A resume whose checkpoint is the
run's last step (or beyond) trains nothing: it says so and exits 0.

Resuming: each rank reads the saved row ranges that overlap
the range it owns now (hybridps/checkpoint.py load_rows), so the world size may
differ; the server loads the optimizer state the same way (Register with
`restore`), and sets last_step = s so no update is applied twice; the data
position is the step (tasks make batches from (seed, step)); training
continues at step s+1. The optimizers must be the ones the checkpoint was saved with
(kind, betas, eps: what the saved state means), but for their learning rates and weight
decay (`resume_changes`): rank 0 says what changed, the server takes the new values from
Register, the dense optimizer gets them after its state is loaded, and later checkpoints
record them.

A run with checkpoints therefore equals a run without them, for every --staleness K,
and a resumed run equals both (bitwise at the same world size). Resuming with another
--row-dtype takes the canonical rows (or the fp32 masters) and drops the pending
updates: the resumed run then sees every update <= s before step s+1.

Each phase of a save is a fault point (worker/runtime/faults.py: HYBRIDPS_FAULT_CHECKPOINT).
The Checkpointer reads the training state through `TrainingState` (the Trainer of
worker/train/trainer.py has it), so this module does not import the training loop.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from hybridps.checkpoint import (
    MANIFEST,
    STEP_DIR,
    FileEntry,
    Manifest,
    ManifestShard,
    ManifestTable,
    PendingEntry,
    ShardInfo,
    complete_checkpoints,
    load_rows,
    read_manifest,
    rows_file,
    save_shard,
    save_torch,
    step_dir,
    verify_files,
)
from hybridps.dynamic_files import restore_plan, save_ids
from hybridps.errors import ShardError
from hybridps.optim_kinds import describe_saved
from worker.checkpoint.dense import DENSE_DIR, restore_dense, save_dense
from worker.checkpoint.units import join_updates, split_rows, split_updates
from worker.report.console import checkpoint_entry, human_bytes
from worker.runtime.faults import fault_point
from worker.updates.source import RowUpdate, SavedFiles

if TYPE_CHECKING:
    from hybridps.optim import OptimizerSpec
    from worker.config.train_config import TrainConfig
    from worker.dense.parallel import DenseParallel
    from worker.embedding.sharded import ShardedEmbedding
    from worker.runtime.dist import DistContext
    from worker.tasks.base import HybridModel
    from worker.updates.source import StalenessWindow, UpdateSource

log = logging.getLogger("worker.checkpoint")

PENDING_FORMAT = "hybridps-pending-v1"


class ResumeError(ValueError):
    """No checkpoint to resume as asked (damaged, missing): the worker exits 2."""


def pending_file(rank: int) -> str:
    return f"pending/r{rank:05d}.pt"


def find_checkpoint(root: str | Path) -> Path | None:
    """A complete checkpoint directory itself, or the newest complete one under `root`."""
    root = Path(root)
    if (root / "manifest.json").is_file():
        return root
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


class TrainingState(Protocol):
    """What a checkpoint saves and restores: the parts of a training run (worker/train/trainer.py's
    Trainer). `source` is read only when saving or restoring, after the run has built it."""

    cfg: TrainConfig
    ctx: DistContext
    run_id: str
    embedding: ShardedEmbedding
    window: StalenessWindow
    source: UpdateSource
    model: HybridModel
    dense_opt: torch.optim.Optimizer
    dense_parallel: DenseParallel
    sparse_spec: OptimizerSpec


class Checkpointer:
    """Saves (`save`) and restores (`restore_local`) a run's state; see the module doc."""

    def __init__(self, state: TrainingState) -> None:
        self.t = state
        self.cfg = state.cfg
        self.opts = state.cfg.checkpoint
        self.rank = state.ctx.rank
        self.world = state.ctx.world_size
        self.root = Path(self.opts.checkpoint_dir).resolve() if self.opts.checkpoint_dir else None
        self.resumed_step = -1
        self.save_s: list[float] = []
        self.written: list[dict[str, Any]] = []  # rank 0: step, path, bytes, seconds
        self.restore_s = 0.0

    # -- which checkpoint to resume from (called before the source starts) ----------
    def resume_target(self) -> tuple[Path, int] | None:
        """The (directory, step) every rank resumes from (module doc), or None."""
        cfg = self.opts
        if not (cfg.resume or cfg.resume_from):
            return None
        where = Path(cfg.resume_from or cfg.checkpoint_dir)
        exact = bool(cfg.resume_from) and (where / MANIFEST).is_file()
        if exact:
            candidates = [str(where.resolve())]
        else:
            candidates = [str(d.resolve()) for _, d in reversed(complete_checkpoints(where))]
        box: list[Any] = [candidates]
        if self.world > 1:  # rank 0's list wins (a checkpoint may complete meanwhile)
            dist.broadcast_object_list(box, src=0)
        candidates = list(box[0])
        skipped: list[str] = []
        for candidate in candidates:
            problem = self._verify_together(Path(candidate))
            if problem is None:
                manifest = Manifest.read(candidate)
                self._check_optimizer(candidate, manifest)
                step = manifest.step
                if self.rank == 0:
                    log.info("rank 0: resuming from %s (step %d)%s", candidate, step,
                             f"; skipped {len(skipped)} damaged newer checkpoint(s)"
                             if skipped else "")
                return Path(candidate), step
            if exact:
                raise ResumeError(f"resume_from={cfg.resume_from!r}: checkpoint is damaged: "
                                  f"{problem}")
            skipped.append(candidate)
            if self.rank == 0:
                log.warning("rank 0: checkpoint %s is damaged, skipped: %s", candidate, problem)
        if skipped:
            raise ResumeError(f"no intact checkpoint under {str(where)!r}: all {len(skipped)} "
                              "are damaged (see the warnings above); move them away to start "
                              "at step 0")
        if cfg.resume_from:
            raise ResumeError(f"resume_from={cfg.resume_from!r}: no complete checkpoint "
                              f"({MANIFEST}) there")
        log.info("rank %d: --resume: no complete checkpoint under %s; starting at step 0",
                 self.rank, where)
        return None

    def _check_optimizer(self, directory: str, manifest: Manifest) -> None:
        """ResumeError, one line naming both, unless the checkpoint was saved with this
        run's sparse and dense optimizers (`resume_changes`); rank 0 says which learning
        rates and weight decay this run changes."""
        changes = resume_changes(directory, manifest.optimizer,
                                 dataclasses.asdict(self.t.sparse_spec),
                                 (manifest.dense or {}).get("optimizer"),
                                 dense_optimizer_record(self.cfg))
        if changes and self.rank == 0:
            log.info("rank 0: resume: %s", ", ".join(changes))

    def _verify_together(self, directory: Path) -> str | None:
        """Collective: every rank checks its share of the checkpoint's files; None when all
        are intact, else the first problem found (the same answer on every rank)."""
        problem: str | None = None
        try:
            verify_files(directory, read_manifest(directory), share=(self.rank, self.world))
        except (ShardError, OSError, ValueError, KeyError, TypeError) as exc:
            problem = str(exc) or type(exc).__name__
        gathered: list[Any] = [problem]
        if self.world > 1:
            gathered = [None] * self.world
            dist.all_gather_object(gathered, problem)
        return next((p for p in gathered if p is not None), None)

    def due(self, step: int) -> bool:
        every = self.opts.checkpoint_every
        return (self.root is not None and every > 0 and (step + 1) % every == 0
                and step != self.resumed_step)

    # -- save -------------------------------------------------------------------------
    def save(self, step: int) -> Path:
        """A checkpoint of `step` (collective: every rank calls it after pushing `step`)."""
        assert self.root is not None
        t0 = time.perf_counter()
        tr = self.t
        # Rows as the forward of step+1 sees them (updates <= step-K) + the later ones.
        pending = tr.window.pending_at(step)
        directory = step_dir(self.root, step)
        fault_point(self.rank, step, "start")
        if self.rank == 0:
            (directory / "manifest.json").unlink(missing_ok=True)  # re-saving a step
            shutil.rmtree(directory / DENSE_DIR, ignore_errors=True)  # no stale DCP files
        self._barrier()
        tables = tr.embedding.tables
        rows, pending_info = self._save_rows(directory, step, pending)
        fault_point(self.rank, step, "rows")
        t_rows = time.perf_counter()
        optim = self._save_optim(step, directory)
        fault_point(self.rank, step, "optim")
        t_optim = time.perf_counter()
        dense_info = save_dense(self.t.model.dense, self.t.dense_opt,
                                self.t.dense_parallel.scaler, directory, self.rank)
        fault_point(self.rank, step, "dense")
        mine = {name: ManifestShard(self.rank, rows[name].row_start, rows[name].row_end,
                                    {"rows": _file_entry(rows[name]),
                                     **{k: _file_entry(f) for k, f in optim[name].items()},
                                     **{k: _file_entry(f) for k, f in
                                        self._save_ids(name, directory, step).items()}})
                for name in tables}
        gathered: list[Any] = [None] * self.world
        if self.world > 1:
            dist.all_gather_object(gathered, (mine, pending_info))
        else:
            gathered = [(mine, pending_info)]
        pendings = [g[1] for g in gathered]
        gathered = [g[0] for g in gathered]
        if self.rank == 0:
            manifest = Manifest(
                step=step, next_step=step + 1, world_size=self.world, run_id=tr.run_id,
                mode="local-optimizer" if self.cfg.sync.local_optimizer else "server",
                row_dtype=self.cfg.optim.row_dtype,  # bf16: the optim files: fp32 masters
                optimizer=dataclasses.asdict(tr.sparse_spec), task=self.cfg.run.task,
                seed=self.cfg.run.seed,
                data={"step": step,
                      "samples_seen": (step + 1) * self.cfg.run.batch_size * self.world},
                created_unix=time.time(),
                tables={name: ManifestTable(
                    t.num_rows, t.dim, tuple(g[name] for g in gathered),
                    {} if t.dynamic is None else {"dynamic": dataclasses.asdict(t.dynamic)})
                    for name, t in tables.items()},
                dense={**dense_info, "optimizer": dense_optimizer_record(self.cfg)},
                pending=PendingEntry(tr.window.staleness, tr.window.applied_through,
                                     tuple(pendings)))
            fault_point(self.rank, step, "manifest")
            manifest.write(directory)
            self._prune(step)
        self._barrier()
        fault_point(self.rank, step, "after")
        elapsed = time.perf_counter() - t0
        self.save_s.append(elapsed)
        if self.rank == 0:
            self.written.append(checkpoint_entry(step, directory, elapsed))
            log.info("checkpoint step %d -> %s: %s in %.2fs (drain+rows %.2fs, optimizer "
                     "state %.2fs)", step, directory, human_bytes(self.written[-1]["bytes"]),
                     elapsed, t_rows - t0, t_optim - t_rows)
        return directory

    @torch.no_grad()
    def _save_rows(self, directory: Path, step: int, pending: list[RowUpdate]
                   ) -> tuple[dict[str, ShardInfo], tuple[int, FileEntry]]:
        """This rank's rows files (every update <= step applied) and its pending file.

        The rows the pending updates touch are saved as they are now (`before`), then get
        the pending updates for the rows files, then are put back bitwise: only those rows
        are copied (memory ~ rows touched in K steps), never the table."""
        emb = self.t.embedding
        # per unit (worker/embedding/groups.py); the files per table (worker/checkpoint/units.py)
        touched: dict[str, list[torch.Tensor]] = {name: [] for name in emb.units}
        for u in pending:
            touched[u.table].append(u.ids_U.to(torch.int64))
        before: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, ids in touched.items():
            ids_P = torch.unique(torch.cat(ids)) if ids else torch.empty(0, dtype=torch.int64)
            local_P = ids_P.to(emb.device) - emb.units[name].start
            before[name] = (ids_P.cpu(), emb.weights[name].data.index_select(0, local_P))
        rows: dict[str, ShardInfo] = {}
        try:
            for u in pending:
                if u.rows:
                    emb.set_rows(u.table, u.ids_U, u.delta_UD)
                else:
                    emb.apply_update(u.table, u.ids_U, u.delta_UD, u.decay)
            for name, table in emb.tables.items():
                start, end = emb.ranges[name]
                rows[name] = save_shard(directory, rows_file(name, self.rank), kind="rows",
                                        table=name, rank=self.rank, num_rows=table.num_rows,
                                        dim=table.dim, row_start=start, row_end=end,
                                        tensors={"weight": emb.table_rows(name)},
                                        meta={"step": step})
        finally:
            for name, (ids_P, rows_PD) in before.items():
                local_P = ids_P.to(emb.device) - emb.units[name].start
                emb.weights[name].data.index_copy_(0, local_P, rows_PD)
        payload = {
            "format": PENDING_FORMAT, "rank": self.rank, "step": step,
            "applied_through": self.t.window.applied_through,
            "updates": split_updates(emb, pending),
            "before": split_rows(emb, before),
            # --staleness-compensation predict: what the next forwards' predictions need
            "prediction": (None if self.t.window.predictor is None
                           else self.t.window.predictor.state_dict()),
        }
        info = save_torch(directory / pending_file(self.rank), payload)
        return rows, (self.rank, FileEntry(pending_file(self.rank), info["bytes"],
                                           info["crc32"]))

    def _prune(self, step: int) -> None:
        """--checkpoint-keep N: delete all but the newest N complete checkpoints, and torn
        directories older than the newest complete one."""
        keep = self.opts.checkpoint_keep
        if keep <= 0 or self.root is None:
            return
        complete = complete_checkpoints(self.root)
        doomed = [d for _, d in complete[:-keep]]
        newest = complete[-1][0] if complete else -1
        for child in self.root.iterdir():
            m = STEP_DIR.match(child.name)
            if m and int(m.group(1)) < newest and not (child / MANIFEST).exists():
                doomed.append(child)
        for d in doomed:
            (d / MANIFEST).unlink(missing_ok=True)  # first: never a half-deleted loadable one
            shutil.rmtree(d, ignore_errors=True)

    def _save_optim(self, step: int, directory: Path) -> SavedFiles:
        """The update source writes its own optimizer state (UpdateSource.save_to)."""
        return self.t.source.save_to(directory, step)

    def _save_ids(self, name: str, directory: Path, step: int) -> dict[str, ShardInfo]:
        """A dynamic table's slot map on this rank (hybridps/dynamic_files.py)."""
        dynamic = self.t.embedding.dynamic
        if dynamic is None or name not in dynamic.tables:
            return {}
        start, end = self.t.embedding.ranges[name]
        return {"ids": save_ids(directory, table=name, rank=self.rank, start=start, end=end,
                                state=dynamic.slot_state(name), step=step)}

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    # -- restore ----------------------------------------------------------------------
    @torch.no_grad()
    def restore_local(self, directory: Path, step: int) -> None:
        """Rows, --local-optimizer state and dense state from `directory` (before training).

        The server-side optimizer state is loaded by the server when the ShardClient
        registers with restore=(directory, step).
        """
        t0 = time.perf_counter()
        tr = self.t
        manifest = Manifest.read(directory)
        for name, table in tr.embedding.tables.items():
            entry = manifest.tables.get(name)
            if entry is None or (entry.num_rows, entry.dim) != (table.num_rows, table.dim):
                raise ValueError(f"checkpoint {directory}: table {name!r} is "
                                 f"{'missing' if entry is None else 'of another shape'}; "
                                 f"this run has {table.num_rows}x{table.dim}")
            if ("dynamic" in entry.extra) != (table.dynamic is not None):
                raise ValueError(f"checkpoint {directory}: table {name!r} is "
                                 f"{'' if 'dynamic' in entry.extra else 'not '}dynamic there "
                                 f"and {'' if table.dynamic is not None else 'not '}dynamic "
                                 "in this run")
        for name, table in tr.embedding.tables.items():
            start, end = tr.embedding.ranges[name]
            shards = manifest.shards(name, "rows")  # verified by resume_target
            got, _ = load_rows(directory, name, table.num_rows, table.dim, shards, start, end,
                               ["weight"], verify=False)
            weight = got["weight"]
            if manifest.row_dtype == "bf16" and tr.embedding.row_dtype == torch.float32:
                # Saved bf16 rows are their fp32 master rounded; fp32 rows resume from the
                # master itself (in the optim files, next to m and v).
                masters, _ = load_rows(directory, name, table.num_rows, table.dim,
                                       manifest.shards(name, "optim"), start, end,
                                       ["master"], verify=False)
                weight = masters["master"] if masters["master"] is not None else weight
            assert weight is not None
            tr.embedding.table_rows(name).copy_(weight)
            self._restore_slots(directory, manifest, name)
        self._restore_pending(directory, manifest, step)
        tr.source.restore_from(directory, step)  # the update source's own optimizer state
        restore_dense(self.t.model.dense, self.t.dense_opt, self.t.dense_parallel.scaler,
                      directory, manifest.dense or {}, self.cfg.dense.loss_scale_init)
        for group in self.t.dense_opt.param_groups:  # this run's, not the saved ones
            group["lr"] = self.cfg.optim.dense_lr
            group["weight_decay"] = self.cfg.optim.weight_decay
        self.resumed_step = step
        self.restore_s = time.perf_counter() - t0
        log.info("rank %d: resumed from %s (step %d, saved by world %d) in %.2fs", self.rank,
                 directory, step, manifest.world_size, self.restore_s)


    @torch.no_grad()
    def _restore_slots(self, directory: Path, manifest: Manifest, name: str) -> None:
        """A dynamic table's slot map (any world size: hybridps/dynamic_files.py); the slots
        whose id went to another owner are emptied."""
        emb = self.t.embedding
        if emb.dynamic is None or name not in emb.dynamic.tables:
            return
        table = emb.dynamic.tables[name]
        start, end = emb.ranges[name]
        plan = restore_plan(directory, manifest, name, table.dim, (), self.rank, self.world,
                            start, end, verify=False)
        table.slots.load(plan.slot_id, plan.seen, plan.freq, plan.paged.ids.numpy())
        table.slots.admission.load_state_dicts(plan.admission)
        gone = torch.from_numpy(~plan.kept).nonzero().squeeze(1).to(emb.device)
        emb.table_rows(name).index_fill_(0, gone, 0.0)

    @torch.no_grad()
    def _restore_pending(self, directory: Path, manifest: Manifest, step: int) -> None:
        """Put back the rows the pending updates touch and queue those updates (module doc);
        every rank reads every rank's pending file and keeps the rows of its own ranges."""
        tr = self.t
        emb, window = tr.embedding, tr.window
        entry = manifest.pending
        row_dtype = self.cfg.optim.row_dtype
        if entry is not None and emb.dynamic is not None and manifest.world_size != self.world:
            # a re-shard moves dynamic ids between owners and slots: the pending updates
            # (by slot) are already in the saved rows, and those are what is restored
            log.info("rank %d: re-sharding dynamic tables from world %d: the pending "
                     "updates are taken from the saved rows", self.rank, manifest.world_size)
            window.restore_pending(step, [])
            return
        if entry is None or manifest.row_dtype != row_dtype:
            if entry is not None and entry.applied_through < step:
                log.info("rank %d: resuming with --row-dtype %s from %s rows: the pending "
                         "updates are already in the saved rows", self.rank,
                         row_dtype, manifest.row_dtype)
            window.restore_pending(step, [])  # the rows hold every update <= step
            return  # nothing pending: nothing to predict (a predictor starts empty)
        applied = entry.applied_through
        payloads = []
        for _, f in entry.files:  # verified by resume_target
            payload = torch.load(directory / f.file, map_location="cpu", weights_only=True)
            if payload.get("format") != PENDING_FORMAT or payload.get("step") != step:
                raise ValueError(f"checkpoint file {directory / f.file} is not the pending "
                                 f"updates of step {step}")
            payloads.append(payload)
        for name in emb.tables:
            start, end = emb.ranges[name]
            for payload in payloads:
                saved = payload["before"].get(name)
                if saved is None:
                    continue
                mine = (saved["ids"] >= start) & (saved["ids"] < end)
                local_P = saved["ids"][mine].to(emb.device) - start
                weight = emb.table_rows(name)
                weight.index_copy_(0, local_P, saved["rows"][mine].to(weight.device,
                                                                      weight.dtype))
        merged: dict[tuple[int, str], list[dict[str, Any]]] = {}
        for payload in payloads:  # rank order: ascending row ranges, so ids stay sorted
            for u in payload["updates"]:
                merged.setdefault((u["step"], u["table"]), []).append(u)
        per_table = {}
        for (update_step, name), parts in merged.items():
            if name not in emb.tables:
                continue
            start, end = emb.ranges[name]
            ids = torch.cat([p["ids"] for p in parts])
            delta = torch.cat([p["delta"] for p in parts])
            mine = (ids >= start) & (ids < end)
            per_table[(update_step, name)] = (ids[mine], delta[mine], float(parts[0]["decay"]),
                                              bool(parts[0]["rows"]))
        updates = join_updates(emb, per_table)  # per unit
        window.restore_pending(applied, updates)
        predictions = [p["prediction"] for p in payloads if p.get("prediction") is not None]
        if window.predictor is not None and predictions:
            window.predictor.load_state_dict(predictions)
        elif window.predictor is not None and updates:
            log.info("rank %d: checkpoint %s was saved without --staleness-compensation "
                     "predict: predictions start again once updates are applied", self.rank,
                     directory)


# What a resume may change: how far each step moves, not what the saved state means. The
# kind fixes the state's layout (adam's m, v are not rowwise Adagrad's sums); betas and eps
# fix what m and v are (averages at those rates, bias-corrected by the saved step count).
RESUME_MAY_CHANGE = ("lr", "weight_decay")


def dense_optimizer_record(cfg: TrainConfig) -> dict[str, Any]:
    """The dense optimizer as the manifest records it (`dense.optimizer`)."""
    o = cfg.optim
    return {"kind": o.dense_kind, "lr": o.dense_lr, "weight_decay": o.weight_decay}


def resume_changes(directory: str, saved: dict[str, Any] | None, running: dict[str, Any],
                   saved_dense: Any, running_dense: dict[str, Any]) -> list[str]:
    """The settings a resume changes ("lr 0.02 -> 0.005", ...): only RESUME_MAY_CHANGE, of
    the sparse optimizer (`saved`, `running`: asdict of OptimizerSpec) and of the dense one
    (`dense_optimizer_record`; None: a checkpoint that did not record it). ResumeError, one
    line naming both, when anything else differs."""
    changes: list[str] = []
    if saved:
        fixed = {k: v for k, v in running.items() if k not in RESUME_MAY_CHANGE}
        if {k: saved.get(k) for k in fixed} != fixed:
            raise ResumeError(
                f"checkpoint {directory} was saved with optimizer {describe_saved(saved)}, "
                f"this run has {describe_saved(running)}: resume with the optimizer it was "
                f"saved with (only {' and '.join(RESUME_MAY_CHANGE)} may change on resume)")
        changes += [f"{k} {saved.get(k, 0.0):g} -> {running[k]:g}" for k in RESUME_MAY_CHANGE
                    if saved.get(k, 0.0) != running[k]]
    if isinstance(saved_dense, dict):
        if saved_dense.get("kind") != running_dense["kind"]:
            raise ResumeError(
                f"checkpoint {directory}: its dense part was saved with optimizer "
                f"{saved_dense.get('kind')}, this run has {running_dense['kind']}: resume with "
                f"--dense-optimizer {saved_dense.get('kind')} (one optimizer's state does not "
                "carry over to another)")
        for key, name in (("lr", "dense_lr"), ("weight_decay", "weight_decay")):
            before = saved_dense.get(key, running_dense[key])
            change = f"{name} {before:g} -> {running_dense[key]:g}"
            if before != running_dense[key] and change not in changes:
                changes.append(change)
    return changes


def _file_entry(info: ShardInfo) -> FileEntry:
    return FileEntry(info.file, info.bytes, info.crc32)
