"""Task registry: `--task NAME` or `--task module.path:ClassName`.

A task is a subclass of worker.tasks.base.Task constructed from the run's
TrainConfig. Register a new one by adding its "module:Class" to TASKS (or
pass the dotted path directly, no registration needed).

The room: the Task interface, the registry, the built-in tasks (tasks/ctr/, tasks/kge/) and
their metrics. May import: config, runtime, embedding, dense.
"""

from __future__ import annotations

import importlib

from hybridps.cli import ConfigError
from worker.config.train_config import TrainConfig
from worker.tasks.base import Batch, HybridModel, TableConfig, Task

__all__ = ["TASKS", "Batch", "HybridModel", "Task", "build_task", "task_class", "task_tables"]

TASKS: dict[str, str] = {
    "synthetic": "worker.tasks.synthetic:SyntheticTask",
    "kge": "worker.tasks.kge.task:KGETask",
    "kge_planted": "worker.tasks.kge.synth:PlantedKGETask",
    "dlrm": "worker.tasks.ctr.dlrm:DLRMTask",
    "tables": "worker.tasks.tables:TablesTask",
    "files": "worker.data.task:FilesTask",  # worker/data/ (a later room: named, not imported)
}


def task_class(name: str) -> type[Task]:
    """Resolve a registered name or a module.path:ClassName to a Task subclass."""
    target = TASKS.get(name, name)
    if ":" not in target:
        raise ValueError(f"task={name!r} is not one of {sorted(TASKS)} nor module.path:ClassName")
    module_name, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"task={name!r}: cannot load {target!r} ({exc})") from None
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ValueError(f"task={name!r}: {target!r} is not a worker.tasks.base.Task subclass")
    return cls


def build_task(cfg: TrainConfig) -> Task:
    """The task of --task; a bad TableConfig or DynamicSpec its constructor builds is a
    ConfigError naming the task (the worker reports it as one line)."""
    cls = task_class(cfg.run.task)
    try:
        return cls(cfg)
    except ConfigError as exc:
        raise ConfigError(f"task {cfg.run.task!r}: {exc}") from None


def task_tables(task: Task) -> list[TableConfig]:
    """task.tables(); a bad TableConfig or DynamicSpec in them is a ConfigError naming the
    task (the worker reports it as one line, not a traceback)."""
    try:
        return task.tables()
    except ConfigError as exc:
        raise ConfigError(f"task {task.name!r}: tables(): {exc}") from None
