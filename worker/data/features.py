"""Which columns a task reads and how: the label, the dense features, one table per
categorical column (rows, dim, pooling), checked against each file's schema before training.

By convention (no --features): `label`; every `dense_*` column (in the order of their
numbers); every `cat_*` column its own table named after it, of --num-rows rows and --dim,
a list<int64> column pooled by --pooling. `--features FILE` (JSON, or YAML for a
.yaml / .yml file when pyyaml is installed) names them instead, and so may a task
(`FilesTask.features()`: the same document as a dict):

    {"label": "clicked",
     "dense": ["price", "age"],
     "tables": [{"column": "user_id", "name": "user", "rows": 100000, "dim": 32,
                 "dynamic": {"eviction": "lfu"}, "sharding": "row_wise"},
                {"column": "item_ids", "rows": 5000, "pooling": "sum"}],
     "id_overflow": "hash"}

Every key but "tables" is optional (label: "label", dense: none, a table's name: its
column, rows: --num-rows, dim: --dim, pooling: --pooling, id_overflow: --id-overflow,
sharding: --sharding). "dynamic": true or an object of hybridps.dynamic.DynamicSpec's
fields makes a dynamic table: raw int64 ids (any value, never refused nor hashed), `rows`
its device capacity (docs/dynamic_ids.md).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridps.cli import ConfigError
from hybridps.dynamic import DynamicSpec
from hybridps.names import describe_problem
from worker.config.train_config import TrainConfig
from worker.data.errors import DataError, where

__all__ = ["FeatureSpec", "TableSpec", "check_schema", "feature_spec"]

POOLINGS = ("mean", "sum")
OVERFLOWS = ("refuse", "hash")
LABEL_KINDS = ("int", "float", "bool")
DENSE_KINDS = ("int", "float", "bool")
ID_KINDS = ("int", "list<int>")
_TOP_KEYS = {"label", "dense", "tables", "id_overflow"}
_TABLE_KEYS = {"column", "name", "rows", "dim", "pooling", "dynamic", "sharding"}
SHARDINGS = ("row_wise", "table_wise", "auto")  # worker/config/task_options.py SHARDINGS
YAML_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True)
class TableSpec:
    name: str
    column: str
    rows: int
    dim: int
    pooling: str = "mean"
    dynamic: DynamicSpec | None = None  # raw ids, `rows` slots (docs/dynamic_ids.md)
    sharding: str = ""  # row_wise | table_wise | auto; "": the run's --sharding


@dataclass(frozen=True)
class FeatureSpec:
    label: str
    dense: tuple[str, ...]
    tables: tuple[TableSpec, ...]
    id_overflow: str = "refuse"

    def columns(self) -> list[str]:
        return [self.label, *self.dense, *(t.column for t in self.tables)]


def _numbered(columns: list[str], prefix: str) -> list[str]:
    def key(name: str) -> tuple[int, str]:
        tail = name[len(prefix):]
        return (int(tail), "") if tail.isdigit() else (1 << 62, tail)

    return sorted((c for c in columns if c.startswith(prefix)), key=key)


def read_features(path: str) -> Any:
    """The document of a --features file: JSON, or YAML (.yaml / .yml) through pyyaml."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise DataError(f"--features {path}: cannot read it ({exc})") from None
    if Path(path).suffix in YAML_SUFFIXES:
        try:
            import yaml
        except ImportError:
            raise DataError(f"--features {path}: a YAML file needs pyyaml (pip install "
                            "pyyaml), or write it as JSON") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise DataError(f"--features {path}: cannot read it as YAML "
                            f"({' '.join(str(exc).split())})") from None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise DataError(f"--features {path}: cannot read it as JSON ({exc})") from None


def feature_spec(cfg: TrainConfig, schema: Mapping[str, str], first_file: Path,
                 declared: Mapping[str, Any] | None = None, what: str = "") -> FeatureSpec:
    """The spec a task declares (`declared`, named `what` in errors), else --features',
    else by convention from the first file's columns."""
    rows, dim = cfg.synthetic.num_rows, cfg.run.dim
    pooling, overflow = cfg.files.pooling, cfg.files.id_overflow
    if declared is not None:
        if cfg.files.features:
            raise DataError(f"--features {cfg.files.features}: {what or 'the task'} declares "
                            "its columns already; drop the flag")
        return _from_json(dict(declared), what or "the task's columns", rows, dim, pooling,
                          overflow, prefix="")
    if not cfg.files.features:
        cats = _numbered(list(schema), "cat_")
        if not cats:
            raise DataError(f"{where(first_file)}: no cat_* column (columns: "
                            f"{', '.join(schema)}); name them with --features FILE")
        return FeatureSpec("label", tuple(_numbered(list(schema), "dense_")),
                           tuple(TableSpec(c, c, rows, dim, pooling) for c in cats), overflow)
    path = cfg.files.features
    return _from_json(read_features(path), path, rows, dim, pooling, overflow)


