"""The settings only one task reads: one section per built-in task (torch-free).

A task reads its own section (`cfg.kge.model`) and the run's basics (`cfg.run.dim`,
`cfg.run.batch_size`, `cfg.run.seed`); worker/task_defaults.py gives a task its own
defaults for the general settings (lr, dim, ...).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

from hybridps.cli import check_settings, setting
from hybridps.names import describe_problem

KgeModel = Literal["distmult", "complex", "keci", "qmult"]
KgeTraining = Literal["kvsall", "1vsall", "negsample"]
KGE_MODELS: tuple[str, ...] = get_args(KgeModel)  # worker/tasks/kge_models.py builds them


def parse_table_list(spec: str) -> list[tuple[str, int, int]]:
    """--tables 'NAME:ROWS[:POOL],...' -> [(name, rows, pool)]; ValueError naming the entry."""
    out: list[tuple[str, int, int]] = []
    for entry in spec.replace(" ", "").split(","):
        parts = entry.split(":")
        if (len(parts) not in (2, 3) or not parts[0].isidentifier()
                or not all(p.isdigit() for p in parts[1:])):
            raise ValueError(f"tables={spec!r}: entry {entry!r} is not NAME:ROWS[:POOL]")
        problem = describe_problem("table name", parts[0])  # what the server accepts
        if problem is not None:
            raise ValueError(f"tables={spec!r}: {problem}")
        rows, pool = int(parts[1]), int(parts[2]) if len(parts) == 3 else 1
        if rows < 1 or pool < 1:
            raise ValueError(f"tables={spec!r}: entry {entry!r} needs ROWS >= 1 and POOL >= 1")
        if parts[0] in {name for name, _, _ in out}:
            raise ValueError(f"tables={spec!r}: table {parts[0]!r} appears twice")
        out.append((parts[0], rows, pool))
    return out


@dataclass(frozen=True)
class SyntheticConfig:
    """--task synthetic (the default job; worker/tasks/synthetic.py) and --task tables."""

    num_rows: int = setting(
        1_000_000, "rows of the biggest synthetic table (user); the others scale from it; "
        "--task tables without --tables: the rows of its one table", "R", at_least=1)

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class TablesConfig:
    """--task tables: a configurable list of tables (worker/tasks/tables.py)."""

    tables: str = setting(
        "", "NAME:ROWS[:POOL],... (POOL ids per sample, mean-pooled; default 1); empty: one "
        "table t0 of --num-rows rows", "SPEC")
    zipf_rows: int = setting(
        0, "draw ids from the Zipf law over the first N popularity ranks only (0: over the "
        "whole table), still scattered over the whole table; the rows a step touches are "
        "then the same for any table size (bench_train.py's growth runs)", "N", at_least=0)

    def __post_init__(self) -> None:
        check_settings(self)
        if self.tables:
            parse_table_list(self.tables)


@dataclass(frozen=True)
class DlrmConfig:
    """--task dlrm: DLRM on Criteo TSV or synthetic CTR data (worker/tasks/dlrm.py)."""

    data_path: str = setting(
        "", "Criteo TSV file or directory (empty: the synthetic generator)", "PATH")
    table_rows: str = setting(
        "", "rows per categorical table: one int for all 26, or 26 comma-separated", "R[,R..]")

    def __post_init__(self) -> None:
        if self.table_rows and not re.fullmatch(r"\d+(,\d+)*", self.table_rows.replace(" ", "")):
            raise ValueError(f"table_rows={self.table_rows!r} is not an int or a comma list")


@dataclass(frozen=True)
class KgeConfig:
    """--task kge: link prediction on a knowledge graph (worker/tasks/kge.py)."""

    data_dir: str = setting(
        "", "dataset directory with train.txt (+ valid.txt, test.txt), or the name of a set "
        "shipped with hybridps: umls | kinship (hybridps/data/README.md)", "DIR|NAME")
    model: KgeModel = setting("distmult", "scoring model")
    training: KgeTraining = setting(
        "kvsall", "kvsall (each (h, r) against all entities, multi-hot targets) | 1vsall "
        "(each (h, r, t) against all entities) | negsample; scoring against all entities is "
        "sharded by entity rows")
    neg_ratio: int = setting(
        8, "--training negsample: corrupted tails per positive triple", "N", at_least=1)

    def __post_init__(self) -> None:
        check_settings(self)
