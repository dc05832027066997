"""How a checkpoint's bytes get written: at once, or in the background while the step loop
goes on (`--checkpoint-async`, as torch.distributed.checkpoint's async_save does).

A checkpoint is taken in two phases (worker/checkpoint/checkpointer.py):

1. the snapshot, on the step loop's thread at the step boundary: every part holds the
   state of the step through a `Stage` (`hold`: the tensors it will write) and hands over
   the function that writes them (`write`);
2. the job: every part's write, the gathering of what every rank wrote, the manifest
   (last, atomically) and the pruning, run by a `Writer`.

`SyncWriter` holds nothing (the state is written in place, inside the snapshot: the step
loop waits for every byte). `AsyncWriter` copies what is held into host memory (buffers of
the same shape and dtype are reused from one checkpoint to the next: the extra memory is
one snapshot of this rank's state, reported as `snapshot_bytes`) and runs the job in one
background thread; only one job is in flight: the next checkpoint, and the end of the run
(`close`), wait for the previous one. The job's collectives then run on a process group of
their own (`group`, gloo), never on the step loop's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

Write = Callable[[], Any]  # write() -> this rank's account of a part's files


class Written(Protocol):
    """What a part's write returned, once it ran (`result`: in the job)."""

    def result(self) -> Any: ...


class Stage(Protocol):
    """What a part holds its state of a checkpoint's step through (module doc)."""

    group: Any  # the process group of the job's collectives (None: the default one)

    def hold(self, obj: Any) -> Any:
        """`obj` (tensors, numpy arrays, in dicts, lists and tuples) as it is now, for a
        write that may run after the step loop changed it."""
        ...

    def write(self, write: Write) -> Written:
        """The part's write of what it held (called once, in the snapshot)."""
        ...


class Writer(Protocol):
    """Runs a checkpoint's job (module doc)."""

    def stage(self) -> Stage: ...

    def submit(self, job: Callable[[], None]) -> None: ...

    def wait(self) -> None:
        """Until the job in flight (if any) is done; raises what it raised."""
        ...

    def close(self) -> None: ...

    @property
    def snapshot_bytes(self) -> int: ...


class _Done:
    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self) -> Any:
        return self.value


class _Direct:
    """Holds nothing; writes at once (inside the snapshot)."""

    group = None

    def hold(self, obj: Any) -> Any:
        return obj

    def write(self, write: Write) -> Written:
        return _Done(write())


class SyncWriter:
    """The step loop writes every byte before it goes on."""

    snapshot_bytes = 0

    def stage(self) -> Stage:
        return _Direct()

    def submit(self, job: Callable[[], None]) -> None:
        job()

    def wait(self) -> None:
        return None

    def close(self) -> None:
        return None


class _Deferred:
    def __init__(self, write: Write) -> None:
        self.write, self.done, self.value = write, False, None

    def result(self) -> Any:
        if not self.done:
            self.value, self.done = self.write(), True
            self.write = _spent
        return self.value


def _spent() -> Any:
    raise AssertionError("a deferred checkpoint write ran twice")


class _BufferPool:
    """Host buffers of the previous snapshot, reused by shape and dtype (fresh memory costs
    page faults on every checkpoint); what is not reused is freed."""

    def __init__(self) -> None:
        self.free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}

    def take(self, t: torch.Tensor) -> torch.Tensor:
        held = self.free.get((tuple(t.shape), t.dtype))
        out = held.pop() if held else torch.empty(t.shape, dtype=t.dtype)
        return out.copy_(t)

    def give(self, buffers: list[torch.Tensor]) -> None:
        self.free = {}
        for b in buffers:
            self.free.setdefault((tuple(b.shape), b.dtype), []).append(b)


class _Copying:
    """Holds host copies of what a part will write; the writes run later, in the job."""

    def __init__(self, pool: _BufferPool, group: Any) -> None:
        self.pool, self.group = pool, group
        self.buffers: list[torch.Tensor] = []
        self.nbytes = 0

    def hold(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            if type(t) is torch.Tensor and t.layout == torch.strided:
                copy = self.pool.take(t)
                self.buffers.append(copy)
            else:  # a DTensor (an FSDP shard): its own copy, same kind, on the host
                copy = t.to("cpu", copy=True)
            self.nbytes += copy.numel() * copy.element_size()
            return copy
        if isinstance(obj, np.ndarray):
            self.nbytes += obj.nbytes
            return obj.copy()
        if isinstance(obj, dict):
            return type(obj)((k, self.hold(v)) for k, v in obj.items())
        if isinstance(obj, list):
            return [self.hold(v) for v in obj]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self.hold(v) for v in obj)
        return obj

    def write(self, write: Write) -> Written:
        return _Deferred(write)


class AsyncWriter:
    """The job runs in a background thread; one at a time (module doc). `world_size` > 1:
    the job's collectives get a gloo group of their own (made here: every rank builds its
    writer at the same point)."""

    def __init__(self, world_size: int) -> None:
        self.group = dist.new_group(backend="gloo") if world_size > 1 else None
        self.pool = _BufferPool()
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.current: _Copying | None = None
        self.snapshot_bytes = 0  # the most one snapshot held (reused between checkpoints)

    def stage(self) -> Stage:
        self.wait()
        self.current = _Copying(self.pool, self.group)
        return self.current

    def submit(self, job: Callable[[], None]) -> None:
        self.wait()
        held = self.current
        self.current = None
        if held is not None:
            self.snapshot_bytes = max(self.snapshot_bytes, held.nbytes)

        def run() -> None:
            try:
                job()
            except BaseException as exc:  # handed to the step loop at its next wait
                self.error = exc
            finally:
                if held is not None:
                    self.pool.give(held.buffers)

        self.thread = threading.Thread(target=run, name="checkpoint-writer", daemon=True)
        self.thread.start()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        error, self.error = self.error, None
        if error is not None:
            raise error

    def close(self) -> None:
        self.wait()
        self.pool.give([])


def make_writer(asynchronous: bool, world_size: int) -> Writer:
    """--checkpoint-async: the background writer, else the synchronous one."""
    return AsyncWriter(world_size) if asynchronous else SyncWriter()
