"""--pipeline: the next batch's data and input dist overlap the current step.

In the spirit of TorchRec's TrainPipelineSparseDist: while the training thread
runs step t, one background thread makes batch t+1 (task.batch, host-to-device
copy) and runs stages 1-2 of its lookups (route, the one all_to_all of counts
and ids, the owner's layout of what it serves: `ShardedEmbedding.input_dist`) on
a process group of its own, so its collectives never interleave with the
training thread's. The training thread then only does stages 3-4 (local gather
or pooling, all_to_all of the rows and partial sums) for it, after
the staleness window applied the due updates: input dist depends on the ids
alone, so the rows, the losses and the results are exactly those of the
unpipelined loop (tests/worker/train/test_pipeline.py compares them at --staleness 0).

Which lookups a batch needs is learned, not declared: the first step runs
unpipelined with the embedding recording its lookups, and each lookup's id
tensors and bag offsets are found (by identity) among the batch's fields (a bag's
offsets matter: a bag pooled at its owner sends the bag lengths with the ids). If
one is not a batch field (the task derived it), input dist stays on the training
thread and only the batch itself is made ahead.

With dynamic tables (docs/dynamic_ids.md) the pipeline also prefetches: after step t's
forward, `after_forward` hands batch t+1's ids of its first lookup of dynamic tables to
the embedding, whose translation to slots (admission, eviction, paging) then runs while
step t finishes (worker/embedding/dynamic/prefetch.py); their input dist stays in the step, as it
needs the slots. The pin rule then holds one step more, from the first step on.

Off by default: with one CPU core per rank the thread's own work (making the batch,
routing) competes with the step for that core and the GIL, and only waits are hidden;
bench/bench_train.py measured 0.95-0.98x on a quiet 2-core machine and up to 1.46x on a
loaded one (README, Performance).

Determinism across ranks: step t+1 is submitted when step t starts, on every
rank alike, so the set of in-flight collectives on the pipeline's group is the
same everywhere, also when a stop ends the loop early (`close` waits for it).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from hybridps.logs import kv
from worker.embedding.input_dist import InputDist
from worker.embedding.sharded import ShardedEmbedding
from worker.tasks.base import Batch, Task

log = logging.getLogger("worker.pipeline")

T = TypeVar("T")
FieldRef = tuple[str, str]  # ("ids" | "bags" | "offsets" | "values", key) of a Batch
# per lookup: table names, where its ids are, and per entry None or (where its offsets are,
# pooling mode)
LookupPlan = list[tuple[tuple[str, ...], tuple[FieldRef, ...],
                        tuple[tuple[FieldRef, str] | None, ...]]]


@dataclass
class Prepared:
    step: int
    batch: Batch
    plans: list[InputDist]
    dynamic_ids: list[torch.Tensor]  # host ids of the first lookup of dynamic tables
    data_s: float   # making the batch + host-to-device copy (on the pipeline thread)
    dist_s: float   # input dist (on the pipeline thread)


def find_field(batch: Batch, tensor: torch.Tensor) -> FieldRef | None:
    """Where `tensor` (by identity) sits in the batch, or None."""
    for key, value in batch.ids.items():
        if value is tensor:
            return ("ids", key)
    for key, (ids_N, offsets_B) in batch.bags.items():
        if ids_N is tensor:
            return ("bags", key)
        if offsets_B is tensor:
            return ("offsets", key)
    for key, value in batch.values.items():
        if value is tensor:
            return ("values", key)
    return None


def _tensors(batch: Batch, plans: list[InputDist]) -> list[torch.Tensor]:
    out = [*batch.ids.values(), *batch.values.values()]
    out += [t for pair in batch.bags.values() for t in pair]
    for plan in plans:
        out += plan.tensors()
    return out


def get_field(batch: Batch, ref: FieldRef) -> torch.Tensor:
    kind, key = ref
    if kind == "ids":
        return batch.ids[key]
    if kind == "bags":
        return batch.bags[key][0]
    if kind == "offsets":
        return batch.bags[key][1]
    return batch.values[key]


class InputPipeline:
    """Batches for the training loop, made (and input-dist'ed) one step ahead when enabled.

    Every rank must construct it (it creates a process group) and call `take` for the
    same steps in the same order.
    """

    def __init__(self, task: Task, embedding: ShardedEmbedding, *, rank: int, world_size: int,
                 device: torch.device, backend: str, end_step: int, enabled: bool) -> None:
        self.task, self.embedding = task, embedding
        self.rank, self.world_size, self.device = rank, world_size, device
        self.end_step = end_step
        self.enabled = enabled
        self.group: dist.ProcessGroup | None = None
        if enabled and world_size > 1:
            self.group = dist.new_group(backend=backend)  # collective: every rank, same order
        self.plan: LookupPlan | None = None  # None until learned; [] = nothing to pre-dist
        # the first lookup of dynamic tables in the plan: its names and id fields
        self.prefetch_plan: tuple[tuple[str, ...], tuple[FieldRef, ...]] | None = None
        if enabled and embedding.dynamic is not None:
            embedding.dynamic.expect_prefetch()  # the same pin rule from the first step
        self.dist_ahead = False  # the plan covers every lookup: input dist runs ahead
        self._worker: _DaemonWorker | None = None
        self._pending: dict[int, concurrent.futures.Future[Prepared]] = {}
        self._side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # seconds spent on the thread making batches / input dists, and seconds the training
        # thread waited for them (what the overlap did not hide)
        self.overlapped = {"data": 0.0, "input_dist": 0.0, "waited": 0.0}
        self.unused_plans = 0
        self._current: Batch | None = None  # the batch whose lookups are being recorded

    # -- training thread --------------------------------------------------------------
    def take(self, step: int) -> Batch:
        """The batch of `step`, its input dists staged on the embedding; submits step+1."""
        future = self._pending.pop(step, None)
        if future is not None:
            t0 = time.perf_counter()
            prepared = future.result()  # re-raises the pipeline thread's error
            self.overlapped["waited"] += time.perf_counter() - t0
            self.overlapped["data"] += prepared.data_s
            self.overlapped["input_dist"] += prepared.dist_s
            batch = prepared.batch
            if self._side_stream is not None:  # made on the side stream, used on this one
                current = torch.cuda.current_stream(self.device)
                current.wait_stream(self._side_stream)
                for tensor in _tensors(batch, prepared.plans):
                    tensor.record_stream(current)  # not reused before this stream is done
            self.embedding.stage(prepared.plans)
        else:
            batch = self.task.batch(step, self.rank, self.world_size).to(self.device)
            if self.enabled and self.plan is None:
                self.embedding.record_lookups()  # learn the lookups on this step
        if self.embedding.recording is not None:
            self._current = batch
        if self.plan is not None:
            self._submit(step + 1)
        return batch

    def after_forward(self, step: int, prefetch: bool = True) -> None:
        """After the step's last lookup: the next step's ids of dynamic tables go to the
        embedding to be translated while this step finishes (module doc); `prefetch`
        False (a checkpoint follows this step): the next step translates at its lookup."""
        future = self._pending.get(step + 1)
        if self.prefetch_plan is None or future is None or not prefetch:
            return
        t0 = time.perf_counter()
        prepared = future.result()  # re-raises the pipeline thread's error
        self.overlapped["waited"] += time.perf_counter() - t0
        self.embedding.prefetch(step + 1, self.prefetch_plan[0], prepared.dynamic_ids)

    def step_done(self, step: int) -> None:
        """After the step's backward: drop unused staged dists; learn the plan once."""
        self.unused_plans += self.embedding.unstage()
        recording = self.embedding.take_recording()
        if recording is None:
            return
        assert self._current is not None  # set by take() whenever recording started
        self.plan = []
        for names, ids, bags in recording:
            refs = [find_field(self._current, t) for t in ids]
            bag_refs = [None if b is None else (find_field(self._current, b[0]), b[1])
                        for b in bags]
            if any(r is None for r in refs) or any(b is not None and b[0] is None
                                                  for b in bag_refs):
                self.plan = []  # a derived id tensor: make batches ahead, dist in the step
                log.info(kv("pipeline", rank=self.rank, input_dist="in-step",
                            reason=f"lookup of {','.join(names)} takes ids or bag offsets "
                                   "that are not batch fields"))
                break
            self.plan.append((names, tuple(r for r in refs if r is not None),
                              tuple(None if b is None or b[0] is None else (b[0], b[1])
                                    for b in bag_refs)))
        dynamic = [(names, refs) for names, refs, _ in self.plan
                   if any(self._is_dynamic(n) for n in names)]
        self.prefetch_plan = dynamic[0] if dynamic else None
        self.dist_ahead = len(dynamic) < len(self.plan)  # a lookup of static tables only
        self._current = None
        self._submit(step + 1)

    def describe(self) -> dict[str, Any]:
        """For --results: what ran ahead, per planned step."""
        dynamic = self.embedding.dynamic
        return {"enabled": self.enabled, "input_dist_ahead": self.dist_ahead,
                "unused_plans": self.unused_plans,
                "prefetched_lookups": 0 if dynamic is None else dynamic.prefetched.taken,
                "overlapped_s_per_step": {k: v / max(self.end_step, 1)
                                          for k, v in self.overlapped.items()}}

    def close(self, wait: bool = True) -> None:
        """Stop the thread. wait: first finish what is in flight (the same on every rank:
        the end of training). Not after an error: another rank may never join the
        collective in flight, and the daemon thread must not keep this process alive."""
        for future in self._pending.values():
            if wait:
                with contextlib.suppress(Exception):  # its error was raised, or will be
                    future.result()
            else:
                future.cancel()
        self._pending.clear()
        if self._worker is not None:
            self._worker.stop(join=wait)
            self._worker = None

    def _is_dynamic(self, name: str) -> bool:
        return self.embedding.tables[name].dynamic is not None

    # -- pipeline thread --------------------------------------------------------------
    def _submit(self, step: int) -> None:
        if step >= self.end_step or step in self._pending:
            return
        if self._worker is None:
            self._worker = _DaemonWorker()
        self._pending[step] = self._worker.submit(self._prepare, step)

    def _prepare(self, step: int) -> Prepared:
        t0 = time.perf_counter()
        if self._side_stream is not None:  # H2D copy and input dist off the compute stream
            with torch.cuda.stream(self._side_stream):
                return self._prepare_on_stream(step, t0)
        return self._prepare_on_stream(step, t0)

    def _prepare_on_stream(self, step: int, t0: float) -> Prepared:
        host = self.task.batch(step, self.rank, self.world_size)
        dynamic_ids = ([] if self.prefetch_plan is None else
                       [get_field(host, r).cpu() for r in self.prefetch_plan[1]])
        batch = host.to(self.device)
        t1 = time.perf_counter()
        plans = []
        if self.dist_ahead and self.plan:
            with torch.no_grad():
                for names, refs, bag_refs in self.plan:
                    if any(self._is_dynamic(n) for n in names):
                        continue  # its input dist needs the slots: in the step
                    ids = [get_field(batch, r) for r in refs]
                    bags = [None if b is None else (get_field(batch, b[0]), b[1])
                            for b in bag_refs]
                    plans.append(self.embedding.input_dist(names, ids, group=self.group,
                                                           timed=False, bags=bags))
        return Prepared(step, batch, plans, dynamic_ids, t1 - t0, time.perf_counter() - t1)


class _DaemonWorker:
    """One daemon thread running submitted calls in order. Not a ThreadPoolExecutor: its
    thread is joined at interpreter exit, so a rank failing while the thread waits in a
    collective its peers never join would hang instead of exiting."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[concurrent.futures.Future[Any],
                                             Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue())
        self._thread = threading.Thread(target=self._run, name="hybridps-input", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._queue.put((future, fn, args))
        return future

    def stop(self, join: bool) -> None:
        self._queue.put(None)
        if join:
            self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the training thread by future.result()
                future.set_exception(exc)
