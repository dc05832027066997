"""The dense part of a checkpoint: the model and its optimizer (and the fp16 loss scaler)
as a torch.distributed.checkpoint (DCP) directory, written and read sharded (`DensePart`,
worker/checkpoint/checkpointer.py's step 4), and read whole in one process for export."""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from hybridps.checkpoint import Manifest, file_crc32, verify_entry
from worker.checkpoint.parts import ManifestDraft
from worker.checkpoint.resume import dense_optimizer_record

if TYPE_CHECKING:
    from worker.checkpoint.writer import Stage, Written
    from worker.config.train_config import OptimConfig

DENSE_DIR = "dense"  # the DCP checkpoint of the dense part (older checkpoints: dense.pt)

log = logging.getLogger("worker.checkpoint")


def dense_state(dense: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The sharded state dicts of the dense part and its optimizer (what `save_dense` writes)."""
    return {"model": get_model_state_dict(dense), "optim": get_optimizer_state_dict(dense, opt)}


def save_dense(state: dict[str, Any], scaler_state: Any, directory: Path, rank: int,
               group: Any = None) -> dict[str, Any]:
    """`state` (`dense_state`) as a DCP checkpoint in `dense/` (collective on `group`).

    Sharded state dicts: each rank writes only its own FSDP shards (nothing is gathered
    on rank 0), and DCP's metadata lets a run of any world size read the pieces it
    needs. Returns the manifest entry (on rank 0; {} elsewhere): every DCP file with
    its size and crc32 (dcp.save has returned on rank 0 only after every rank's writes
    finished), and the fp16 GradScaler's state, identical on all ranks.
    """
    dcp.save(state, checkpoint_id=directory / DENSE_DIR, process_group=group)
    if rank != 0:
        return {}
    files = sorted(p for p in (directory / DENSE_DIR).iterdir() if p.is_file())
    return {"format": "dcp", "dir": DENSE_DIR,
            "files": [{"file": f"{DENSE_DIR}/{p.name}", "bytes": p.stat().st_size,
                       "crc32": file_crc32(p)} for p in files],
            "grad_scaler": scaler_state}


def restore_dense(dense: nn.Module, opt: torch.optim.Optimizer, scaler: Any,
                  directory: Path, entry: dict[str, Any], loss_scale_init: float) -> None:
    """Dense weights, dense optimizer and the loss scaler from a manifest entry (every
    file was verified before anything was loaded: worker/checkpoint/resume.py resume_target)."""
    if "file" in entry:  # written before DCP: full state dicts in one torch.save file
        blob = torch.load(directory / entry["file"], map_location="cpu", weights_only=False)
        full = StateDictOptions(full_state_dict=True)
        set_model_state_dict(dense, blob["model"], options=full)
        set_optimizer_state_dict(dense, opt, blob["optimizer"], options=full)
    else:
        state = dense_state(dense, opt)
        dcp.load(state, checkpoint_id=directory / entry["dir"])  # reads only our shards
        set_model_state_dict(dense, state["model"])
        set_optimizer_state_dict(dense, opt, state["optim"])
    saved = entry.get("grad_scaler")
    if scaler is not None and saved:
        scaler.load_state_dict(saved)  # else a fresh scale would skip steps again
    elif scaler is not None:
        log.warning("checkpoint %s has no loss scaler state (saved without --precision "
                    "fp16): the scale starts at --loss-scale-init %g", directory,
                    loss_scale_init)


def read_dense_full(directory: Path, entry: dict[str, Any]) -> dict[str, Any]:
    """{"model": plain full state dict, ...} of a manifest's dense entry, in one process
    with no process group (export): DCP's own converter to a torch.save file."""
    if "file" in entry:  # written before DCP
        verify_entry(directory, entry)
        return dict(torch.load(directory / entry["file"], map_location="cpu",
                               weights_only=False))
    for f in entry["files"]:
        verify_entry(directory, f)
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(directory / entry["dir"], Path(tmp) / "dense.pt")
        return dict(torch.load(Path(tmp) / "dense.pt", map_location="cpu", weights_only=False))


class DensePart:
    """The dense module, its optimizer and the fp16 loss scaler (`scaler`, None without
    fp16). A resume gives the optimizer this run's learning rate and weight decay after
    its state is loaded (worker/checkpoint/resume.py resume_changes)."""

    name = "dense"

    def __init__(self, dense: nn.Module, opt: torch.optim.Optimizer, scaler: Any, *,
                 rank: int, optim: OptimConfig, loss_scale_init: float) -> None:
        self.dense, self.opt, self.scaler, self.rank = dense, opt, scaler, rank
        self.optim, self.loss_scale_init = optim, loss_scale_init

    def snapshot(self, directory: Path, step: int, stage: Stage,
                 since: int | None = None) -> Written:
        state = stage.hold(dense_state(self.dense, self.opt))  # whole in every checkpoint
        scaler = None if self.scaler is None else stage.hold(self.scaler.state_dict())
        rank, group = self.rank, stage.group
        return stage.write(lambda: save_dense(state, scaler, directory, rank, group))

    def record(self, saved_by_rank: Sequence[Any], draft: ManifestDraft) -> None:
        draft.dense = {**saved_by_rank[0], "optimizer": dense_optimizer_record(self.optim)}

    def verify(self, directory: Path, manifest: Manifest) -> str | None:
        entry = manifest.dense or {}
        if "file" not in entry and "dir" not in entry:
            return f"checkpoint {directory} has no dense part (manifest key dense)"
        return None

    def restore(self, directory: Path, manifest: Manifest, step: int) -> None:
        restore_dense(self.dense, self.opt, self.scaler, directory, manifest.dense or {},
                      self.loss_scale_init)
        for group in self.opt.param_groups:  # this run's, not the saved ones
            group["lr"] = self.optim.dense_lr
            group["weight_decay"] = self.optim.weight_decay
