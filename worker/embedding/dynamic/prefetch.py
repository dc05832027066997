"""Translating the next step's dynamic ids while this step trains (`prefetch`).

A dynamic table's lookup first turns raw ids into slots at their owners (admission,
eviction, page-out and page-in: worker/embedding/dynamic/ids.py), work on the host that the step
then waits for. A loop that knows step t+1's ids during step t can hand them over after
step t's forward (`ShardedEmbedding.prefetch`): the translation of step t+1 then runs on
a helper thread while step t's backward, optimizer and push run, and step t+1's lookup
takes its result. TorchRec's prefetch pipeline does the same for its embedding caches.

Why it is safe to run beside step t: step t's update touches the rows of step t's slots;
the translation writes only the rows of the slots it fills (free ones, and victims whose
every update is applied), and it may evict no slot looked up at step t or later. So with
prefetching the pin rule holds one more step: the translation of step s evicts only slots
last seen at or before s - 2 - K (without it: s - 1 - K). Whether the translation ran
ahead or at the lookup, the same rule gives the same slots
(tests/worker/embedding/dynamic/test_dynamic_prefetch.py
compares the two bitwise).

Nothing before step s sees its translation: an evaluation in between reads the ids new
at step s as unknown (zeros) and the paged store before step s's expiry (that runs at
step s's lookup), so it reads what it would without the prefetch. A checkpoint cannot be
taken while a translation is pending (the trainer prefetches no step that follows a
save); a run stopped early ends with the next step's ids on their slots.

The helper thread runs where the step is one native call without the GIL
(worker/embedding/dynamic/fused.py: in-process store, fp32 rows on the CPU) and at world size 1 (the
ids' exchange is a collective of the training thread's group); elsewhere `prefetch` only
sets the pin rule and the step translates at its lookup: the same result, no overlap.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


@dataclass
class _Pending(Generic[T]):
    step: int
    names: tuple[str, ...]
    ids: list[torch.Tensor]  # the flat host ids translated, one per entry
    result: concurrent.futures.Future[T]


class Prefetcher(Generic[T]):
    """At most one step's translation ahead: `submit` it, `take` it at that step's first
    lookup (which must pass the same tables and ids), `wait` before anything else reads
    the maps."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: _Pending[T] | None = None
        self.taken = 0  # lookups served by a prefetched translation

    @property
    def pending_step(self) -> int | None:
        return None if self._pending is None else self._pending.step

    def submit(self, step: int, names: Sequence[str], ids: list[torch.Tensor],
               work: Callable[[], T]) -> None:
        if self._pending is not None:
            raise RuntimeError(f"prefetch(step={step}): step {self._pending.step}'s ids were "
                               "prefetched and not looked up yet")
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="hybridps-prefetch")
        self._pending = _Pending(step, tuple(names), ids, self._pool.submit(work))

    def wait(self) -> None:
        """Let a translation in flight finish (its result stays for `take`)."""
        if self._pending is not None:
            concurrent.futures.wait([self._pending.result])

    def take(self, step: int, names: Sequence[str], ids: Sequence[torch.Tensor]) -> T | None:
        """The result prefetched for this lookup, None where nothing was; an error where
        the prefetch was for other tables or ids (their slots are already taken)."""
        pending = self._pending
        if pending is None:
            return None
        if pending.step != step:
            self.wait()
            if pending.step < step:
                self._pending = None
                raise RuntimeError(f"step {pending.step}'s ids were prefetched but never "
                                   f"looked up (now at step {step})")
            raise RuntimeError(f"step {step}: a lookup of dynamic tables after step "
                               f"{pending.step}'s ids were prefetched; prefetch after the "
                               "step's last lookup")
        self._pending = None
        got = pending.result.result()  # re-raises the translation's error
        if pending.names != tuple(names) or len(ids) != len(pending.ids) or not all(
                a.shape == b.shape and torch.equal(a, b)
                for a, b in zip(ids, pending.ids, strict=True)):
            raise RuntimeError(
                f"step {step}: the first dynamic lookup (tables {list(names)}) is not the one "
                f"prefetched (tables {list(pending.names)}) or its ids differ; prefetch "
                "exactly the ids of the step's first lookup of dynamic tables")
        self.taken += 1
        return got
