"""--data-workers N: the next steps' batches decoded in DataLoader worker processes.

Worker w of N makes the batches of steps start + w, start + w + N, ... (torch's DataLoader
hands them out in that round-robin order, so the batches come in step order); the training
process asks for the steps in order, and any other step (a resume, an evaluation's reader)
starts the workers again from there. The workers are spawned, not forked: the training
process holds gRPC channels and threads that a fork would copy mid-use. A worker sends
numpy arrays (pickled through the pipe: one copy), not tensors (one shared-memory file a
tensor, some 30 a batch, each costing more than the copy). A DataError in a
worker comes back as its one line, raised at the step it belongs to.

Pinned memory: on a CUDA device the training process copies a batch's host tensors into
pinned (page-locked) memory (FileSource, `Batch.pin_memory`), so the trainer's
`.to(device, non_blocking=True)` is a DMA that overlaps the step; the DataLoader's own
`pin_memory=True` would pin nothing here (its items are numpy arrays, not tensors). On
the CPU nothing is pinned (`pin_host_memory`): the copy is a no-op there.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch.utils.data as tud

from worker.data.errors import DataError
from worker.data.reader import FileReader, ReaderConfig
from worker.data.samples import Samples
from worker.tasks.base import Batch

__all__ = ["PrefetchLoader", "pin_host_memory"]

PREFETCH_PER_WORKER = 4
WATCH_S = 1.0  # how often a worker looks whether the training process is still there


def pin_host_memory(device_request: str, cuda_available: bool) -> bool:
    """Pin the batches' host tensors? Only when the run's device (--device auto|cpu|cuda,
    worker/runtime/dist.pick_device) is a CUDA one."""
    return device_request != "cpu" and cuda_available


def _identity(item: Any) -> Any:
    return item


def _exit_with(parent: int) -> None:
    """In a worker: end it once the training process is gone. The worker leaves by
    itself only when told (the DataLoader's shutdown), and a rank ends without it
    (worker/runtime/lifecycle.exit_process: no interpreter teardown); its result queue's
    feeder thread would then wait forever on a pipe nobody reads."""
    while os.getppid() == parent:
        time.sleep(WATCH_S)
    os._exit(0)


class _Steps(tud.IterableDataset[tuple[int, Samples | str]]):
    def __init__(self, config: ReaderConfig, rank: int, start: int) -> None:
        self.config, self.rank, self.start = config, rank, start

    def __iter__(self) -> Iterator[tuple[int, Samples | str]]:
        info = tud.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is not None:
            threading.Thread(target=_exit_with, args=(os.getppid(),), daemon=True).start()
        reader = FileReader(self.config)
        step = self.start + worker
        while True:
            try:
                samples = reader.samples(step, self.rank)
            except DataError as exc:
                yield step, str(exc)
                return
            yield step, samples
            step += workers


class PrefetchLoader:
    """Batches of one rank from `workers` processes, in step order."""

    def __init__(self, config: ReaderConfig, rank: int, workers: int) -> None:
        self.config, self.rank, self.workers = config, rank, workers
        self._it: Iterator[tuple[int, Samples | str]] | None = None
        self._next = -1

    def get(self, step: int) -> Batch:
        if self._it is None or step != self._next:
            self.close()
            loader = tud.DataLoader(
                _Steps(self.config, self.rank, step), batch_size=None, collate_fn=_identity,
                num_workers=self.workers, multiprocessing_context="spawn",
                prefetch_factor=PREFETCH_PER_WORKER)
            self._it = iter(loader)
        got, item = next(self._it)
        if isinstance(item, str):
            self.close()
            raise DataError(item)
        if got != step:  # the round-robin order is the DataLoader's contract
            raise RuntimeError(f"data worker sent step {got}, expected {step}")
        self._next = step + 1
        return item.to_batch()

    def close(self) -> None:
        it, self._it = self._it, None
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
