"""How much memory a rank has: its GPU's, or on the CPU its share of the host's. Torch is
imported only for a GPU's size (worker/plan.py reads the host's before torch is set up)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

GB = 10**9


def detect_host_memory() -> int | None:
    """Physical memory, or the cgroup's limit when lower (containers)."""
    candidates = []
    with contextlib.suppress(ValueError, OSError, AttributeError):
        candidates.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:
            candidates.append(int(text))
    return min(candidates) if candidates else None


def rank_memory_bytes(device: torch.device, local_world_size: int, *,
                      device_memory_gb: float = 0.0, host_memory_gb: float = 0.0) -> int | None:
    """Bytes one rank can use: --device-memory-gb or its GPU's total on cuda; on the CPU the
    host's memory (--host-memory-gb or detected) over the `local_world_size` ranks sharing
    it. None: not known."""
    if device.type == "cuda":
        if device_memory_gb > 0:
            return int(device_memory_gb * GB)
        import torch

        return int(torch.cuda.get_device_properties(device).total_memory)
    host = int(host_memory_gb * GB) if host_memory_gb > 0 else detect_host_memory()
    return None if host is None else host // max(1, local_world_size)