def _dynamic(value: Any, at: str) -> DynamicSpec | None:
    """A table's "dynamic": false / absent, true (the default policies) or DynamicSpec's
    fields."""
    if value is None or value is False:
        return None
    if value is True:
        return DynamicSpec()
    if not isinstance(value, dict):
        raise DataError(f"{at}: dynamic {value!r} must be true or an object of policies")
    try:
        return DynamicSpec(**value)
    except TypeError:
        known = sorted(DynamicSpec.__dataclass_fields__)
        raise DataError(f"{at}: dynamic: unknown keys {sorted(set(value) - set(known))} "
                        f"(known: {known})") from None
    except ConfigError as exc:
        raise DataError(f"{at}: {exc}") from None


def _from_json(doc: Any, path: str, rows: int, dim: int, pooling: str,
               overflow: str, prefix: str = "--features ") -> FeatureSpec:
    if not isinstance(doc, dict) or not isinstance(doc.get("tables"), list) or not doc["tables"]:
        raise DataError(f"{prefix}{path}: expected an object with a non-empty list "
                        "'tables'")
    unknown = sorted(set(doc) - _TOP_KEYS)
    if unknown:
        raise DataError(f"{prefix}{path}: unknown keys {unknown} (known: {sorted(_TOP_KEYS)})")
    overflow = doc.get("id_overflow", overflow)
    if overflow not in OVERFLOWS:
        raise DataError(f"{prefix}{path}: id_overflow {overflow!r} is not one of "
                        f"{', '.join(OVERFLOWS)}")
    dense = doc.get("dense", [])
    if not isinstance(dense, list) or not all(isinstance(c, str) for c in dense):
        raise DataError(f"{prefix}{path}: 'dense' must be a list of column names")
    label = doc.get("label", "label")
    if not isinstance(label, str):
        raise DataError(f"{prefix}{path}: 'label' must be a column name")
    tables: list[TableSpec] = []
    for i, entry in enumerate(doc["tables"]):
        at = f"{prefix}{path}: tables[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("column"), str):
            raise DataError(f"{at}: expected an object with a 'column' name")
        unknown = sorted(set(entry) - _TABLE_KEYS)
        if unknown:
            raise DataError(f"{at}: unknown keys {unknown} (known: {sorted(_TABLE_KEYS)})")
        name = entry.get("name", entry["column"])
        if not isinstance(name, str):
            raise DataError(f"{at}: table name {name!r} is not a string")
        problem = describe_problem("table name", name)
        if problem is None and not re.fullmatch(r"[A-Za-z_]\w*", name):
            problem = f"table name {name!r} must be a Python identifier"
        if problem is not None:
            raise DataError(f"{at}: {problem}")
        sharding = entry.get("sharding", "")
        if sharding not in ("", *SHARDINGS):
            raise DataError(f"{at}: sharding {sharding!r} is not one of {', '.join(SHARDINGS)}")
        spec = TableSpec(name, entry["column"], entry.get("rows", rows), entry.get("dim", dim),
                         entry.get("pooling", pooling), _dynamic(entry.get("dynamic"), at),
                         sharding)
        for key in ("rows", "dim"):
            value = getattr(spec, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DataError(f"{at}: {key} {value!r} must be an int >= 1")
        if spec.pooling not in POOLINGS:
            raise DataError(f"{at}: pooling {spec.pooling!r} is not one of "
                            f"{', '.join(POOLINGS)}")
        if name in {t.name for t in tables}:
            raise DataError(f"{at}: table {name!r} appears twice")
        tables.append(spec)
    return FeatureSpec(label, tuple(dense), tuple(tables), overflow)


def check_schema(spec: FeatureSpec, schema: Mapping[str, str], path: Path) -> None:
    """DataError naming the file and column: a column missing or of a type it cannot be."""
    wanted: list[tuple[str, tuple[str, ...], str]] = [
        (spec.label, LABEL_KINDS, "a 0/1 label (int, float or bool)")]
    wanted += [(c, DENSE_KINDS, "a dense feature (int, float or bool)") for c in spec.dense]
    wanted += [(t.column, ID_KINDS, f"table {t.name}'s ids (int64, or list<int64>)")
               for t in spec.tables]
    for column, kinds, what in wanted:
        kind = schema.get(column)
        if kind is None:
            shown = ", ".join(list(schema)[:12]) + (", ..." if len(schema) > 12 else "")
            raise DataError(f"{where(path, None, column)}: missing (the file has {shown})")
        if kind not in kinds:
            raise DataError(f"{where(path, None, column)}: type {kind}, expected {what}")
