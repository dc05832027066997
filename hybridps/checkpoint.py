"""Checkpoint files and row-wise re-sharding (transport-free: no grpc, no worker code).

A checkpoint of step s is one directory (`<checkpoint-dir>/step-<s:010d>/`):

    manifest.json            written LAST (temp name + rename) by worker rank 0;
                             a directory without it is torn and never loaded
    rows/<table>.r<rank>.pt  the rows [row_start, row_end) rank `rank` owned
    optim/<table>.r<rank>.pt the sparse optimizer state of those rows: m, v,
                             the optimizer step count, last_step, and with
                             --row-dtype bf16 the fp32 master rows (the rows
                             file then holds them rounded to bf16) (written by
                             the shard server's Checkpoint RPC, or by the worker
                             itself under --local-optimizer: same format)
    dense/                   the dense part + its optimizer, a torch.distributed.checkpoint
                             (DCP) directory written by every rank (worker/checkpoint.py);
                             older checkpoints: dense.pt, full state dicts

Every shard file is a `torch.save` dict: {"format", "kind", "table", "num_rows",
"dim", "row_start", "row_end", "tensors": {name: [rows, dim] float32 or None},
"meta": {...}}, written under a temp name, fsynced, then renamed. The manifest
lists every file with its size and crc32 and the row range it holds, so a
reader at ANY world size gathers the saved ranges overlapping the range it
owns now (`load_rows`): that is all re-sharding is.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridps.errors import Conflict, InvalidArgument, NotFound

SHARD_FORMAT = "hybridps-shard-v1"
MANIFEST_FORMAT = "hybridps-checkpoint-v1"
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step-(\d+)$")
CRC_BLOCK = 16 * 2**20


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:010d}"


def rows_file(table: str, rank: int) -> str:
    return f"rows/{table}.r{rank:05d}.pt"


def optim_file(table: str, rank: int) -> str:
    return f"optim/{table}.r{rank:05d}.pt"


def file_crc32(path: str | Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(CRC_BLOCK):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Any) -> dict[str, Any]:
    """write(f) into `path`.tmp-<pid>, fsync, rename into place; returns {bytes, crc32}."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        crc = file_crc32(tmp)
        size = tmp.stat().st_size
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return {"bytes": size, "crc32": crc}


def save_torch(path: str | Path, obj: Any) -> dict[str, Any]:
    return atomic_write(path, lambda f: torch.save(obj, f))


@dataclass(frozen=True)
class ShardInfo:
    """One saved row range of one table: [row_start, row_end) in `file` (relative)."""

    table: str
    rank: int
    row_start: int
    row_end: int
    file: str
    bytes: int = 0
    crc32: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "row_start": self.row_start, "row_end": self.row_end,
                "file": self.file, "bytes": self.bytes, "crc32": self.crc32}


def save_shard(directory: str | Path, relpath: str, *, kind: str, table: str, rank: int,
               num_rows: int, dim: int, row_start: int, row_end: int,
               tensors: Mapping[str, torch.Tensor | None],
               meta: Mapping[str, Any] | None = None) -> ShardInfo:
    """Write one row-range shard file (temp + rename) and describe it."""
    held = row_end - row_start
    out: dict[str, torch.Tensor | None] = {}
    for name, t in tensors.items():
        if t is not None:
            if tuple(t.shape) != (held, dim):
                raise InvalidArgument(f"{kind} {table!r} rank {rank}: tensor {name!r} of shape "
                                      f"{list(t.shape)} is not [{held}, {dim}]")
            t = t.detach().to("cpu", torch.float32).contiguous()
        out[name] = t
    payload = {"format": SHARD_FORMAT, "kind": kind, "table": table, "rank": rank,
               "num_rows": num_rows, "dim": dim, "row_start": row_start, "row_end": row_end,
               "tensors": out, "meta": dict(meta or {})}
    info = save_torch(Path(directory) / relpath, payload)
    return ShardInfo(table, rank, row_start, row_end, relpath, info["bytes"], info["crc32"])


