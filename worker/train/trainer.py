"""The training loop, written out: one step is

    apply due updates (staleness window)  ->  batch  ->  forward  ->  backward
    ->  dense optimizer step  ->  coalesced embedding grads * 1/W  ->  push

The loop is the same for every task, for the server path and for
--local-optimizer. Rank 0 shows a progress bar (log lines go around it:
worker/report/console.py), prints a summary and the server's shard stats, writes
--results and its plot (worker/report/results.py), and with --tensorboard the scalars
(worker/report/tensorboard.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from tqdm import tqdm

from hybridps.cli import ConfigError
from hybridps.logs import kv
from hybridps.names import describe_problem
from worker.checkpoint.checkpointer import Checkpointer
from worker.checkpoint.run_claim import claim_run
from worker.checkpoint.run_parts import run_parts
from worker.config.train_config import OptimConfig, RunConfig, SyncConfig, TrainConfig
from worker.dense.optimizer import make_dense_optimizer, sparse_optimizer_spec
from worker.dense.parallel import build_dense_parallel, check_dense_parallel, dense_facts
from worker.embedding import comm
from worker.embedding.dynamic.ids import RowPager, check_dynamic_tables
from worker.embedding.sharded import ROW_DTYPES, ShardedEmbedding
from worker.report.console import (
    bar_layout,
    bar_postfix,
    end_bar,
    route_logs_around,
    show_progress,
    summary_width,
    wrap_summary,
)
from worker.report.results import (
    RunParts,
    RunRecord,
    run_results,
    shard_stats,
    summary,
    write_results,
)
from worker.report.tensorboard import TensorBoardLog
from worker.runtime import faults
from worker.runtime.device_copy import sync_point
from worker.runtime.dist import DistContext
from worker.runtime.lifecycle import STOP, stop_agreed
from worker.sync.arena import arena_bytes_for_run
from worker.sync.client import WIRE_DTYPES
from worker.sync.update_sources import build_update_source
from worker.tasks import build_task, task_tables
from worker.tasks.base import HybridModel, Task, TrainHooks, build_dense_seeded
from worker.train.pipeline import InputPipeline
from worker.train.time_budget import budget_for_run
from worker.updates.source import StalenessWindow, UpdateSource
from worker.updates.staleness import RowPredictor

log = logging.getLogger("worker.train")

TIME_KEYS = ("apply", "data", "forward", "a2a", "backward", "optimizer", "push", "log",
             "eval")


def scheduled_lr(hooks: TrainHooks | None, step: int, optim: OptimConfig,
                 dense_opt: torch.optim.Optimizer) -> float | None:
    """Step `step`'s lr: --dense-lr * scale into the dense optimizer, and --lr * scale for the
    rows' optimizer (sent with the push); None without hooks (the registered lr)."""
    if hooks is None:
        return None
    scale = hooks.lr_scale(step)
    for group in dense_opt.param_groups:
        group["lr"] = optim.dense_lr * scale
    return optim.lr * scale


def num_steps(run: RunConfig, task: Task, world_size: int) -> int:
    if run.epochs == 0:
        return run.steps
    end = task.steps_for_epochs(run.epochs, world_size)
    if end is None:
        raise ValueError(f"epochs={run.epochs}: task {task.name!r} generates its data and "
                         "has no epochs; use --steps")
    return end


def resolve_run_id(sync: SyncConfig, ctx: DistContext) -> str:
    """--run-id, else TORCHELASTIC_RUN_ID, else a fresh id; rank 0's choice wins."""
    run_id = sync.run_id or os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id in ("", "none"):
        run_id = f"run-{uuid.uuid4().hex[:12]}"
    problem = describe_problem("run id", run_id)
    if problem is not None:  # --run-id was checked with the flags; this is torchrun's
        raise ConfigError(f"TORCHELASTIC_RUN_ID: {problem}; pass --run-id")
    box = [run_id]
    if ctx.world_size > 1:
        dist.broadcast_object_list(box, src=0)
    return str(box[0])


