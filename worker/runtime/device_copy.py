"""Rows, gradients and updates between the device and the host, and the places where the
training loop waits for the device.

On a GPU a step should never wait for the host without a reason:
- a push's gradients leave the device through pinned host buffers, copied with
  non-blocking copies on a side stream that waits for the step's stream (`grads_to_host`);
  the shard client sends a push once its copy is done (`PushOutbox`), and waits for the
  copy only when the update is due (--staleness 0, a checkpoint, the end);
- an update from the server goes back through a pinned buffer with a non-blocking copy on
  the step's stream (`to_device`), applied at the step boundary by the staleness window;
- the server-side math (its process, and the wire) only ever sees host tensors.

On the CPU every function here is a pass-through: the same tensors, no copy, so the CPU
path (and every bitwise test) is unchanged.

The places that must wait for the device are named (`SYNC_POINTS`) and entered with
`sync_point(name)`. Under `sync_debug("error")` (torch.cuda.set_sync_debug_mode) any other
synchronising CUDA call in the loop raises; `gpu_check/check.py` runs the loop so and lists
every unnamed place it finds (tests/worker/runtime/test_device_copy.py lists the named ones).
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

# name -> why the loop must wait for the device there (tests/worker/runtime/test_device_copy.py
# lists them)
SYNC_POINTS: dict[str, str] = {
    "check_ids": "worker/embedding/sharded.py: every id of a lookup inside its table (one host "
                 "read of the bounds a lookup), so a bad id fails with one line naming it",
    "input_dist": "worker/embedding/sharded.py, world size > 1: the sizes of the ids' all_to_all "
                  "come from the ids (their dedupe and the counts per owner in "
                  "worker/embedding/input_dist.py make_requests, the sizes received in "
                  "worker/embedding/comm.py)",
    "dynamic_ids": "worker/embedding/dynamic/ids.py: a dynamic table's id -> slot maps are on the "
                   "host, so its lookups' ids come back from the device",
    "pop_grads": "worker/embedding/unit_rows.py: the coalesced row gradients; how many rows a "
                 "push carries depends on the ids",
    "push_grads_ready": "worker/sync/client.py: a push whose update is due now (--staleness 0, a "
                        "checkpoint, the end) waits for its copy to the host",
    "update_ids": "worker/embedding/unit_rows.py: the ids of an update held on the device "
                  "(--local-optimizer) checked inside the owned range",
    "log_loss": "worker/train/trainer.py: the mean loss, every --log-every steps",
    "stop_flag": "worker/runtime/lifecycle.py: the ranks agree whether to stop, every --log-every "
                 "steps",
    "evaluate": "worker/train/trainer.py: an evaluation during training (--eval-every)",
    "checkpoint": "worker/train/trainer.py: a checkpoint (--checkpoint-every)",
}

# how often each sync point was entered (gpu_check/check.py reports them per step)
SYNC_HITS: collections.Counter[str] = collections.Counter()

_lock = threading.Lock()
_debug_mode = 0  # torch.cuda sync debug mode while sync_debug() is on: 1 warn, 2 error
_watchers = 0    # sync_debug() or watch_sync_points() blocks open: sync points are counted
_inside = 0      # sync points entered and not left (any thread) while watched


class sync_point:
    """A place where the loop must wait for the device, named in SYNC_POINTS. Inside it the
    CUDA sync debug mode is off (it is on only under `sync_debug`); elsewhere it costs a
    dictionary lookup and a count."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        if name not in SYNC_POINTS:
            raise KeyError(f"sync point {name!r} is not named in worker/runtime/device_copy.py "
                           "SYNC_POINTS")
        self.name = name

    def __enter__(self) -> None:
        global _inside
        SYNC_HITS[self.name] += 1
        if _watchers:
            with _lock:
                _inside += 1
                if _inside == 1 and _debug_mode:
                    torch.cuda.set_sync_debug_mode(0)

    def __exit__(self, *exc: object) -> None:
        global _inside
        if _watchers:
            with _lock:
                _inside -= 1
                if _inside == 0 and _debug_mode:
                    torch.cuda.set_sync_debug_mode(_debug_mode)


def inside_sync_point() -> bool:
    """Whether a named sync point is open, inside a `watch_sync_points` (or `sync_debug`)
    block: what a watcher of synchronising calls must let pass."""
    return _inside > 0


@contextlib.contextmanager
def watch_sync_points() -> Iterator[None]:
    """Count the sync points entered and left for the block (`inside_sync_point`); a
    watcher that is not CUDA's own (tests/testing/cpu_sync_debug.py) opens one around the loop."""
    global _watchers
    with _lock:
        _watchers += 1
    try:
        yield
    finally:
        with _lock:
            _watchers -= 1


