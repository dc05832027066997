"""Run a function on W gloo ranks in spawned processes (no torchrun, no server).

    from tests.testing.spawn_helpers import run_ranks
    run_ranks("tests.worker.tasks.kge.test_kge_task:_scenario", 2, str(tmp_path))

The target ("module:function", importable from the repo root) is called as
`fn(ctx, *args)` on every rank with the worker's DistContext (init_distributed,
i.e. the same process groups as a torchrun worker). Failures on any rank raise.
"""

from __future__ import annotations

import importlib
import os
import socket
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(rank: int, world: int, port: int, target: str, args: tuple[Any, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    from worker.runtime.dist import destroy_distributed, init_distributed

    module, _, name = target.partition(":")
    fn = getattr(importlib.import_module(module), name)
    from worker.runtime.lifecycle import exit_process

    ctx = init_distributed("cpu", timeout_s=120.0)
    try:
        fn(ctx, *args)
    finally:
        destroy_distributed()
    exit_process(0)  # as worker/main.py does: no teardown abort after a clean finish


PORT_TAKEN = ("address already in use", "eaddrinuse")
ATTEMPTS = 3


def run_ranks(target: str, world: int, *args: Any) -> None:
    """free_port() closes its socket before rank 0's store binds the port, so another
    process may take it in between: only that failure is retried, on a new port."""
    for attempt in range(ATTEMPTS):
        try:
            mp.spawn(_child, args=(world, free_port(), target, args), nprocs=world, join=True)
            return
        except mp.ProcessRaisedException as exc:
            if attempt + 1 == ATTEMPTS or not any(m in str(exc).lower() for m in PORT_TAKEN):
                raise