def read_shard(path: str | Path) -> dict[str, Any]:
    """A shard file, tensors memory-mapped (only the rows read are paged in)."""
    try:
        data = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except FileNotFoundError:
        raise NotFound(f"checkpoint file {path} does not exist") from None
    except Exception as exc:
        raise InvalidArgument(f"checkpoint file {path} is unreadable: "
                              f"{type(exc).__name__}: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != SHARD_FORMAT:
        raise InvalidArgument(f"checkpoint file {path} is not a {SHARD_FORMAT} file")
    return data


def check_tiling(table: str, num_rows: int, shards: Sequence[ShardInfo]) -> list[ShardInfo]:
    """The shards sorted by row_start; InvalidArgument unless they tile [0, num_rows)."""
    ordered = sorted(shards, key=lambda s: s.row_start)
    pos = 0
    for s in ordered:
        if s.row_start != pos or s.row_end < s.row_start:
            raise InvalidArgument(f"checkpoint table {table!r}: saved ranges do not tile "
                                  f"[0, {num_rows}): expected a range from row {pos}, got "
                                  f"[{s.row_start}, {s.row_end}) ({s.file})")
        pos = s.row_end
    if pos != num_rows:
        raise InvalidArgument(f"checkpoint table {table!r}: saved ranges end at row {pos}, "
                              f"not {num_rows}")
    return ordered


def load_rows(directory: str | Path, table: str, num_rows: int, dim: int,
              shards: Sequence[ShardInfo], start: int, end: int,
              names: Sequence[str]) -> tuple[dict[str, torch.Tensor | None], list[dict[str, Any]]]:
    """Re-shard: rows [start, end) of tensors `names`, gathered from the overlapping shards.

    Returns ({name: [end-start, dim] float32, or None when the saved state has no
    such tensor}, [meta of every shard read]).
    """
    ordered = check_tiling(table, num_rows, shards)
    out: dict[str, torch.Tensor | None] = {n: torch.empty(end - start, dim) for n in names}
    metas: list[dict[str, Any]] = []
    for s in ordered:
        a, b = max(start, s.row_start), min(end, s.row_end)
        if a >= b and not (start == end and not metas):
            continue
        data = read_shard(Path(directory) / s.file)
        if (data["table"], data["num_rows"], data["dim"], data["row_start"],
                data["row_end"]) != (table, num_rows, dim, s.row_start, s.row_end):
            raise Conflict(
                f"checkpoint file {s.file} holds table {data['table']!r} "
                f"{data['num_rows']}x{data['dim']} rows [{data['row_start']}, "
                f"{data['row_end']}); the manifest says {table!r} {num_rows}x{dim} rows "
                f"[{s.row_start}, {s.row_end})")
        metas.append(dict(data["meta"]))
        for n in names:
            saved = data["tensors"].get(n)
            if saved is None:
                out[n] = None
                continue
            dst = out[n]
            if dst is not None and a < b:
                dst[a - start:b - start].copy_(saved[a - s.row_start:b - s.row_start])
    return out, metas


# -- the manifest -----------------------------------------------------------------------

def write_manifest(directory: str | Path, manifest: Mapping[str, Any]) -> None:
    body = json.dumps({"format": MANIFEST_FORMAT, **manifest}, indent=1, sort_keys=True)
    atomic_write(Path(directory) / MANIFEST, lambda f: f.write(body.encode() + b"\n"))


def read_manifest(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise NotFound(f"{directory} is not a complete checkpoint (no {MANIFEST})") from None
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"{path} is unreadable: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise InvalidArgument(f"{path} is not a {MANIFEST_FORMAT} manifest")
    return data


def manifest_shards(manifest: Mapping[str, Any], table: str, key: str) -> list[ShardInfo]:
    """The `key` ("rows" or "optim") shards of `table` listed in a manifest."""
    entry = manifest["tables"].get(table)
    if entry is None:
        raise NotFound(f"checkpoint of step {manifest.get('step')} has no table {table!r} "
                       f"(tables: {sorted(manifest['tables'])})")
    out = []
    for s in entry["shards"]:
        f = s[key]
        out.append(ShardInfo(table, int(s["rank"]), int(s["row_start"]), int(s["row_end"]),
                             f["file"], int(f.get("bytes", 0)), str(f.get("crc32", ""))))
    return out


def verify_files(directory: str | Path, manifest: Mapping[str, Any]) -> None:
    """Every file the manifest lists exists with its size and crc32 (InvalidArgument if not)."""
    entries: list[Mapping[str, Any]] = []
    for t in manifest["tables"].values():
        for s in t["shards"]:
            entries.extend(s[k] for k in ("rows", "optim") if k in s)
    if "dense" in manifest:  # DCP files, or one dense.pt in older checkpoints
        dense = manifest["dense"]
        entries.extend(dense.get("files", [dense]))
    if "pending" in manifest:  # the workers' pending updates (worker/checkpoint.py)
        entries.extend(manifest["pending"]["files"])
    for e in entries:
        path = Path(directory) / e["file"]
        if not path.exists():
            raise NotFound(f"checkpoint file {path} listed in the manifest is missing")
        if path.stat().st_size != e["bytes"] or file_crc32(path) != e["crc32"]:
            raise InvalidArgument(f"checkpoint file {path} does not match the manifest's "
                                  "size/crc32 (corrupt)")


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, directory) of every complete checkpoint under `root`, oldest first."""
    found = []
    root = Path(root)
    if not root.is_dir():
        return []
    for child in root.iterdir():
        m = STEP_DIR.match(child.name)
        if m and (child / MANIFEST).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


# -- sparse optimizer state (server partitions and --local-optimizer) ----------------------

@dataclass
class OptimState:
    """The sparse optimizer state of rows [row_start, row_end) of one table."""

    m: torch.Tensor | None
    v: torch.Tensor | None
    adam_step: int
    last_step: int
    # fp32 master rows of a rank with bf16 device rows (None: the rows file is exact)
    master: torch.Tensor | None = None


def save_optim_state(directory: str | Path, *, table: str, rank: int, num_rows: int, dim: int,
                     row_start: int, row_end: int, state: OptimState,
                     optimizer: Mapping[str, Any], incarnation: int = 0) -> ShardInfo:
    return save_shard(directory, optim_file(table, rank), kind="optim", table=table, rank=rank,
                      num_rows=num_rows, dim=dim, row_start=row_start, row_end=row_end,
                      tensors={"m": state.m, "v": state.v, "master": state.master},
                      meta={"adam_step": state.adam_step, "last_step": state.last_step,
                            "incarnation": incarnation, "optimizer": dict(optimizer)})


def load_optim_state(directory: str | Path, *, table: str, num_rows: int, dim: int,
                     row_start: int, row_end: int, step: int,
                     has_moments: bool, master: bool = False) -> OptimState:
    """The optimizer state of rows [row_start, row_end) at checkpoint step `step`.

    `master`: also the fp32 master rows. A checkpoint saved without them (fp32 device
    rows) has its exact rows in the rows files, so they seed the master instead.
    """
    manifest = read_manifest(directory)
    if int(manifest["step"]) != step:
        raise Conflict(f"checkpoint {directory} is of step {manifest['step']}, not {step}")
    shards = manifest_shards(manifest, table, "optim")
    names = (("m", "v") if has_moments else ()) + (("master",) if master else ())
    tensors, metas = load_rows(directory, table, num_rows, dim, shards, row_start, row_end,
                               names)
    if master and tensors["master"] is None:
        rows, _ = load_rows(directory, table, num_rows, dim,
                            manifest_shards(manifest, table, "rows"), row_start, row_end,
                            ["weight"])
        tensors["master"] = rows["weight"]
    counts = {int(m["adam_step"]) for m in metas}
    lasts = {int(m["last_step"]) for m in metas}
    if len(counts) > 1 or lasts - {step}:
        raise Conflict(f"checkpoint {directory} table {table!r}: saved partitions disagree "
                       f"(step counts {sorted(counts)}, last steps {sorted(lasts)}; "
                       f"expected last step {step})")
    if has_moments and (tensors["m"] is None or tensors["v"] is None):
        raise Conflict(f"checkpoint {directory} table {table!r} has no Adam moments (saved "
                       "with an optimizer without them)")
    adam_step = counts.pop() if counts else step + 1
    return OptimState(tensors.get("m"), tensors.get("v"), adam_step, step,
                      tensors.get("master"))
