"""The settings only one task reads: one section per built-in task (torch-free).

A task reads its own section (`cfg.kge.model`) and the run's basics (`cfg.run.dim`,
`cfg.run.batch_size`, `cfg.run.seed`); worker/config/task_defaults.py gives a task its own
defaults for the general settings (lr, dim, ...).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, get_args

from hybridps.cli import check_settings, setting
from hybridps.dynamic import EVICTIONS, DynamicSpec
from hybridps.names import describe_problem

KgeModel = Literal["distmult", "complex", "keci", "qmult"]
KgeTraining = Literal["kvsall", "1vsall", "negsample"]
KGE_MODELS: tuple[str, ...] = get_args(KgeModel)  # worker/tasks/kge/models.py builds them


SHARDINGS = ("row_wise", "table_wise", "auto")  # worker/embedding/sharding.py SHARDING_CHOICES


def parse_table_list(spec: str) -> list[tuple[str, int, int]]:
    """--tables 'NAME:ROWS[:POOL],...' -> [(name, rows, pool)]; ValueError naming the entry.
    (A dynamic table's ROWS is its capacity: `parse_tables` has its policies.)"""
    return [(name, rows, pool) for name, rows, pool, _ in parse_tables(spec)]


def table_shardings(spec: str) -> dict[str, str]:
    """The tables of --tables that name their scheme (NAME:ROWS[:POOL]:SCHEME), by name."""
    return {entry.split(":")[0]: scheme for entry, scheme in _entries(spec) if scheme}


def _entries(spec: str) -> list[tuple[str, str]]:
    """(entry without its scheme, the scheme or "") per --tables entry."""
    out = []
    for entry in spec.replace(" ", "").split(","):
        parts = entry.split(":")
        cut = parts.index("dynamic") if "dynamic" in parts else len(parts)
        scheme = parts[cut - 1] if cut > 2 and parts[cut - 1] in SHARDINGS else ""
        if scheme:
            del parts[cut - 1]
        out.append((":".join(parts), scheme))
    return out


def parse_tables(spec: str) -> list[tuple[str, int, int, DynamicSpec | None]]:
    """--tables 'NAME:ROWS[:POOL][:SCHEME][:dynamic[:OPTION...]],...' -> [(name, rows,
    pool, dynamic spec or None)]; ValueError naming the entry. SCHEME: row_wise |
    table_wise | auto, the table's own sharding (`table_shardings`; else --sharding).
    Options of a dynamic table (docs/dynamic_ids.md), each policy at most once: lru | lfu,
    always | threshold=N | probability=P, expire=T."""
    out: list[tuple[str, int, int, DynamicSpec | None]] = []
    for entry, _ in _entries(spec):
        parts = entry.split(":")
        cut = parts.index("dynamic") if "dynamic" in parts else len(parts)
        sizes, options = parts[:cut], parts[cut + 1:]
        if (len(sizes) not in (2, 3) or not sizes[0].isidentifier()
                or not all(p.isdigit() for p in sizes[1:])):
            raise ValueError(f"tables={spec!r}: entry {entry!r} is not "
                             "NAME:ROWS[:POOL][:SCHEME][:dynamic[:OPTION...]] (SCHEME: "
                             f"{' | '.join(SHARDINGS)})")
        problem = describe_problem("table name", sizes[0])  # what the server accepts
        if problem is not None:
            raise ValueError(f"tables={spec!r}: {problem}")
        rows, pool = int(sizes[1]), int(sizes[2]) if len(sizes) == 3 else 1
        dynamic = (_dynamic_spec(spec, entry, sizes[0], rows, options)
                   if cut < len(parts) else None)
        if rows < 1 or pool < 1:
            raise ValueError(f"tables={spec!r}: entry {entry!r} needs ROWS >= 1 and POOL >= 1")
        if sizes[0] in {name for name, _, _, _ in out}:
            raise ValueError(f"tables={spec!r}: table {sizes[0]!r} appears twice")
        out.append((sizes[0], rows, pool, dynamic))
    return out


def _dynamic_spec(spec: str, entry: str, name: str, capacity: int,
                  options: list[str]) -> DynamicSpec:
    """The options after `dynamic` (parse_tables); ValueError naming the bad one."""
    where = f"tables={spec!r}: entry {entry!r}"
    if capacity < 1:
        raise ValueError(f"{where}: table {name!r}: dynamic capacity {capacity} must be >= 1")
    fields: dict[str, Any] = {}
    given: dict[str, str] = {}  # policy -> the option that set it: each may be given once
    for option in options:
        key, _, value = option.partition("=")
        policy = ("eviction" if key in EVICTIONS else "admission"
                  if key in ("always", "threshold", "probability") else key)
        if policy in given:
            raise ValueError(f"{where}: dynamic spec {':'.join(options)!r}: {policy} given "
                             f"twice ({given[policy]}, {option})")
        given[policy] = option
        try:
            if key in EVICTIONS and not value:
                fields["eviction"] = key
            elif key == "always" and not value:
                fields["admission"] = "always"
            elif key == "threshold":
                fields.update(admission="threshold", threshold=int(value))
            elif key == "probability":
                fields.update(admission="probability", probability=float(value))
            elif key == "expire":
                fields["expire_steps"] = int(value)
            else:
                raise ValueError(f"unknown policy {option!r} (eviction: "
                                 f"{' | '.join(EVICTIONS)}; admission: always | threshold=N |"
                                 " probability=P; expire=T)")
        except ValueError as exc:
            if "unknown policy" in str(exc):
                raise ValueError(f"{where}: {exc}") from None
            raise ValueError(f"{where}: option {option!r} needs a number") from None
    try:
        return DynamicSpec(**fields)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


@dataclass(frozen=True)
class SyntheticConfig:
    """--task synthetic (the default job; worker/tasks/synthetic.py) and --task tables."""

    num_rows: int = setting(
        1_000_000, "rows of the biggest synthetic table (user); the others scale from it; "
        "--task tables without --tables: the rows of its one table; --task files: the rows "
        "of each categorical column's table", "R", at_least=1)

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class TablesConfig:
    """--task tables: a configurable list of tables (worker/tasks/tables.py)."""

    tables: str = setting(
        "", "NAME:ROWS[:POOL][:SCHEME][:dynamic[:OPTION...]],... (POOL ids per sample, "
        "mean-pooled; default 1; SCHEME row_wise|table_wise|auto: the table's sharding, "
        "else --sharding; dynamic: raw ids, ROWS device slots, options lru|lfu, always|threshold=N|"
        "probability=P, expire=T: docs/dynamic_ids.md); empty: one table t0 of --num-rows "
        "rows", "SPEC")
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
    """--task dlrm: DLRM on Criteo TSV or synthetic CTR data (worker/tasks/ctr/dlrm.py)."""

    data_path: str = setting(
        "", "Criteo TSV file or directory, read as --train-files naming its files (empty "
        "and no --train-files: the synthetic generator)", "PATH")
    table_rows: str = setting(
        "", "rows per categorical table: one int for all 26, or 26 comma-separated", "R[,R..]")

    def __post_init__(self) -> None:
        if self.table_rows and not re.fullmatch(r"\d+(,\d+)*", self.table_rows.replace(" ", "")):
            raise ValueError(f"table_rows={self.table_rows!r} is not an int or a comma list")


Pooling = Literal["mean", "sum"]
IdOverflow = Literal["refuse", "hash"]


@dataclass(frozen=True)
class FilesConfig:
    """--task files (and --task dlrm, a custom FilesTask): a model trained from Parquet,
    TorchRec's Criteo .npy or Criteo TSV files (worker/data/, docs/data.md)."""

    train_files: str = setting(
        "", "training files: a glob, or several comma-separated (Parquet .parquet, "
        "TorchRec's Criteo day_N_{dense,sparse,labels}.npy, Criteo TSV .tsv/.txt/.gz)",
        "GLOB[,GLOB..]")
    valid_files: str = setting(
        "", "held-out files (same formats) for AUC and log loss during and after training; "
        "empty: no evaluation", "GLOB[,GLOB..]")
    features: str = setting(
        "", "JSON (or .yaml / .yml, with pyyaml) file naming the label, dense and "
        "categorical columns and each table's rows / dim / pooling / dynamic / sharding "
        "(docs/data.md); empty: the columns by convention (label, dense_*, cat_*)", "PATH")
    pooling: Pooling = setting(
        "mean", "how a multi-hot (list<int64>) column's rows are pooled")
    id_overflow: IdOverflow = setting(
        "refuse", "an id outside its table's rows: refuse (one error line naming file, row "
        "group and column) | hash (mapped into the rows by a 64-bit hash)")
    shuffle_buffer: int = setting(
        65536, "rows shuffled together (a rank's consecutive row groups filling the "
        "buffer, permuted by a function of --seed and the epoch; the file order is "
        "shuffled per epoch too); 0: files and rows in order", "ROWS", at_least=0)
    data_workers: int = setting(
        0, "DataLoader worker processes decoding the next batches while the step computes "
        "(0: decode in the training process)", "N", at_least=0)

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class KgeConfig:
    """--task kge: link prediction on a knowledge graph (worker/tasks/kge/task.py)."""

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
