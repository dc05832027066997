"""Memory for row-shaped float32 tables: optimizer state (m, v, sum..., master rows) on the
shard server and a CPU rank's own embedding rows, laid out for the row kernels
(hybridps/optim.py). No grpc in this module."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hybridps import native

HUGEPAGE_MIN_BYTES = 4 << 20
HUGEPAGE_BYTES = 2 << 20
# Where each array a row kernel reads at the same row sits past a 2 MiB boundary
# (alloc_state's `offset`): m, v and the master row of one id fall in different L1 sets.
# "rows": a CPU rank's own embedding rows (worker/embedding/sharded.py); the other names are those
# of the optimizers' state (hybridps/optim_kinds.py, each kind's record). A state name not
# listed (a kind registered later) takes one of OTHER_OFFSETS by its place in its layout.
STATE_OFFSETS = {"m": 0, "v": 2048, "sum": 2560, "master": 1024, "rows": 3072}
OTHER_OFFSETS = (3584, 512, 1536, 3840)


def state_offset(name: str, index: int) -> int:
    """alloc_state's offset for the state tensor `name`, the `index`-th of its layout."""
    return STATE_OFFSETS.get(name, OTHER_OFFSETS[index % len(OTHER_OFFSETS)])


def alloc_state(rows: int, dim: int, *, hugepages: bool = True, offset: int = 0,
                zero: bool = True) -> torch.Tensor:
    """A float32 [rows, dim] CPU tensor for optimizer state or embedding rows, zeroed
    unless `zero=False` (a large table's memory is then left untouched, as torch.empty
    leaves it, for a caller that writes every element itself).

    Tables of HUGEPAGE_MIN_BYTES or more start `offset` bytes (a multiple of 64, below
    4096) past a 2 MiB boundary, and their storage is exactly the table (a save writes
    no slack). Why: the update kernel reads m[id] and v[id] together, and two tables
    allocated one after the other sit a whole number of pages apart, so m[id] and v[id]
    share an L1 set; with power-of-two table sizes they also share the way predictor's
    tag on this machine's AMD cores, and bench/bench_wire.py's 2^19 x 64 tables updated
    at 6.7 M rows/s instead of 16-18 (STATE_OFFSETS gives each array its own offset).

    With `hugepages` (Linux, extension built) the memory is advised for transparent
    huge pages before it is first touched. The row kernels touch random rows of
    tables far beyond the reach of the TLB with 4 KiB pages, and in a VM each TLB
    miss is a two-level page walk: bench/bench_kernel.py measured the native update
    1.2-1.7x faster on such tables (more right after allocation).
    """
    if offset % 64 or not 0 <= offset < 4096:
        raise ValueError(f"offset {offset} must be a multiple of 64 in [0, 4096)")
    nbytes = rows * dim * 4
    if nbytes < HUGEPAGE_MIN_BYTES:
        return torch.zeros(rows, dim, dtype=torch.float32)
    raw = np.empty(nbytes + HUGEPAGE_BYTES + offset, dtype=np.uint8)
    start = (-raw.ctypes.data) % HUGEPAGE_BYTES + offset
    # from_numpy of the slice: the tensor's storage is the slice (it keeps `raw` alive)
    t = torch.from_numpy(raw[start:start + nbytes].view(np.float32).reshape(rows, dim))
    ext = native.ext
    if hugepages and ext is not None:
        ext.advise_hugepages(t.data_ptr(), nbytes)
    return t.zero_() if zero else t


def alloc_row_state(widths: Sequence[tuple[str, int]], rows: int,
                    device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Zeroed float32 optimizer state, name -> [rows, width] (OptimizerSpec.state_widths);
    on the CPU each tensor is laid out by alloc_state at its name's offset."""
    if torch.device(device).type == "cpu":
        return {name: alloc_state(rows, width, offset=state_offset(name, i))
                for i, (name, width) in enumerate(widths)}
    return {name: torch.zeros(rows, width, dtype=torch.float32, device=device)
            for name, width in widths}
