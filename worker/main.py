"""hybridps worker entry point.

    hybridps-run --standalone --nproc_per_node 2 worker/main.py --ps 127.0.0.1:50051
    torchrun --standalone --nproc_per_node 2 worker/main.py --local-optimizer  # works too
    python -m worker.main --local-optimizer --steps 50     # a world of one
    python worker/main.py --plan --num-rows 1000000000 --dim 128   # sizing only

Every flag is also the env var HYBRIDPS_<FLAG> (see `--help`, docs/flags.md). Flags are
parsed and validated before torch is imported, so a bad flag fails fast with
one line naming the value (exit code 2). Before any table is allocated the
memory plan (worker/plan.py) is checked: a config that cannot fit is refused
with the numbers (exit 1); `--plan` prints the plan and exits.

Before torch is set up, the data directory and the shard server are checked too
(worker/config/preflight.py): a bad --data-dir or a server that does not answer is one line.
A known error is printed by rank 0 only (every rank records it for torchrun's report, and
`hybridps-run` prints it last: worker/launch.py). A rank that a launcher started ends within
seconds of the launcher's death, even a `kill -9` (worker/runtime/launcher_watch.py).

Exit codes: 0 trained to the end (or resumed at the run's last step: nothing to
do); 1 error (the server, a plan that cannot fit); 2 bad flags or data, or no intact
checkpoint to resume as asked; 143 stopped by SIGTERM/SIGINT after finishing the step,
flushing and telling the server (worker/runtime/lifecycle.py).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if not __package__:  # `torchrun worker/main.py` / `python worker/main.py` from the tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridps.cli import parse_config
from hybridps.logs import kv, setup_logging
from worker.config.task_defaults import TASK_DEFAULTS, task_defaults
from worker.config.train_config import TrainConfig
from worker.launch import flag_errors, note_start, note_stop, report_error
from worker.runtime.launcher_watch import watch_launcher

if TYPE_CHECKING:
    from worker.plan import Plan

DESCRIPTION = ("hybridps worker: row-wise sharded embeddings (all_to_all), FSDP2 dense part, "
               "sparse optimizer state on the node's shard server")

log = logging.getLogger("worker")


def main(argv: Sequence[str] | None = None) -> int:
    epilog = "task defaults (when the flag is not given):\n" + "\n".join(
        f"  {task}: " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in d.items())
        for task, d in TASK_DEFAULTS.items())
    rank = int(os.environ.get("RANK", "0") or 0)
    watch_launcher()  # end with the launcher, even one killed -9 (worker/runtime/launcher_watch.py)
    note_start()  # a second stop signal to the launcher ends this rank at once
    with flag_errors(rank):  # a bad flag: rank 0 says it, every rank exits 2
        cfg = parse_config(TrainConfig, argv, prog="worker/main.py", description=DESCRIPTION,
                           defaults=task_defaults, epilog=epilog)
    setup_logging(cfg.output.log_level, sys.stderr, rank=rank)
    from worker.runtime.lifecycle import STOP, STOPPED_EXIT_CODE, install_signal_handlers

    install_signal_handlers()  # SIGTERM/SIGINT: finish the step, flush, exit
    early = _check_deployment(cfg, rank)
    if early is not None:
        return early

    # Heavy imports (torch, grpc) only once the flags are known to be good.
    from hybridps.cli import ConfigError
    from worker.checkpoint.resume import ResumeError
    from worker.dense.parallel import DenseParallelError
    from worker.runtime.dist import destroy_distributed, init_distributed
    from worker.sync.client import SyncError
    from worker.train.trainer import Trainer

    trainer: Trainer | None = None
    ended = False
    try:
        ctx = init_distributed(cfg.run.device, timeout_s=max(600.0, 4 * cfg.sync.ps_timeout))
        trainer = Trainer(cfg, ctx)  # task, sharded tables, FSDP dense, server connection
        if trainer.start_step >= trainer.steps:  # resumed at (or past) the last step
            trainer.train()  # no step: applies the checkpoint's pending updates, Flush
            if cfg.output.dump_state:
                trainer.dump_state(cfg.output.dump_state)
            if rank == 0:
                print(f"hybridps worker: the checkpoint resumed is of step "
                      f"{trainer.start_step - 1}, the run's last step is {trainer.steps - 1}: "
                      "nothing to do", flush=True)
            ended = True
            trainer.source.end_run(trainer.steps - 1)  # Finish: the server may stop
            return 0
        trainer.train()              # the loop; ends with every update applied
        if STOP.requested and trainer.last_step < trainer.steps - 1:
            ended = True  # told the server (or tried: end_run logs a failure; no second try)
            trainer.source.end_run(trainer.last_step, aborted=True, reason=STOP.reason)
            flushed = trainer.source.buffer.fatal is None
            log.warning(kv("stopped", step=trainer.last_step, reason=STOP.reason,
                           flushed=flushed, exit_code=STOPPED_EXIT_CODE))
            note_stop(trainer.last_step, trainer.steps, flushed, STOP.reason)
            return STOPPED_EXIT_CODE
        trainer.report()             # eval, --dump-state, summary, shard stats, --results
        ended = True
        trainer.source.end_run(trainer.last_step)  # Finish: the server may now stop
        return 0
    except (SyncError, DenseParallelError) as exc:  # server trouble or a dense setup this
        # world cannot run: one clear line, torchrun stops the other ranks
        report_error(f"hybridps worker: error: {exc}")
        return 1
    except (ResumeError, ConfigError) as exc:  # no checkpoint as asked; a bad run id
        report_error(f"hybridps worker: error: {exc}")
        return 2
    finally:
        if trainer is not None:
            if not ended:  # failing: tell the server, so --exit-after-run can end
                trainer.source.end_run(getattr(trainer, "last_step", -1), aborted=True,
                                       reason=STOP.reason or "error")
            trainer.close()  # sync thread and channel
        destroy_distributed()


def _check_deployment(cfg: TrainConfig, rank: int) -> int | None:
    """Server address, TLS/token files, the data, the memory plan and the server's health,
    before torch is set up and anything is allocated (worker/config/preflight.py).

    Returns the exit code when the worker must stop here (--plan, or a problem)."""
    from hybridps.cli import ConfigError
    from hybridps.security import SecurityError
    from worker.config.preflight import connect_window_s, data_problem, server_problem
    from worker.plan import PlanError, format_plan, plan_for_config

    # --plan needs no server
    server = cfg.sync.update_kind.needs_server and not cfg.sizing.plan
    try:
        if server:
            address = cfg.sync.ps_address
            security = cfg.security.client_security()
            log.info(kv("start", ps=address, connection=security.describe(),
                        world_size=os.environ.get("WORLD_SIZE", "1"),
                        local_world_size=os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except (ValueError, SecurityError) as exc:
        report_error(f"hybridps worker: error: {exc}")
        return 2
    problem = data_problem(cfg)
    if problem is not None:
        report_error(f"hybridps worker: error: {problem}")
        return 2
    try:
        plan: Plan | None = plan_for_config(cfg) if cfg.sizing.plan else _cheap_plan(cfg)
    except (PlanError, ConfigError) as exc:  # ConfigError: a task's bad TableConfig
        report_error(f"hybridps worker: error: {exc}")
        return 2
    if cfg.sizing.plan and plan is not None:
        if rank == 0:
            print(format_plan(plan), flush=True)
        return 0 if plan.fits else 1
    if plan is not None and not plan.fits:
        if rank == 0:
            print(format_plan(plan), file=sys.stderr, flush=True)
        report_error("hybridps worker: error: this config cannot fit; nothing was allocated "
                     "(the plan above)")
        return 1
    if server:
        problem = server_problem(address, security, connect_window_s(cfg.sync.ps_timeout))
        if problem is not None:
            report_error(f"hybridps worker: error: rank {rank}: {problem}")
            return 1
    return None


def _cheap_plan(cfg: TrainConfig) -> Plan | None:
    """The plan when the task can give its tables without loading data, else None."""
    from worker.plan import plan_for_config
    from worker.tasks import task_class

    if getattr(task_class(cfg.run.task), "plan_tables", None) is None:
        return None
    return plan_for_config(cfg)


if __name__ == "__main__":
    from worker.runtime.lifecycle import exit_process

    exit_process(main())  # no interpreter teardown of torch's C++ state (see there)
