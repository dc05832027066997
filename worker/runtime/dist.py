"""Devices and process groups for the worker: one code path for CPU and GPU.

The device decides the backend (cuda -> nccl, cpu -> gloo); the rest of the worker never
branches on it. Ranks come from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK). A
plain `python worker/main.py` (no torchrun) runs as a world of one with an in-memory
store, so the same loop, the dense wrapping included, works everywhere.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from worker.runtime.rendezvous import init_process_group as init_incarnation_group


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    mesh: DeviceMesh
    # Process group for the embedding all_to_all traffic, kept apart from the
    # group FSDP's collectives run on. None in a world of one (no collectives).
    embedding_group: dist.ProcessGroup | None
    # Ranks on this node (torchrun's LOCAL_WORLD_SIZE; the world without torchrun).
    local_world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(request: str, local_rank: int) -> torch.device:
    """auto -> cuda:<local_rank> when CUDA is usable, else cpu."""
    if request == "cuda" or (request == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("device='cuda' requested but torch.cuda.is_available() is False")
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA devices")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(device_request: str = "auto", timeout_s: float = 600.0) -> DistContext:
    """Join the process group described by torchrun's env (or make a world of one)."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    device = pick_device(device_request, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend_for(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    if "MASTER_ADDR" in os.environ:  # launched by torchrun (or an equivalent)
        # In a namespace of this incarnation: torchrun --max-restarts keeps one store
        # across restarts, and stale keys break gloo/NCCL connects (worker/runtime/rendezvous.py).
        init_incarnation_group(backend, rank, world_size, timeout_s,
                               device_id=device if device.type == "cuda" else None)
    else:
        if world_size != 1:
            raise RuntimeError(f"WORLD_SIZE={world_size} without MASTER_ADDR: launch with torchrun")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    embedding_group = dist.new_group(backend=backend) if world_size > 1 else None
    return DistContext(rank, world_size, local_rank, device, backend, mesh, embedding_group,
                       local_world_size)


def destroy_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