class Trainer:
    """Builds the model and the update source from a config; `train()` runs the loop."""

    def __init__(self, cfg: TrainConfig, ctx: DistContext, task: Task | None = None) -> None:
        t0 = self.created_at = time.perf_counter()
        self.cfg, self.ctx = cfg, ctx
        check_dense_parallel(cfg.dense, ctx.world_size, ctx.local_world_size,
                             ctx.device)  # fail early
        faults.check_environment()  # a malformed HYBRIDPS_FAULT_* fails here, not mid-run
        self.task = task or build_task(cfg)
        # what the loop measures, for results.json (worker/report/results.py)
        self.record = RunRecord(num_steps(cfg.run, self.task, ctx.world_size), 0,
                                dict.fromkeys(TIME_KEYS, 0.0))
        self.run_id = resolve_run_id(cfg.sync, ctx)
        tables = task_tables(self.task)  # a bad TableConfig: ConfigError, one line
        check_dynamic_tables(tables, ctx.world_size, cfg.optim.row_dtype)
        self.embedding = ShardedEmbedding(
            tables, rank=ctx.rank, world_size=ctx.world_size, group=ctx.embedding_group,
            device=ctx.device, seed=cfg.run.seed, init_std=cfg.optim.init_std,
            row_dtype=ROW_DTYPES[cfg.optim.row_dtype], pool_at=cfg.run.pool_at,
            group_tables=cfg.run.group_tables, sharding=cfg.run.sharding)
        dense = build_dense_seeded(self.task, cfg.run.seed).to(ctx.device)
        # --dense-parallel auto|fsdp|hsdp|ddp (+ --compile, precision, clipping):
        # worker/dense/parallel.py; auto decides on the dense part's size (policy.py)
        facts = dense_facts(dense, ctx, dense_optimizer=cfg.optim.dense_kind,
                            device_memory_gb=cfg.sizing.device_memory_gb,
                            host_memory_gb=cfg.sizing.host_memory_gb)
        self.dense_parallel = build_dense_parallel(cfg.dense, ctx, dense,
                                                   self.task.fsdp_units(dense),
                                                   plain_at_one_rank=True, facts=facts)
        self.model = HybridModel(self.embedding, self.dense_parallel.module)
        self.dense_opt = make_dense_optimizer(cfg.optim, self.dense_parallel.module.parameters())
        # the task's lr schedule / scheduled evaluation / early stopping (Task.hooks)
        self.hooks = self.task.hooks(self.model, ctx.world_size)
        spec = self.sparse_spec = sparse_optimizer_spec(cfg.optim)
        self.checkpointer = Checkpointer(cfg, ctx, run_id=self.run_id, sparse_spec=spec)
        resume = self.checkpointer.resume_target()  # (directory, step) or None
        sync = cfg.sync
        self.source_kind = sync.update_kind  # "server" or "local" (worker/config/update_kinds.py)
        # The run secret kept with the checkpoints: the job's proof to its servers
        proof = claim_run(str(self.checkpointer.root or ""),
                          None if resume is None else resume[0], ctx.rank, ctx.world_size,
                          claim_resume=self.source_kind.claims_resume)
        node = cfg.node.client_args()
        if self.source_kind.needs_server and node["shm"] != "off":
            # --same-node-mb 0: sized from this run's pushes
            node["shm_bytes"] = arena_bytes_for_run(sync, cfg.node, self.task, self.embedding,
                                                    ctx, WIRE_DTYPES[sync.wire_dtype])
        self.source: UpdateSource = build_update_source(
            self.source_kind, self.embedding, spec, sync, run_id=self.run_id, rank=ctx.rank,
            world_size=ctx.world_size, node=node,
            restore=None if resume is None else (str(resume[0]), resume[1]),
            security=cfg.security.client_security(), run_secret=proof.secret,
            restore_secret=proof.restore_secret,
            checkpoint_dir=str(self.checkpointer.root or ""))
        self.source.start()  # the gRPC channel exists only from here on (no fork after it)
        # dynamic tables page rows out to it (every registered kind is a RowPager:
        # tests/worker/sync/test_update_sources.py)
        self.embedding.set_pager(cast(RowPager, self.source))
        predictor = (RowPredictor(self.embedding, sync.staleness)
                     if sync.staleness_compensation == "predict" and sync.staleness > 0
                     else None)
        self.window = StalenessWindow(self.source, self.embedding, sync.staleness, predictor)
        self.checkpointer.attach(run_parts(
            cfg, rank=ctx.rank, world_size=ctx.world_size, embedding=self.embedding,
            window=self.window, source=self.source, source_kind=self.source_kind,
            sparse_spec=spec, dense=self.model.dense, dense_opt=self.dense_opt,
            scaler=self.dense_parallel.scaler, task=self.task))
        if resume is not None:
            self.checkpointer.restore_local(*resume)
            self.record.start_step = resume[1] + 1
            # --epochs after the task's data position came back (another world size: the
            # rest of the epoch is a remainder of its own length)
            self.record.steps = num_steps(cfg.run, self.task, ctx.world_size)
        # --pipeline: batch t+1 and its ids all_to_all on a second thread during step t
        self.inputs = InputPipeline(self.task, self.embedding, rank=ctx.rank,
                                    world_size=ctx.world_size, device=ctx.device,
                                    backend=ctx.backend, end_step=self.steps,
                                    enabled=cfg.run.pipeline)
        self.record.last_step = self.start_step - 1
        self.evaluations = 0  # during training
        self.console = ExitStack()  # rank 0's log redirect around the progress bar
        self.tb = (TensorBoardLog(cfg.output.tensorboard, self.run_id, dataclasses.asdict(cfg),
                                  self.start_step) if cfg.output.tensorboard and self.is_main
                   else None)
        self.record.setup_s = time.perf_counter() - t0
        self.budget = (budget_for_run(cfg.run, cfg.output, self.task, self.model,
                                      self.hooks is not None, ctx.world_size)
                       if cfg.run.time_budget else None)
        if self.is_main:
            log.info(kv("ready", run=self.run_id, task=self.task.name, steps=self.steps,
                        start_step=self.start_step, world_size=ctx.world_size,
                        setup_s=f"{self.record.setup_s:.1f}"))

    @property
    def is_main(self) -> bool:
        return self.ctx.rank == 0

    # the loop's extent, kept in the record
    @property
    def steps(self) -> int:
        return self.record.steps

    @property
    def start_step(self) -> int:
        return self.record.start_step

    @property
    def last_step(self) -> int:
        """The last step pushed (a Finish reports it)."""
        return self.record.last_step

    # -- the loop -----------------------------------------------------------------------
    def train(self) -> None:
        out, ctx, task, model = self.cfg.output, self.ctx, self.task, self.model
        world, rank = ctx.world_size, ctx.rank
        bar = tqdm(total=self.steps, desc="train", unit="step", mininterval=0.5,
                   disable=not (self.is_main and out.progress), file=sys.stderr, **bar_layout())
        self.console.enter_context(route_logs_around(bar))
        window_loss = torch.zeros((), device=ctx.device)
        window_steps = 0
        record = self.record
        t = record.times
        start, cpu_start = time.perf_counter(), time.process_time()
        record.train_span = [time.time(), 0.0]
        comm.reset_comm_seconds()
        if self.budget is not None:
            self.budget.start(self.start_step)
        for step in range(self.start_step, self.steps):
            t0 = time.perf_counter()
            self.dense_parallel.prefetch()  # --prefetch-dense: all-gather under what follows
            self.window.before_step(step)  # rows now hold every update of steps <= step-1-K
            t1 = time.perf_counter()
            batch = self.inputs.take(step)  # made (and input-dist'ed) ahead with --pipeline
            t2 = time.perf_counter()
            loss = task.loss(model, batch)  # mean over this rank's B samples
            # --pipeline: step+1's dynamic ids translated meanwhile (not into a checkpoint,
            # nor a stop's: the flag as read here decides a stop after this step)
            asked = STOP.requested
            self.inputs.after_forward(step, prefetch=not (
                self.checkpointer.due(step) or (asked and self.checkpointer.on_stop)))
            self.source.poll()  # the last push, if its gradients reached the host by now
            t3 = time.perf_counter()
            self.dense_parallel.backward(loss)  # dense grads: FSDP/DDP average them across ranks
            t4 = time.perf_counter()
            # Dense step (fp16 unscale + inf check, clipping) and the embedding grads to push.
            # Each rank's loss is its local mean, so its gradient is W times the global-mean
            # loss's gradient share: scaled by 1/W (the dense averaging does the same).
            lr = scheduled_lr(self.hooks, step, self.cfg.optim, self.dense_opt)
            grads = self.dense_parallel.step(self.dense_opt, self.embedding)
            self.inputs.step_done(step)
            t5 = time.perf_counter()
            self.source.push(step, grads, lr)  # handed to the sync thread; never blocks
            record.last_step = step
            self.window.pushed(step, grads)
            faults.kill_point(rank, step)  # HYBRIDPS_FAULT_KILL: die with the push in flight
            t6 = time.perf_counter()
            a2a = comm.reset_comm_seconds()
            t["apply"] += t1 - t0
            t["data"] += t2 - t1
            t["forward"] += (t3 - t2) - a2a["forward"]
            t["backward"] += (t4 - t3) - a2a["backward"]
            t["a2a"] += a2a["forward"] + a2a["backward"]
            t["optimizer"] += t5 - t4
            t["push"] += t6 - t5

            window_loss += loss.detach()
            window_steps += 1
            stop = evaluated = False
            reason = "stopped early"  # by the hooks (patience, a collapse)
            if ((out.eval_every and ((step + 1) % out.eval_every == 0 or step + 1 == self.steps))
                    or (self.hooks is not None and self.hooks.eval_due(step))):
                t_eval = time.perf_counter()
                stop, evaluated = self._evaluate_in_training(step), True
                t6 += time.perf_counter() - t_eval
            if (step + 1) % out.log_every == 0 or step + 1 == self.steps:
                mean = self._global_mean(window_loss, window_steps)
                record.loss_curve.append((step, mean))
                if self.hooks is not None:
                    self.hooks.observe_loss(step, mean)
                window_loss.zero_()
                window_steps = 0
                elapsed = time.perf_counter() - start
                st = self.window.stats
                last = record.eval_curve[-1][1] if record.eval_curve else {}
                sps = (step + 1 - self.start_step) * self.cfg.run.batch_size * world / elapsed
                lag = st.lag_sum / max(st.steps, 1)
                if self.is_main:  # the fields that fit the terminal; the rest to the log
                    show_progress(bar, bar_postfix(mean, last, sps,
                                                   self.window.last_applied_staleness, lag,
                                                   st.waits),
                                  step=step, update=(step + 1) // out.log_every)
                if self.tb is not None:
                    self.tb.train(step + 1, mean, sps, {
                        "applied": self.window.last_applied_staleness, "arrival_lag": lag,
                        "waits": st.waits}, t)
                t["log"] += time.perf_counter() - t6
            if (self.budget is not None and not stop and step + 1 < self.steps
                    and self.budget.should_stop(step, t["eval"], self.evaluations, ctx)):
                if self.hooks is not None and not evaluated:  # the best among every step's
                    self._evaluate_in_training(step)
                stop, reason = True, "time budget"
            if self.checkpointer.due(step):
                with sync_point("checkpoint"):
                    self.checkpointer.save(step)
            bar.update(1)
            # SIGTERM: runtime/lifecycle.py
            if stop or stop_agreed(step, out.log_every, ctx, asked):
                record.last_step = step
                if not stop:  # the signal's: every rank checkpoints this step
                    with sync_point("checkpoint"):
                        self.checkpointer.save_on_stop(step)
                if step + 1 < self.steps:
                    end_bar(bar, reason if stop else "stopped", self.steps)
                break
        self.checkpointer.wait()  # a checkpoint written in the background: complete first
        self.inputs.close()  # what is in flight is the same on every rank
        self.window.drain(self.last_step)  # the final rows include every update
        self.source.finish(self.last_step)
        if self.embedding.dynamic is not None and self.source_kind.needs_server:
            self.embedding.dynamic.report_counters()  # the server's stats up to date
        if self.hooks is not None:
            self.hooks.finish()  # e.g. back to the best evaluated model (--keep-best)
        record.train_s = time.perf_counter() - start
        record.train_cpu_s = time.process_time() - cpu_start  # every thread of this process
        record.train_span[1] = time.time()
        bar.close()
        self.console.close()

    def _evaluate_in_training(self, step: int) -> bool:
        """A quick evaluation after `step` (a collective on every rank: same steps); True
        when the hooks stop training on it."""
        t_eval = time.perf_counter()
        self.window.catch_up(step)  # the rows step+1 will see (K=0: all of step's)
        with sync_point("evaluate"):
            metrics = self.evaluate(quick=True)
        self.evaluations += 1
        if metrics:
            self.record.eval_curve.append((step, metrics))
            if self.tb is not None:
                self.tb.eval(step + 1, metrics)
        stop = False
        if self.hooks is not None:  # the same metrics, so the same answer, everywhere
            stop = self.hooks.after_eval(step, metrics)
        self.record.times["eval"] += time.perf_counter() - t_eval
        return stop

    def _global_mean(self, total: torch.Tensor, count: int) -> float:
        with sync_point("log_loss"):
            pair = torch.stack([total.detach().float(),
                                torch.tensor(float(count), device=total.device)])
            if self.ctx.world_size > 1:
                dist.all_reduce(pair)
            return float(pair[0] / pair[1])

    # -- after training -----------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, quick: bool = False) -> dict[str, float]:
        """Held-out metrics, mean over eval batches and ranks (all ranks must call).

        A task with `evaluate_full` (whole-split, collective) is asked first; `quick` is its
        cheap progress-bar subset (the batch-wise path ignores it)."""
        full = self.task.evaluate_full(self.model, self.ctx.rank, self.ctx.world_size,
                                       quick=quick)
        if full is not None:
            return full
        sums: dict[str, torch.Tensor] = {}
        count = 0
        for index in range(self.cfg.output.eval_batches):
            batch = self.task.eval_batch(index, self.ctx.rank, self.ctx.world_size)
            if batch is None:
                break
            for key, value in self.task.evaluate(self.model, batch.to(self.ctx.device)).items():
                sums[key] = sums.get(key, 0) + value.detach().float()
            count += 1
        if not sums:
            return {}
        keys = sorted(sums)
        stacked = torch.stack([sums[k] for k in keys]) / (count * self.ctx.world_size)
        if self.ctx.world_size > 1:
            dist.all_reduce(stacked)
        return {k: float(v) for k, v in zip(keys, stacked.tolist(), strict=True)}

    def dump_state(self, path: str) -> None:
        """Full tables + full dense state_dict to `path` on rank 0 (collective), with the
        step whose model it is: the last step run, or the best evaluated one restored."""
        tables = self.embedding.gather_full(dst=0)
        dense = get_model_state_dict(
            self.model.dense, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.is_main:
            assert tables is not None
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            hooks = self.hooks.describe() if self.hooks is not None else {}
            best = bool(hooks.get("restored_best"))
            step = int(str(hooks["best_step"])) if best else self.last_step
            torch.save({"tables": tables, "dense": dense, "steps": self.steps,
                        "step": step, "best": best,
                        "world_size": self.ctx.world_size, "run_id": self.run_id}, path)

    def report(self) -> dict[str, Any] | None:
        """Evaluate, dump, print the summary + shard stats, write --results (rank 0 returns)."""
        out, ctx = self.cfg.output, self.ctx
        t_eval = time.perf_counter()
        eval_metrics = self.evaluate()
        self.record.final_eval_s = time.perf_counter() - t_eval
        if self.tb is not None:
            self.tb.eval(self.last_step + 1, eval_metrics)
            self.tb.close()
        if out.dump_state:
            self.dump_state(out.dump_state)
        dynamic = ({} if self.embedding.dynamic is None  # a collective
                   else self.embedding.dynamic.gathered_stats())
        if ctx.world_size > 1:
            dist.barrier()  # every rank's pushes are applied before rank 0 reads the stats
        if not self.is_main:
            return None
        width = summary_width()  # the terminal's: lines cut between fields to fit
        server, table = (shard_stats(self.cfg.sync, self.run_id, self.source.server_security(),
                                     width) if self.source_kind.needs_server else (None, ""))
        parts = RunParts(self.task, self.source_kind.mode, self.hooks, self.budget, self.window,
                         self.source, self.dense_parallel, self.embedding, self.checkpointer,
                         self.inputs.describe())
        res = run_results(self.cfg, ctx, self.run_id, self.record, parts, eval_metrics, server,
                          time.perf_counter() - self.created_at)
        if dynamic:
            res["dynamic"] = dynamic
        print(summary(res, self.task.name, width), flush=True)
        if table:
            print("shard server stats (this node):\n" + table, flush=True)
        if out.results:
            files = write_results(res, out.results, self.task)
            print(wrap_summary(["wrote " + "  ".join(files)], width), flush=True)
        return res

    def close(self) -> None:
        self.console.close()  # no-op unless train() failed with the bar on screen
        if self.tb is not None:
            self.tb.close()
        self.inputs.close(wait=False)  # train() already waited, unless it failed
        self.source.close()


def run(cfg: TrainConfig, ctx: DistContext) -> dict[str, Any] | None:
    """Build, train, evaluate, report, close. Returns the results dict on rank 0."""
    trainer = Trainer(cfg, ctx)
    try:
        trainer.train()
        return trainer.report()
    finally:
        trainer.close()
