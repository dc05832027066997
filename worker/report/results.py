"""A run's results: the dict --results writes (results.json), the end-of-run summary printed
from it, and the node's shard server stats. worker/train/trainer.py hands over the parts of
the run; each part describes itself where it can, and this module lays the record out.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from worker.report.console import checkpoint_lines, optimizer_line, run_extent, wrap_summary

if TYPE_CHECKING:
    from hybridps.security import ClientSecurity
    from worker.config.train_config import SyncConfig, TrainConfig
    from worker.dense.parallel import DenseParallel
    from worker.embedding.sharded import ShardedEmbedding
    from worker.runtime.dist import DistContext
    from worker.tasks.base import Task, TrainHooks
    from worker.updates.source import StalenessWindow, UpdateSource


@dataclass
class RunRecord:
    """What the training loop measured (rank 0's clock; the Trainer fills it in)."""

    steps: int       # planned
    start_step: int  # the first step run (after a resume: the checkpoint's step + 1)
    times: dict[str, float]  # seconds per phase of a step, summed over the steps run
    last_step: int = -1      # the last step pushed
    loss_curve: list[tuple[int, float]] = field(default_factory=list)
    eval_curve: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    setup_s: float = 0.0
    train_s: float = 0.0
    train_cpu_s: float = 0.0  # rank 0's process, all its threads
    # wall clock: lets a benchmark cut another process's CPU (the server's) to the loop
    train_span: list[float] = field(default_factory=lambda: [0.0, 0.0])
    final_eval_s: float = 0.0


class CheckpointLog(Protocol):
    """What results.json reports of the checkpoints (worker/checkpoint/checkpointer.py)."""

    save_s: list[float]
    stall_s: list[float]
    behind_s: list[float]
    restore_s: float
    resumed_step: int
    written: list[dict[str, Any]]

    @property
    def snapshot_bytes(self) -> int: ...


@dataclass(frozen=True)
class RunParts:
    """The parts of a run whose state results.json reports."""

    task: Task
    mode: str  # the update source's kind (worker/config/update_kinds.py)
    hooks: TrainHooks | None
    budget: Any  # worker/train/time_budget.py's TimeBudget, or None
    window: StalenessWindow
    source: UpdateSource
    dense: DenseParallel
    embedding: ShardedEmbedding
    checkpoints: CheckpointLog
    pipeline: dict[str, Any]  # worker/train/pipeline.py's InputPipeline.describe()


def run_results(cfg: TrainConfig, ctx: DistContext, run_id: str, run: RunRecord,
                parts: RunParts, eval_metrics: dict[str, float],
                server: dict[str, Any] | None, wall_s: float) -> dict[str, Any]:
    """results.json: the config, what ran, how fast, and each part's own report."""
    ran = run.last_step + 1 - run.start_step  # fewer than planned after an early stop
    per_step = {k: v / max(ran, 1) for k, v in run.times.items()}
    samples = ran * cfg.run.batch_size * ctx.world_size
    window, optim, ck = parts.window, cfg.optim, parts.checkpoints
    return {
        "config": cfg.flat(),  # by setting (= flag) name
        "task": parts.task.describe(),
        "run_id": run_id,
        "world_size": ctx.world_size,
        "device": str(ctx.device),
        "backend": ctx.backend,
        "mode": parts.mode,
        "optimizer": {"rows": {"kind": optim.optimizer, "lr": optim.lr,
                               "weight_decay": optim.weight_decay},
                      "dense": {"kind": optim.dense_kind, "lr": optim.dense_lr,
                                "weight_decay": optim.weight_decay}},
        "steps": run.steps,
        "samples": samples,
        "first_loss": run.loss_curve[0][1] if run.loss_curve else None,
        "final_loss": run.loss_curve[-1][1] if run.loss_curve else None,
        "loss_curve": [[s, v] for s, v in run.loss_curve],
        "eval_curve": [[s, m] for s, m in run.eval_curve],
        "last_step": run.last_step,
        "eval_time_s": run.times["eval"],
        "final_eval_time_s": run.final_eval_s,
        "eval_fraction": run.times["eval"] / run.train_s if run.train_s else 0.0,
        "hooks": parts.hooks.describe() if parts.hooks is not None else None,
        "time_budget": parts.budget.describe() if parts.budget is not None else None,
        "eval": eval_metrics,
        "samples_per_s": samples / run.train_s if run.train_s else 0.0,
        "wall_time_s": wall_s,
        "setup_time_s": run.setup_s,
        "train_time_s": run.train_s,
        "train_cpu_s": run.train_cpu_s,
        "train_span_unix_s": run.train_span,
        "staleness": {"k": cfg.sync.staleness, **window.stats.as_dict(),
                      "compensation": ({"method": "none"} if window.predictor is None
                                       else window.predictor.describe())},
        "step_time_s": per_step,
        "sync": dataclasses.asdict(parts.source.stats),
        "server_stats": server,
        "dense": parts.dense.describe(),
        "embedding": parts.embedding.describe(),
        "owner_pool": parts.embedding.owner_pool(),
        "table_groups": parts.embedding.groups(),
        "checkpoint": {"save_s": ck.save_s, "stall_s": ck.stall_s, "behind_s": ck.behind_s,
                       "snapshot_bytes": ck.snapshot_bytes, "restore_s": ck.restore_s,
                       "resumed_step": ck.resumed_step, "written": ck.written},
        "pipeline": parts.pipeline,
    }


def shard_stats(sync: SyncConfig, run_id: str, security: ClientSecurity | None,
                width: int | None = None) -> tuple[dict[str, Any] | None, str]:
    """This node's shard server stats for the run, and the table fitted to `width` columns
    (None: its default, 100)."""
    from hybridps.admin import DEFAULT_WIDTH, format_shard_stats, get_shard_stats, message_dict

    try:
        stats = get_shard_stats(sync.ps_address, timeout=sync.ps_timeout, run_id=run_id,
                                security=security)
    except Exception as exc:  # stats are a report, not a reason to fail the run
        return None, f"(shard stats unavailable: {exc})"
    return message_dict(stats), format_shard_stats(stats, width=width or DEFAULT_WIDTH)


def summary(res: dict[str, Any], task_name: str, width: int | None = None) -> str:
    """The end-of-run summary of results `res`, its lines cut between fields to fit `width`
    columns (None: one line per item)."""
    st = res["staleness"]
    ev = res["eval"]
    parts = [
        f"hybridps worker: task={task_name} mode={res['mode']} world={res['world_size']}"
        f" device={res['device']} run_id={res['run_id']}",
        f"{run_extent(res)}  loss {_num(res['first_loss']):.4f} -> "
        f"{_num(res['final_loss']):.4f}"
        f"  samples/s {res['samples_per_s']:.0f}  train {res['train_time_s']:.1f}s"
        f"  wall {res['wall_time_s']:.1f}s",
        optimizer_line(res),
        f"staleness K={st['k']}: applied mean {st['applied_mean']:.2f} max "
        f"{st['applied_max']}; arrival lag mean {st['arrival_lag_mean']:.2f} max "
        f"{st['arrival_lag_max']}; waited {st['waits']} steps ({st['wait_s']:.2f}s)",
        "step time (ms, rank 0): " + "  ".join(
            f"{k} {v * 1000:.1f}" for k, v in res["step_time_s"].items()),
    ]
    if res["eval_curve"]:
        parts.append(f"evaluations during training: {len(res['eval_curve'])}, "
                     f"{res['eval_time_s']:.1f}s ({100 * res['eval_fraction']:.1f}% of "
                     "the training time)")
    if res["hooks"]:
        parts.append("schedule: " + "  ".join(f"{k} {v}" for k, v in res["hooks"].items()))
    budget = res["time_budget"]
    if budget and budget["stopped_at_step"] is not None:
        stopped = int(budget["stopped_at_step"])
        parts.append(f"time budget {budget['minutes']:g} min: training stopped after step "
                     f"{stopped} ({stopped + 1} of {res['steps']} steps), "
                     f"{budget['reserved_s']:.0f}s kept for the final evaluation and "
                     "the results")
    if ev:
        parts.append("eval: " + "  ".join(f"{k} {v:.4f}" for k, v in ev.items()))
    if "dense" in res:  # --dense-parallel and friends (worker/dense/parallel.py)
        parts.append("dense: " + "  ".join(
            f"{k} {v}" for k, v in res["dense"].items() if v is not None))
    sync = res["sync"]
    if res["mode"] == "server":
        parts.append(f"sync: pushes {sync['pushes']} ({sync['push_bytes'] / 2**20:.1f} MiB,"
                     f" {sync['push_chunks']} chunks)  updates {sync['updates']}  "
                     f"reconnects {sync['reconnects']}  duplicates {sync['duplicates']}")
    parts += checkpoint_lines(res["checkpoint"]["written"])
    return wrap_summary(parts, width)


def write_results(res: dict[str, Any], path: str, task: Task) -> list[str]:
    """--results: `res` as JSON at `path`, its loss-curve plot and the task's artifacts
    beside it; returns the files written."""
    from worker.config.output_paths import plot_path
    from worker.report.plot import save_loss_curve

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(res, indent=2) + "\n")
    return [path, save_loss_curve(res, plot_path(path)), *task.save_artifacts(path)]


def _num(value: float | None) -> float:
    """None (no step ran: e.g. resumed from the final checkpoint) prints as nan."""
    return float("nan") if value is None else value
