"""--time-budget MINUTES: training ends in time to evaluate (the best model) and write the
results, whatever the task.

The budget counts from the launch (torchrun's start, or the worker process's without it;
Linux: /proc; elsewhere from the trainer's creation) to the results written. What the end
needs is estimated from this run's own measurements:
- a training step: the mean wall time of the steps run so far, evaluations during training
  included (they recur at the same rate);
- the final evaluation: the mean time of the evaluations during training, scaled by the
  task's cost of a final over a quick one (Task.eval_cost_in_steps: KGE ranks valid + test,
  not valid alone); before any was timed, the task's cost in training steps times the
  measured step time;
- with hooks (KGE's best model), one more quick evaluation at the step training stops at, so
  the best model is chosen among every step's;
- --dump-state at DUMP_BYTES_PER_S, and a margin for the summary, the results and plot
  files and the processes' exit (11 s after the results for a 2-rank run on a loaded
  2-core machine).
The estimate is scaled by SAFETY.

Agreement. At the steps where (step + 1) % --log-every == 0 (where the loss is all-reduced
anyway) each rank computes how many more steps fit, and the ranks all-reduce the minimum:
every rank then stops after the same step, with no collective in between (a rank cannot
stop alone: the others would wait in the next all_to_all).
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybridps.logs import kv

if TYPE_CHECKING:
    from torch import nn

    from worker.config.train_config import OutputConfig, RunConfig
    from worker.runtime.dist import DistContext
    from worker.tasks.base import Task

log = logging.getLogger("worker.train")

SAFETY = 1.25
MARGIN_S = 10.0           # summary, results.json, the plot, the server's stats, the exit
MARGIN_FRACTION = 0.05    # ... and 5% of the budget
DUMP_BYTES_PER_S = 100e6  # gather + torch.save of --dump-state, a conservative rate


def process_age_s(pid: int | str = "self") -> float | None:
    """Seconds since a process started (Linux), None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return max(0.0, uptime - started)


def run_age_s() -> float | None:
    """Seconds since the run was launched: under torchrun (TORCHELASTIC_RUN_ID set) its
    agent, this process's parent, started first; else this process."""
    own = process_age_s()
    if own is None or not os.environ.get("TORCHELASTIC_RUN_ID"):
        return own
    launcher = process_age_s(os.getppid())
    return own if launcher is None else max(own, launcher)


@dataclass
class EndCosts:
    """What the end of the run needs, in the task's terms (Task.eval_cost_in_steps)."""

    final_eval_steps: float      # the final evaluation, in training steps
    quick_eval_steps: float      # one evaluation during training, in training steps
    pre_final_eval: bool         # one more quick evaluation at the stop (a task with hooks)
    dump_bytes: int = 0          # --dump-state's size (0: none)


class TimeBudget:
    """Decides, identically on every rank, after which step training stops (module doc)."""

    def __init__(self, minutes: float, costs: EndCosts, *, every: int,
                 started_at: float | None = None) -> None:
        self.budget_s = minutes * 60.0
        self.costs, self.every = costs, max(every, 1)
        age = run_age_s()
        now = time.perf_counter()
        self.started_at = started_at if started_at is not None else (
            now - age if age is not None else now)
        self.deadline = self.started_at + self.budget_s
        self.stop_at: int | None = None   # the agreed last step, once decided
        self.stopped_at: int | None = None
        self.reserve_s = 0.0
        self._train_start = now
        self._first_step = 0

    def start(self, first_step: int) -> None:
        self._train_start = time.perf_counter()
        self._first_step = first_step

    def end_estimate_s(self, step_s: float, eval_s: float, evals: int) -> float:
        """Seconds the end needs (the pre-final and final evaluations, dump, files)."""
        c = self.costs
        if evals > 0 and c.quick_eval_steps > 0:
            quick = eval_s / evals
            final = quick * c.final_eval_steps / c.quick_eval_steps
        else:
            quick, final = c.quick_eval_steps * step_s, c.final_eval_steps * step_s
        needed = final + (quick if c.pre_final_eval else 0.0) + c.dump_bytes / DUMP_BYTES_PER_S
        return SAFETY * needed + MARGIN_S + MARGIN_FRACTION * self.budget_s

    def should_stop(self, step: int, eval_s: float, evals: int, ctx: DistContext) -> bool:
        """After `step`: stop training here? A collective at the agreement steps."""
        if self.stop_at is not None:
            return self._stopping(step) if step >= self.stop_at else False
        if (step + 1) % self.every:
            return False
        now = time.perf_counter()
        done = step + 1 - self._first_step
        step_s = (now - self._train_start) / max(done, 1)
        self.reserve_s = self.end_estimate_s(step_s, eval_s, evals)
        left = self.deadline - now - self.reserve_s
        fit = math.floor(left / step_s) if step_s > 0 else self.every
        fit = _all_reduce_min(max(fit, 0), ctx)
        if fit >= self.every:
            return False
        self.stop_at = step + fit
        return self._stopping(step) if fit == 0 else False

    def _stopping(self, step: int) -> bool:
        self.stopped_at = step
        if int(os.environ.get("RANK", "0") or 0) == 0:
            log.warning(kv("time_budget", step=step, minutes=f"{self.budget_s / 60:g}",
                           elapsed_s=f"{time.perf_counter() - self.started_at:.1f}",
                           reserved_s=f"{self.reserve_s:.1f}",
                           action="training stops: final evaluation and results next"))
        return True

    def describe(self) -> dict[str, object]:
        return {"minutes": self.budget_s / 60.0, "stopped_at_step": self.stopped_at,
                "reserved_s": self.reserve_s,
                "elapsed_s": time.perf_counter() - self.started_at}


def budget_for_run(run: RunConfig, output: OutputConfig, task: Task, model: nn.Module,
                   has_hooks: bool, world_size: int) -> TimeBudget:
    """--time-budget of a run: what its end costs, in the task's terms."""
    dump = 0
    if output.dump_state:
        dump = sum(t.num_rows * t.dim * 4 for t in task.tables())
        dump += sum(p.numel() * p.element_size() for p in model.parameters())
    costs = EndCosts(final_eval_steps=task.eval_cost_in_steps(world_size, quick=False),
                     quick_eval_steps=task.eval_cost_in_steps(world_size, quick=True),
                     pre_final_eval=has_hooks, dump_bytes=dump)
    return TimeBudget(run.time_budget, costs, every=output.log_every)


def _all_reduce_min(value: int, ctx: DistContext) -> int:
    if ctx.world_size == 1:
        return value
    import torch
    import torch.distributed as dist

    box = torch.tensor([float(value)], device=ctx.device)
    dist.all_reduce(box, op=dist.ReduceOp.MIN)
    return int(box.item())
