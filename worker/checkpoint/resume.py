"""Which checkpoint a run resumes from, and what a resume may change.

Before anything is loaded the checkpoint is verified whole: the manifest against its own
checksum and every file it lists (rows, optim, pending, dense, the parts' own files)
against its size and crc32, the files split among the ranks, which then agree on the
verdict (`resume_target`), so every rank resumes from the same checkpoint. `--resume`
takes the newest intact one: a damaged newer one is skipped with a warning naming the bad
file. `--resume-from` a step directory takes exactly that one: damaged or missing, the
worker exits 2 with one line saying why (ResumeError; a root directory behaves like
--resume).

The optimizers must be the ones the checkpoint was saved with (kind, betas, eps: what the
saved state means), but for their learning rates and weight decay (`resume_changes`):
rank 0 says what changed, the server takes the new values from Register, the dense
optimizer gets them after its state is loaded, and later checkpoints record them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from hybridps.checkpoint import (
    MANIFEST,
    Manifest,
    complete_checkpoints,
    verify_chain,
)
from hybridps.errors import ShardError
from hybridps.optim_kinds import describe_saved

if TYPE_CHECKING:
    from worker.config.train_config import CheckpointConfig, OptimConfig

log = logging.getLogger("worker.checkpoint")

# What a resume may change: how far each step moves, not what the saved state means. The
# kind fixes the state's layout (adam's m, v are not rowwise Adagrad's sums); betas and eps
# fix what m and v are (averages at those rates, bias-corrected by the saved step count).
RESUME_MAY_CHANGE = ("lr", "weight_decay")


class ResumeError(ValueError):
    """No checkpoint to resume as asked (damaged, missing): the worker exits 2."""


def find_checkpoint(root: str | Path) -> Path | None:
    """A complete checkpoint directory itself, or the newest complete one under `root`."""
    root = Path(root)
    if (root / MANIFEST).is_file():
        return root
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def resume_target(opts: CheckpointConfig, rank: int, world: int,
                  check: Callable[[str, Manifest], None]) -> tuple[Path, int] | None:
    """The (directory, step) every rank resumes from (module doc), or None (collective).
    `check(directory, manifest)` raises ResumeError for an intact checkpoint this run
    cannot resume (another optimizer: `resume_changes`)."""
    if not (opts.resume or opts.resume_from):
        return None
    where = Path(opts.resume_from or opts.checkpoint_dir)
    exact = bool(opts.resume_from) and (where / MANIFEST).is_file()
    if exact:
        candidates = [str(where.resolve())]
    else:
        candidates = [str(d.resolve()) for _, d in reversed(complete_checkpoints(where))]
    box: list[Any] = [candidates]
    if world > 1:  # rank 0's list wins (a checkpoint may complete meanwhile)
        dist.broadcast_object_list(box, src=0)
    candidates = list(box[0])
    skipped: list[str] = []
    for candidate in candidates:
        problem = verify_together(Path(candidate), rank, world)
        if problem is None:
            manifest = Manifest.read(candidate)
            check(candidate, manifest)
            if rank == 0:
                log.info("rank 0: resuming from %s (step %d)%s", candidate, manifest.step,
                         f"; skipped {len(skipped)} damaged newer checkpoint(s)"
                         if skipped else "")
            return Path(candidate), manifest.step
        if exact:
            raise ResumeError(f"resume_from={opts.resume_from!r}: checkpoint is damaged: "
                              f"{problem}")
        skipped.append(candidate)
        if rank == 0:
            log.warning("rank 0: checkpoint %s is damaged, skipped: %s", candidate, problem)
    if skipped:
        raise ResumeError(f"no intact checkpoint under {str(where)!r}: all {len(skipped)} "
                          "are damaged (see the warnings above); move them away to start "
                          "at step 0")
    if opts.resume_from:
        raise ResumeError(f"resume_from={opts.resume_from!r}: no complete checkpoint "
                          f"({MANIFEST}) there")
    log.info("rank %d: --resume: no complete checkpoint under %s; starting at step 0",
             rank, where)
    return None


def verify_together(directory: Path, rank: int, world: int) -> str | None:
    """Collective: every rank checks its share of the checkpoint's files; None when all
    are intact, else the first problem found (the same answer on every rank)."""
    problem: str | None = None
    try:
        verify_chain(directory, share=(rank, world))  # every link of an incremental one
    except (ShardError, OSError, ValueError, KeyError, TypeError) as exc:
        problem = str(exc) or type(exc).__name__
    gathered: list[Any] = [problem]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, problem)
    return next((p for p in gathered if p is not None), None)


def dense_optimizer_record(optim: OptimConfig) -> dict[str, Any]:
    """The dense optimizer as the manifest records it (`dense.optimizer`)."""
    return {"kind": optim.dense_kind, "lr": optim.dense_lr, "weight_decay": optim.weight_decay}


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