class sync_debug:
    """torch.cuda.set_sync_debug_mode(mode) ("warn" or "error") outside the sync points,
    for the block; a no-op without CUDA."""

    MODES: ClassVar[dict[str, int]] = {"default": 0, "warn": 1, "error": 2}

    def __init__(self, mode: str) -> None:
        if mode not in self.MODES:
            raise ValueError(f"sync debug mode {mode!r} is not one of {', '.join(self.MODES)}")
        self.mode = self.MODES[mode]
        self._before = 0

    def __enter__(self) -> None:
        global _debug_mode, _watchers
        if not torch.cuda.is_available():
            return
        self._before = torch.cuda.get_sync_debug_mode()
        with _lock:
            _watchers += 1
            _debug_mode = self.mode
        torch.cuda.set_sync_debug_mode(self.mode)

    def __exit__(self, *exc: object) -> None:
        global _debug_mode, _watchers
        if not torch.cuda.is_available():
            return
        with _lock:
            _watchers -= 1
            _debug_mode = 0
        torch.cuda.set_sync_debug_mode(self._before)


# -- device -> host: a push's gradients ---------------------------------------------------

Grads = Mapping[str, tuple[torch.Tensor, torch.Tensor]]  # unit -> (ids_U, grads_UD)

_side_streams: dict[torch.device, Any] = {}


def _side_stream(device: torch.device) -> Any:
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)
    return stream


@dataclass
class HostGrads:
    """A push's gradients on the host; `event` (CUDA) marks when their copy is done."""

    grads: dict[str, tuple[torch.Tensor, torch.Tensor]]
    event: Any = None  # torch.cuda.Event, None once done (or on the CPU)

    def ready(self) -> bool:
        """Copied (never waits)."""
        if self.event is not None and self.event.query():
            self.event = None
        return self.event is None

    def wait(self) -> None:
        """Until copied: a named sync point (push_grads_ready)."""
        if self.event is not None:
            with sync_point("push_grads_ready"):
                self.event.synchronize()
            self.event = None


def grads_to_host(grads: Grads) -> HostGrads:
    """Every unit's (ids_U, grads_UD) on the host. CUDA: copies into pinned buffers on a
    side stream that first waits for the current stream, recorded as in use there so the
    caching allocator does not hand the gradients' memory out before the copy read them;
    returns at once. CPU: the tensors themselves (detached)."""
    device = next((t.device for pair in grads.values() for t in pair), None)
    if device is None or device.type != "cuda":
        return HostGrads({name: (ids_U.detach(), grads_UD.detach())
                          for name, (ids_U, grads_UD) in grads.items()})
    stream = _side_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.cuda.stream(stream):
        for name, pair in grads.items():
            host = []
            for tensor in pair:
                tensor = tensor.detach()
                pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                pinned.copy_(tensor, non_blocking=True)
                tensor.record_stream(stream)
                host.append(pinned)
            out[name] = (host[0], host[1])
    event = torch.cuda.Event()
    event.record(stream)
    return HostGrads(out, event)


class PushOutbox:
    """Pushes whose gradients are on their way to the host, in step order (the shard
    client's; worker/sync/client.py). On the CPU a push is ready as soon as it is added."""

    def __init__(self) -> None:
        self._queue: collections.deque[tuple[int, HostGrads, float | None]] = (
            collections.deque())

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, step: int, grads: Grads, lr: float | None) -> None:
        """Start the copy of `step`'s gradients to the host (never waits)."""
        self._queue.append((step, grads_to_host(grads), lr))

    def ready(self, through_step: int = -1
              ) -> Iterator[tuple[int, dict[str, tuple[torch.Tensor, torch.Tensor]],
                              float | None]]:
        """(step, host gradients, lr) in step order: every push whose copy is done, and
        those of steps <= `through_step`, waiting for their copies (they are due)."""
        while self._queue:
            step, host, lr = self._queue[0]
            if not host.ready():
                if step > through_step:
                    return
                host.wait()
            self._queue.popleft()
            yield step, host.grads, lr

    def clear(self) -> None:
        self._queue.clear()


# -- host -> device: updates --------------------------------------------------------------

def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`. A host tensor goes to a CUDA device through a pinned buffer,
    with a non-blocking copy on the current stream (torch's pinned allocator keeps the
    buffer until that copy is done). Already there (the CPU): the tensor itself."""
    if tensor.device == device or device.type != "cuda":
        return tensor if tensor.device == device else tensor.to(device)
    if tensor.device.type == "cpu" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
