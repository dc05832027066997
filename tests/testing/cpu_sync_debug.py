"""The CPU's stand-in for CUDA's sync debug mode: the aten calls that make the host wait for
a CUDA device, seen on any device.

CUDA's own mode (`worker/runtime/device_copy.py` sync_debug) needs a GPU, so a loop that reads a
device value on the host passes every CPU test and first shows on a GPU. Most such reads
are aten calls whose CUDA kernel must hand a value or a size to the host: `.item()`,
`bool(t)`, indexing with a mask, `nonzero`, `unique`, `bincount`; the rest are copies:
to the host (`.tolist()`, `.cpu()`) and of host data straight to a device
(`torch.tensor(list, device=...)`, `t.new_tensor(list)`: blocking copies from pageable
memory). `SyncingOps` (a torch dispatch mode, with a torch function mode for the copies)
notes each of them made outside a named sync point, with the place in this repository
that asked for it, so the test suite finds them on the CPU (tests/worker/runtime/test_sync_ops.py).
What it cannot see: `.to(device)` of a host tensor that is not pinned (on the CPU there
is no device to copy to), which CUDA's mode still catches on a GPU (`gpu_check/check.py`,
stage sync_debug).
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from worker.runtime.device_copy import inside_sync_point, watch_sync_points

REPO = Path(__file__).resolve().parents[2]
_aten = torch.ops.aten

# Code that reads values of tensors kept on the host whatever the device, so a read there
# waits for nothing (the CPU cannot tell a host tensor from a device one): path fragment ->
# why.
HOST_SIDE = {
    "worker/tasks/": "batches are made on the host; the step copies them to the device "
                     "(Batch.to, non-blocking)",
    "torch/optim/": "torch's optimizers keep their step count on the host (unless "
                    "capturable, which reads nothing)",
}

# Frames of the dispatch itself, not of the code that made the call.
_DISPATCH_FRAMES = ("tests/testing/cpu_sync_debug.py", "torch/utils/_python_dispatch.py",
                    "torch/_compile.py", "torch/_dynamo/", "torch/overrides.py")

# Calls whose CUDA kernel hands a value or an output size to the host, whatever the inputs.
ALWAYS_SYNC = frozenset({
    _aten._local_scalar_dense.default,  # .item(), bool(t), int(t), float(t)
    _aten.is_nonzero.default,
    _aten.equal.default,
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten.bincount.default,
    _aten._unique2.default,
    _aten.unique_consecutive.default,
    _aten.unique_dim.default,
})
# Calls that sync with some inputs: a boolean (mask) index, an output size left unsaid.
INDEXING = frozenset({_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default,
                      _aten._index_put_impl_.default})


def syncs_on_cuda(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the aten call `func(*args, **kwargs)` makes the host wait on a CUDA device."""
    if func in ALWAYS_SYNC:
        return True
    if func in INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)
    if func is _aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    return False


# Tensor methods that copy a device tensor to the host, seen before dispatch (on the CPU
# `.tolist()` and `.cpu()` of a CPU tensor reach no aten call).
TO_HOST = frozenset({torch.Tensor.tolist, torch.Tensor.cpu})


# Tensors made from host data (a list, a number) straight on a device: on CUDA a blocking
# copy from pageable memory (`worker.runtime.device_copy.to_device` copies through pinned memory).
FROM_HOST_DATA = frozenset({torch.tensor, torch.Tensor.new_tensor})


def _on_a_device(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether `torch.tensor(data, device=...)` / `t.new_tensor(data)` would land on a
    device: a `device` given (torch.tensor), or `t`'s own (new_tensor) unless given as the
    CPU. On the CPU every device is the host, so the call is noted for what it would do."""
    device = kwargs.get("device")
    if func is torch.tensor:
        return device is not None
    return device is None or torch.device(device).type != "cpu"


class _HostCopies(TorchFunctionMode):
    """Copies to the host (`.tolist()`, `.cpu()`) and of host data straight to a device
    (`torch.tensor(..., device=)`, `new_tensor`), noted by the SyncingOps that holds this."""

    def __init__(self, note: Any) -> None:
        super().__init__()
        self._note = note

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if not inside_sync_point():
            if func in TO_HOST:
                self._note(f"Tensor.{func.__name__}")
            elif func in FROM_HOST_DATA and _on_a_device(func, args, kwargs):
                self._note(f"{'torch.tensor' if func is torch.tensor else 'Tensor.new_tensor'}"
                           " to a device")
        return func(*args, **kwargs)


class SyncingOps(TorchDispatchMode):
    """Notes every aten call of the block, on this thread (and the autograd engine's on its
    behalf), that would synchronise on CUDA outside a named sync point: `sites` maps the
    innermost place in this repository that asked for it ("worker/x.py:12 fn") to its count
    and a short stack."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: dict[str, dict[str, Any]] = {}
        self._watch = watch_sync_points()
        self._copies = _HostCopies(self._note)

    def __enter__(self) -> SyncingOps:
        self._watch.__enter__()
        self._copies.__enter__()
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._copies.__exit__(*exc)
        self._watch.__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if not inside_sync_point() and syncs_on_cuda(func, args, kwargs):
            self._note(str(func))
        return func(*args, **kwargs)

    def _note(self, op: str) -> None:
        stack = [f for f in traceback.extract_stack()
                 if not any(part in f.filename for part in _DISPATCH_FRAMES)]
        if stack and any(part in stack[-1].filename for part in HOST_SIDE):
            return
        here = str(REPO)
        frames = [f for f in stack if f.filename.startswith(here) and "/.venv/" not in f.filename]
        where = [f"{Path(f.filename).relative_to(REPO)}:{f.lineno} {f.name}" for f in frames]
        site = where[-1] if where else "(outside the repository)"
        entry = self.sites.setdefault(site, {"count": 0, "ops": [], "stack": where[-6:]})
        entry["count"] += 1
        if op not in entry["ops"]:
            entry["ops"].append(op)
