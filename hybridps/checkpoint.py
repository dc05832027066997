"""Checkpoint files and row-wise re-sharding (transport-free: no grpc, no worker code).

A checkpoint of step s is one directory (`<checkpoint-dir>/step-<s:010d>/`):

    manifest.json            written LAST (temp name + rename) by worker rank 0;
                             a directory without it is torn and never loaded
    rows/<table>.r<rank>.pt  the rows [row_start, row_end) rank `rank` owned
    optim/<table>.r<rank>.pt the sparse optimizer state of those rows (by the
                             names of its layout, hybridps/optim_kinds.py: adam's
                             m and v, rowwise Adagrad's sum [rows, 1], ...), the
                             optimizer and its hyperparameters, its step count,
                             last_step, and with --row-dtype bf16 the fp32 master
                             rows (the rows file then holds them rounded to bf16)
                             (written by the shard server's Checkpoint RPC, or by
                             the worker itself under --local-optimizer: same
                             format)
    dense/                   the dense part + its optimizer, a torch.distributed.checkpoint
                             (DCP) directory written by every rank (worker/checkpoint/);
                             older checkpoints: dense.pt, full state dicts
    pending/r<rank>.pt       the workers' pending updates (worker/checkpoint/window.py)
    data/r<rank>.pt          a task's reading position, where it keeps one
                             (worker/checkpoint/data.py; listed in the manifest's
                             `parts`, which names the parts that wrote the checkpoint)

Every shard file is a `torch.save` dict: {"format", "kind", "table", "num_rows",
"dim", "row_start", "row_end", "tensors": {name: [rows, width] float32 or None},
"meta": {...}}, written under a temp name, fsynced, then renamed. The manifest
lists every file with its size and crc32 and the row range it holds, so a
reader at ANY world size gathers the saved ranges overlapping the range it
owns now (`load_rows`): that is all re-sharding is.

Nothing damaged is ever applied. The manifest carries a crc32 of its own content
(`checksum`; manifests written before it have none and are read as they are), and
every file is checked against the manifest's size and crc32 before a byte of it is
used (`verify_entry`; `load_rows` does it for each file it reads). A file that is
missing, of another size or crc32, truncated or unreadable raises CorruptCheckpoint
naming it (the server answers DATA_LOSS; a resuming worker falls back to the previous
checkpoint, worker/checkpoint/resume.py).
"""

from __future__ import annotations

import json
import os
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from hybridps.errors import Conflict, CorruptCheckpoint, InvalidArgument, NotFound
from hybridps.optim_kinds import describe_saved, is_kind, state_widths

# re-exported: the step directories are part of the checkpoint's layout
from hybridps.step_dirs import STEP_DIR as STEP_DIR
from hybridps.step_dirs import step_dir as step_dir

SHARD_FORMAT = "hybridps-shard-v1"
MANIFEST_FORMAT = "hybridps-checkpoint-v1"
MANIFEST = "manifest.json"
CRC_BLOCK = 16 * 2**20


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


def owning_tensors(obj: Any) -> Any:
    """`obj` (dicts, lists and tuples of tensors and plain values) with every tensor that
    views a larger storage replaced by a compact copy of its own elements.

    torch.save writes the whole storage behind a tensor: a few ids viewing the shared-
    memory arena (worker/sync/arena.py) or a table viewing its group's block would carry
    all of it into the file."""
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided or obj.device.type == "meta":
            return obj
        if (obj.storage_offset() == 0 and obj.is_contiguous()
                and obj.untyped_storage().nbytes() == obj.numel() * obj.element_size()):
            return obj
        return obj.clone(memory_format=torch.contiguous_format)
    if isinstance(obj, dict):
        items = {k: owning_tensors(v) for k, v in obj.items()}
        return type(obj)(items) if isinstance(obj, OrderedDict) else items
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(owning_tensors(v) for v in obj)
    if isinstance(obj, list):
        return [owning_tensors(v) for v in obj]
    return obj


def torch_save(obj: Any, f: BinaryIO) -> None:
    """torch.save of `obj` holding only the tensors' own data (`owning_tensors`)."""
    torch.save(owning_tensors(obj), f)


def save_torch(path: str | Path, obj: Any) -> dict[str, Any]:
    return atomic_write(path, lambda f: torch_save(obj, f))


# Writes one file of a checkpoint: (path relative to the checkpoint directory, write(f)) ->
# {bytes, crc32}. Default: atomic_write under the directory's path; the shard server
# passes one that walks from a directory descriptor without following links
# (ps/core/checkpoint_dirs.py).
Writer = Callable[[str, Callable[[BinaryIO], Any]], dict[str, Any]]


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
    delta: bool = False  # only the rows changed since the parent checkpoint (save_delta)

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "row_start": self.row_start, "row_end": self.row_end,
                "file": self.file, "bytes": self.bytes, "crc32": self.crc32,
                **({"delta": True} if self.delta else {})}


def save_shard(directory: str | Path, relpath: str, *, kind: str, table: str, rank: int,
               num_rows: int, dim: int, row_start: int, row_end: int,
               tensors: Mapping[str, torch.Tensor | None],
               meta: Mapping[str, Any] | None = None,
               widths: Mapping[str, int] | None = None,
               writer: Writer | None = None,
               ids: torch.Tensor | None = None) -> ShardInfo:
    """Write one row-range shard file (temp + rename, through `writer` when given) and
    describe it. Each tensor is [rows, dim], or [rows, widths[name]] for a name in
    `widths`. `ids` (sorted global row ids inside the range): a delta shard, whose
    tensors hold only those rows (`save_delta`)."""
    held = row_end - row_start if ids is None else int(ids.numel())
    if ids is not None and held and (int(ids.min()) < row_start or int(ids.max()) >= row_end):
        raise InvalidArgument(f"{kind} {table!r} rank {rank}: delta row ids outside "
                              f"[{row_start}, {row_end})")
    out: dict[str, torch.Tensor | None] = {}
    for name, t in tensors.items():
        if t is not None:
            width = (widths or {}).get(name, dim)
            if tuple(t.shape) != (held, width):
                raise InvalidArgument(f"{kind} {table!r} rank {rank}: tensor {name!r} of shape "
                                      f"{list(t.shape)} is not [{held}, {width}]")
            t = t.detach().to("cpu", torch.float32).contiguous()
            if t.untyped_storage().nbytes() != t.numel() * t.element_size():
                t = t.clone()  # a view (a table of a group's block): save its rows only
        out[name] = t
    payload = {"format": SHARD_FORMAT, "kind": kind, "table": table, "rank": rank,
               "num_rows": num_rows, "dim": dim, "row_start": row_start, "row_end": row_end,
               "tensors": out, "meta": dict(meta or {})}
    if ids is not None:
        payload["ids"] = ids.detach().to("cpu", torch.int64).contiguous().clone()
    if writer is None:
        info = save_torch(Path(directory) / relpath, payload)
    else:
        info = writer(relpath, lambda f: torch_save(payload, f))
    return ShardInfo(table, rank, row_start, row_end, relpath, info["bytes"], info["crc32"],
                     delta=ids is not None)


SHARD_KEYS = {"table": str, "num_rows": int, "dim": int, "row_start": int, "row_end": int,
              "tensors": dict, "meta": dict}


def _read_shard_of(path: Path, named: object, s: ShardInfo, table: str, num_rows: int,
                   dim: int, expected: str) -> dict[str, Any]:
    """Shard file `path` (`named` in the error), Conflict unless its header is table
    `table` num_rows x dim, rows of entry `s` (`expected`: who says so, in the error)."""
    data = read_shard(path)
    if (data["table"], data["num_rows"], data["dim"], data["row_start"],
            data["row_end"]) != (table, num_rows, dim, s.row_start, s.row_end):
        raise Conflict(f"checkpoint file {named} holds table {data['table']!r} "
                       f"{data['num_rows']}x{data['dim']} rows [{data['row_start']}, "
                       f"{data['row_end']}); {expected} {table!r} {num_rows}x{dim} rows "
                       f"[{s.row_start}, {s.row_end})")
    return data


def read_shard(path: str | Path) -> dict[str, Any]:
    """A shard file, tensors memory-mapped (only the rows read are paged in).

    CorruptCheckpoint when it is missing, unreadable (truncated, garbled) or not a
    well-formed shard; the caller checks it against the manifest first (verify_entry)."""
    try:
        data = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"checkpoint file {path} is missing") from None
    except Exception as exc:
        raise CorruptCheckpoint(f"checkpoint file {path} is unreadable: "
                                f"{type(exc).__name__}: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != SHARD_FORMAT:
        raise CorruptCheckpoint(f"checkpoint file {path} is not a {SHARD_FORMAT} file")
    bad = sorted(k for k, kind in SHARD_KEYS.items() if not isinstance(data.get(k), kind))
    if bad:
        raise CorruptCheckpoint(f"checkpoint file {path} lacks well-formed {', '.join(bad)}")
    return data


def verify_entry(directory: str | Path, entry: Mapping[str, Any]) -> None:
    """The file a manifest entry ({file, bytes, crc32}) names exists with that size and
    crc32; CorruptCheckpoint naming it and what differs otherwise."""
    try:
        rel, size, crc = str(entry["file"]), int(entry["bytes"]), str(entry["crc32"])
    except (KeyError, TypeError, ValueError):
        raise CorruptCheckpoint(f"checkpoint {directory}: manifest entry {entry!r} has no "
                                "file, bytes and crc32") from None
    path = Path(directory) / rel
    if Path(rel).is_absolute() or ".." in Path(rel).parts:
        raise CorruptCheckpoint(f"checkpoint {directory}: manifest names file {rel!r} "
                                "outside its directory")
    try:
        got_size = path.stat().st_size
        if got_size != size:
            raise CorruptCheckpoint(f"checkpoint file {path} has {got_size} bytes; the "
                                    f"manifest says {size} (truncated or replaced)")
        got_crc = file_crc32(path)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"checkpoint file {path} listed in the manifest is "
                                "missing") from None
    except OSError as exc:
        raise CorruptCheckpoint(f"checkpoint file {path} is unreadable: "
                                f"{exc.strerror or exc}") from None
    if got_crc != crc:
        raise CorruptCheckpoint(f"checkpoint file {path} has crc32 {got_crc}; the manifest "
                                f"says {crc} (corrupt)")


def verify_shards(directory: str | Path, shards: Sequence[ShardInfo]) -> None:
    for s in shards:
        verify_entry(directory, {"file": s.file, "bytes": s.bytes, "crc32": s.crc32})


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


def overlapping(shards: Sequence[ShardInfo], start: int, end: int) -> list[ShardInfo]:
    """The shards `load_rows` reads for rows [start, end) (an empty range: the first)."""
    ordered = sorted(shards, key=lambda s: s.row_start)
    if start == end:
        return ordered[:1]
    return [s for s in ordered if max(start, s.row_start) < min(end, s.row_end)]


def load_rows(directory: str | Path, table: str, num_rows: int, dim: int,
              shards: Sequence[ShardInfo], start: int, end: int,
              names: Sequence[str], *, verify: bool = True, dry_run: bool = False,
              widths: Mapping[str, int] | None = None,
              check_meta: Callable[[Mapping[str, Any]], None] | None = None,
              ) -> tuple[dict[str, torch.Tensor | None], list[dict[str, Any]]]:
    """Re-shard: rows [start, end) of tensors `names`, gathered from the overlapping shards.

    Returns ({name: [end-start, width] float32 (width: widths[name], else dim), or None
    when the saved state has no such tensor}, [meta of every shard read]). Each file read
    is first checked against its manifest entry (`verify`; False: the caller verified
    them), then its meta by `check_meta` (which raises), before a tensor of it is used.
    `dry_run`: every check, no tensor allocated or copied (the returned tensors are empty).
    """
    ordered = check_tiling(table, num_rows, shards)
    width_of = {n: (widths or {}).get(n, dim) for n in names}
    out: dict[str, torch.Tensor | None] = {
        n: torch.empty(0 if dry_run else end - start, width_of[n]) for n in names}
    metas: list[dict[str, Any]] = []
    for s in ordered:
        a, b = max(start, s.row_start), min(end, s.row_end)
        if a >= b and not (start == end and not metas):
            continue
        if verify:
            verify_shards(directory, [s])
        data = _read_shard_of(Path(directory) / s.file, s.file, s, table, num_rows, dim,
                              "the manifest says")
        if check_meta is not None:
            check_meta(data["meta"])
        metas.append(dict(data["meta"]))
        held = s.row_end - s.row_start
        for n in names:
            saved = data["tensors"].get(n)
            if saved is None:
                out[n] = None
                continue
            if (not isinstance(saved, torch.Tensor) or saved.dtype != torch.float32
                    or tuple(saved.shape) != (held, width_of[n])):
                got = (f"{saved.dtype} {list(saved.shape)}" if isinstance(saved, torch.Tensor)
                       else type(saved).__name__)
                raise CorruptCheckpoint(f"checkpoint file {Path(directory) / s.file}: tensor "
                                        f"{n!r} is {got}, not float32 [{held}, {width_of[n]}]")
            dst = out[n]
            if dst is not None and a < b and not dry_run:
                dst[a - start:b - start].copy_(saved[a - s.row_start:b - s.row_start])
    return out, metas


# -- the manifest -----------------------------------------------------------------------

MANIFEST_CHECKSUM = "checksum"
# The files a shard entry of a manifest may list: the rows, the optimizer state, and for a
# dynamic table (docs/dynamic_ids.md) its slots' ids and its paged-out rows.
SHARD_FILE_KINDS = ("rows", "optim", "ids", "paged")


def _manifest_crc(body: Mapping[str, Any]) -> str:
    canonical = json.dumps({k: v for k, v in body.items() if k != MANIFEST_CHECKSUM},
                           sort_keys=True, separators=(",", ":"))
    return f"crc32:{zlib.crc32(canonical.encode()):08x}"


def write_manifest(directory: str | Path, manifest: Mapping[str, Any]) -> None:
    data = {"format": MANIFEST_FORMAT, **manifest}
    data[MANIFEST_CHECKSUM] = _manifest_crc(data)
    body = json.dumps(data, indent=1, sort_keys=True)
    atomic_write(Path(directory) / MANIFEST, lambda f: f.write(body.encode() + b"\n"))


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of a complete checkpoint: NotFound when there is none (a torn
    directory), CorruptCheckpoint when it is unreadable or fails its own checksum."""
    path = Path(directory) / MANIFEST
    try:
        data = json.loads(path.read_bytes().decode())
    except FileNotFoundError:
        raise NotFound(f"{directory} is not a complete checkpoint (no {MANIFEST})") from None
    except OSError as exc:
        raise CorruptCheckpoint(f"{path} is unreadable: {exc.strerror or exc}") from None
    except ValueError as exc:  # JSON or UTF-8
        raise CorruptCheckpoint(f"{path} is unreadable: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise CorruptCheckpoint(f"{path} is not a {MANIFEST_FORMAT} manifest")
    saved = data.get(MANIFEST_CHECKSUM)
    if saved is not None and saved != _manifest_crc(data):
        raise CorruptCheckpoint(f"{path} does not match its own checksum (corrupt)")
    if not isinstance(data.get("tables"), dict) or not isinstance(data.get("step"), int):
        raise CorruptCheckpoint(f"{path} lacks well-formed step and tables")
    return data


@dataclass(frozen=True)
class FileEntry:
    """One file a manifest lists: its path (relative to the checkpoint), size and crc32."""

    file: str
    bytes: int = 0
    crc32: str = ""
    delta: bool = False  # a delta shard: the rows changed since the parent checkpoint

    def as_dict(self) -> dict[str, Any]:
        return {"file": self.file, "bytes": self.bytes, "crc32": self.crc32,
                **({"delta": True} if self.delta else {})}

    @classmethod
    def of(cls, entry: Mapping[str, Any]) -> FileEntry:
        return cls(str(entry["file"]), int(entry.get("bytes", 0)), str(entry.get("crc32", "")),
                   bool(entry.get("delta", False)))


@dataclass(frozen=True)
class ManifestShard:
    """The files one rank saved for a table's rows [row_start, row_end), by kind: "rows"
    and "optim" (dynamic tables also "ids" and "paged", hybridps/dynamic_files.py)."""

    rank: int
    row_start: int
    row_end: int
    files: Mapping[str, FileEntry]

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "row_start": self.row_start, "row_end": self.row_end,
                **{kind: f.as_dict() for kind, f in self.files.items()}}

    def info(self, table: str, kind: str) -> ShardInfo:
        f = self.files[kind]
        return ShardInfo(table, self.rank, self.row_start, self.row_end, f.file, f.bytes,
                         f.crc32, f.delta)


@dataclass(frozen=True)
class ManifestTable:
    """A table of a checkpoint: its shape, its shards, and what else a table declares
    (`extra`: e.g. a dynamic table's spec), kept as it was written."""

    num_rows: int
    dim: int
    shards: tuple[ManifestShard, ...]
    extra: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {**self.extra, "num_rows": self.num_rows, "dim": self.dim,
                "shards": [s.as_dict() for s in self.shards]}


@dataclass(frozen=True)
class PendingEntry:
    """The workers' pending updates (worker/checkpoint/): the staleness, the newest step
    in the rows, and one file per rank."""

    staleness: int
    applied_through: int
    files: tuple[tuple[int, FileEntry], ...]  # (rank, file)

    def as_dict(self) -> dict[str, Any]:
        return {"staleness": self.staleness, "applied_through": self.applied_through,
                "files": [{"rank": rank, **f.as_dict()} for rank, f in self.files]}


@dataclass(frozen=True)
class PartEntry:
    """One part of a checkpoint (worker/checkpoint/parts.py: tables, window, source, dense,
    data, dynamic): its name and the files it lists beyond the manifest's own keys (tables,
    dense, pending), each with the rank that wrote it."""

    name: str
    files: tuple[tuple[int, FileEntry], ...] = ()  # (rank, file)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name,
                "files": [{"rank": rank, **f.as_dict()} for rank, f in self.files]}

    @classmethod
    def of(cls, entry: Mapping[str, Any]) -> PartEntry:
        name, files = entry["name"], entry.get("files", [])
        if not isinstance(name, str) or not name or not isinstance(files, list):
            raise ValueError(f"part entry {entry!r} needs a name and a list of files")
        return cls(name, tuple((int(f["rank"]), FileEntry.of(f)) for f in files))


def _parts(entries: Any) -> tuple[PartEntry, ...]:
    if entries is None:  # written before parts were recorded
        return ()
    if not isinstance(entries, list):
        raise ValueError(f"parts is {type(entries).__name__}, not a list")
    parts = tuple(PartEntry.of(e) for e in entries)
    names = [p.name for p in parts]
    if len(set(names)) != len(names):
        raise ValueError(f"parts {names} name a part twice")
    return parts


@dataclass(frozen=True)
class ParentEntry:
    """An incremental checkpoint's parent: the step directory next to it (`path`, a bare
    step-<s> name), its step, and its manifest.json's own checksum, size and crc32 (the
    parent must be exactly that file: another checkpoint of that step is another chain)."""

    path: str
    step: int
    checksum: str
    bytes: int
    crc32: str

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "step": self.step, "checksum": self.checksum,
                "bytes": self.bytes, "crc32": self.crc32}

    @classmethod
    def of(cls, entry: Mapping[str, Any]) -> ParentEntry:
        return cls(str(entry["path"]), int(entry["step"]), str(entry["checksum"]),
                   int(entry["bytes"]), str(entry["crc32"]))

    @classmethod
    def describe(cls, directory: str | Path) -> ParentEntry:
        """The entry naming checkpoint `directory` as a parent (its manifest read whole)."""
        directory = Path(directory)
        data = read_manifest(directory)
        path = directory / MANIFEST
        return cls(directory.name, int(data["step"]), str(data.get(MANIFEST_CHECKSUM, "")),
                   path.stat().st_size, file_crc32(path))


# The manifest's keys this class reads; any other is kept in `extra` and written back.
_MANIFEST_KEYS = ("step", "next_step", "world_size", "run_id", "mode", "row_dtype",
                  "optimizer", "task", "seed", "data", "created_unix", "tables", "dense",
                  "pending", "parts", "chain_id", "parent")


@dataclass
class Manifest:
    """A checkpoint's manifest.json, typed (the on-disk JSON is unchanged: `as_dict` writes
    what `from_dict` reads, and a manifest written by older code, or a minimal one, reads
    with the defaults below).

    `read` checks the file's own checksum and shape first (read_manifest); a malformed
    part raises CorruptCheckpoint naming it."""

    step: int
    tables: dict[str, ManifestTable]
    world_size: int = 0
    next_step: int | None = None
    run_id: str = ""
    mode: str = ""
    row_dtype: str = "fp32"
    optimizer: dict[str, Any] = field(default_factory=dict)
    task: str = ""
    seed: int = 0
    data: dict[str, Any] = field(default_factory=dict)
    created_unix: float = 0.0
    dense: dict[str, Any] | None = None
    pending: PendingEntry | None = None
    parts: tuple[PartEntry, ...] = ()  # () in manifests written before parts
    # the chain (incremental checkpoints, `chain_of`): its id, set by its full checkpoint
    # and kept by every link after it, and this link's parent (None: a full checkpoint)
    chain_id: str = ""
    parent: ParentEntry | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def incremental(self) -> bool:
        return self.parent is not None

    @classmethod
    def read(cls, directory: str | Path) -> Manifest:
        return cls.from_dict(read_manifest(directory))

    def write(self, directory: str | Path) -> None:
        write_manifest(directory, self.as_dict())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Manifest:
        step = data.get("step")
        try:
            tables = {str(name): ManifestTable(
                int(t["num_rows"]), int(t["dim"]),
                tuple(ManifestShard(int(s["rank"]), int(s["row_start"]), int(s["row_end"]),
                                    {k: FileEntry.of(v) for k, v in s.items()
                                     if isinstance(v, Mapping)})
                      for s in t["shards"]),
                {k: v for k, v in t.items() if k not in ("num_rows", "dim", "shards")})
                for name, t in data["tables"].items()}
            pending = data.get("pending")
            return cls(
                step=int(data["step"]), tables=tables,
                world_size=int(data.get("world_size", 0)),
                next_step=None if data.get("next_step") is None else int(data["next_step"]),
                run_id=str(data.get("run_id", "")), mode=str(data.get("mode", "")),
                row_dtype=str(data.get("row_dtype", "fp32")),
                optimizer=dict(data.get("optimizer") or {}), task=str(data.get("task", "")),
                seed=int(data.get("seed", 0)), data=dict(data.get("data") or {}),
                created_unix=float(data.get("created_unix", 0.0)),
                dense=None if data.get("dense") is None else dict(data["dense"]),
                pending=None if pending is None else PendingEntry(
                    int(pending["staleness"]), int(pending["applied_through"]),
                    tuple((int(f["rank"]), FileEntry.of(f)) for f in pending["files"])),
                parts=_parts(data.get("parts")),
                chain_id=str(data.get("chain_id", "")),
                parent=None if data.get("parent") is None else ParentEntry.of(data["parent"]),
                extra={k: v for k, v in data.items()
                       if k not in _MANIFEST_KEYS and k not in ("format", MANIFEST_CHECKSUM)})
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptCheckpoint(f"checkpoint of step {step}: malformed manifest "
                                    f"({type(exc).__name__}: {exc})") from None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {**self.extra, "step": self.step,
                               "tables": {n: t.as_dict() for n, t in self.tables.items()}}
        optional = {"world_size": self.world_size, "next_step": self.next_step,
                    "run_id": self.run_id, "mode": self.mode, "row_dtype": self.row_dtype,
                    "optimizer": self.optimizer, "task": self.task, "seed": self.seed,
                    "data": self.data, "created_unix": self.created_unix, "dense": self.dense,
                    "pending": None if self.pending is None else self.pending.as_dict(),
                    "chain_id": self.chain_id or None,
                    "parent": None if self.parent is None else self.parent.as_dict()}
        out.update({k: v for k, v in optional.items() if v is not None})
        if self.parts:
            out["parts"] = [p.as_dict() for p in self.parts]
        return out

    def part(self, name: str) -> PartEntry | None:
        """The part `name` (None: not recorded, e.g. a manifest written before parts)."""
        return next((p for p in self.parts if p.name == name), None)

    def table(self, name: str) -> ManifestTable:
        entry = self.tables.get(name)
        if entry is None:
            raise NotFound(f"checkpoint of step {self.step} has no table {name!r} "
                           f"(tables: {sorted(self.tables)})")
        return entry

    def shards(self, table: str, kind: str) -> list[ShardInfo]:
        """The `kind` ("rows", "optim", ...) shards of `table`."""
        entry = self.table(table)
        try:
            return [s.info(table, kind) for s in entry.shards]
        except KeyError:
            raise CorruptCheckpoint(f"checkpoint of step {self.step}: a shard of table "
                                    f"{table!r} lists no {kind} file") from None


def manifest_entries(manifest: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Every file entry ({file, bytes, crc32}) a manifest lists, in a fixed order."""
    entries: list[Mapping[str, Any]] = []
    try:
        for _, t in sorted(manifest["tables"].items()):
            for s in t["shards"]:
                entries.extend(s[k] for k in SHARD_FILE_KINDS if k in s)
        if "dense" in manifest:  # DCP files, or one dense.pt in older checkpoints
            dense = manifest["dense"]
            entries.extend(dense.get("files", [dense]))
        if "pending" in manifest:  # the workers' pending updates (worker/checkpoint/)
            entries.extend(manifest["pending"]["files"])
        for part in manifest.get("parts") or ():  # files only a part lists (its own data)
            entries.extend(part["files"])
    except (KeyError, TypeError, AttributeError) as exc:
        raise CorruptCheckpoint(f"checkpoint of step {manifest.get('step')}: malformed "
                                f"manifest ({type(exc).__name__}: {exc})") from None
    return entries


def verify_files(directory: str | Path, manifest: Mapping[str, Any],
                 share: tuple[int, int] = (0, 1)) -> None:
    """Every file the manifest lists exists with its size and crc32 (CorruptCheckpoint
    naming the first that does not). `share` = (i, n): only entries i, i+n, i+2n, ...
    (n ranks verify one checkpoint together)."""
    index, count = share
    for e in manifest_entries(manifest)[index::count]:
        verify_entry(directory, e)


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


# -- chains of incremental checkpoints ------------------------------------------------------
#
# An incremental checkpoint (`Manifest.parent` set) lists, per table and kind ("rows",
# "optim"), delta shards: the rows of each saved range changed since its parent, by global
# row id (save_shard with `ids`); a dynamic table's ids and paged files are deltas of their
# own, composed by hybridps/dynamic_files.py. Every other file (dense, pending, data) is
# whole in every link. A checkpoint is read as its chain composed:
# the newest link whose files of that kind are whole, re-sharded (load_rows), then each
# later link's delta rows in order (`load_table_rows`); since the deltas carry global ids,
# a chain re-shards to any world size like a full checkpoint.

MAX_CHAIN = 100_000


@dataclass(frozen=True)
class Link:
    """One checkpoint of a chain: its directory and manifest."""

    directory: Path
    manifest: Manifest


def chain_of(directory: str | Path, manifest: Manifest | None = None) -> list[Link]:
    """The checkpoints `directory` is composed of, its full checkpoint first, itself last.

    Each parent is checked before it is followed: a bare step directory next to it (no
    symbolic link) of an earlier step, whose manifest.json has the size, crc32 and checksum
    the link recorded and the same run id and chain id. CorruptCheckpoint naming the file
    otherwise: a missing or damaged link makes every checkpoint after it unrestorable,
    and nothing is ever composed of two chains or two runs."""
    link = Link(Path(directory), manifest or Manifest.read(directory))
    out = [link]
    while (parent := link.manifest.parent) is not None:
        here = f"the parent of {link.directory}"
        pdir = link.directory.parent / parent.path
        path = pdir / MANIFEST
        if not STEP_DIR.match(parent.path) or parent.step >= link.manifest.step:
            raise CorruptCheckpoint(f"checkpoint {link.directory}: its parent "
                                    f"{parent.path!r} (step {parent.step}) is not an earlier "
                                    "step directory next to it")
        if pdir.is_symlink():
            raise CorruptCheckpoint(f"checkpoint {pdir} ({here}) is a symbolic link")
        try:
            got = (path.stat().st_size, file_crc32(path))
        except FileNotFoundError:
            raise CorruptCheckpoint(f"checkpoint file {path} ({here}) is missing") from None
        except OSError as exc:
            raise CorruptCheckpoint(f"checkpoint file {path} ({here}) is unreadable: "
                                    f"{exc.strerror or exc}") from None
        if got != (parent.bytes, parent.crc32):
            raise CorruptCheckpoint(f"checkpoint file {path} ({here}) has {got[0]} bytes "
                                    f"and crc32 {got[1]}; the link says {parent.bytes} and "
                                    f"{parent.crc32} (damaged, or another checkpoint)")
        saved = Manifest.read(pdir)
        mine = (parent.step, parent.checksum, link.manifest.run_id, link.manifest.chain_id)
        theirs = (saved.step, str(read_manifest(pdir).get(MANIFEST_CHECKSUM, "")),
                  saved.run_id, saved.chain_id)
        if mine != theirs:
            raise CorruptCheckpoint(f"checkpoint file {path} ({here}) is of step {saved.step}, "
                                    f"run {saved.run_id!r}, chain {saved.chain_id!r}; the link "
                                    f"is of step {parent.step}, run {link.manifest.run_id!r}, "
                                    f"chain {link.manifest.chain_id!r}")
        link = Link(pdir, saved)
        out.append(link)
        if len(out) > MAX_CHAIN:
            raise CorruptCheckpoint(f"checkpoint {directory}: a chain of more than "
                                    f"{MAX_CHAIN} links")
    out.reverse()
    return out


def verify_chain(directory: str | Path, share: tuple[int, int] = (0, 1)) -> list[Link]:
    """Every link of `directory`'s chain (`chain_of`) and every file each lists against its
    size and crc32 (CorruptCheckpoint naming the first that fails); `share` as in
    verify_files, over the files of the whole chain."""
    links = chain_of(directory)
    index, count = share
    entries = [(link.directory, e) for link in links
               for e in manifest_entries(read_manifest(link.directory))]
    for where, e in entries[index::count]:
        verify_entry(where, e)
    return links


def load_table_rows(directory: str | Path, manifest: Manifest, table: str, kind: str,
                    start: int, end: int, names: Sequence[str], *, verify: bool = True,
                    dry_run: bool = False, widths: Mapping[str, int] | None = None,
                    check_meta: Callable[[Mapping[str, Any]], None] | None = None,
                    links: Sequence[Link] | None = None,
                    shape: tuple[int, int] | None = None,
                    ) -> tuple[dict[str, torch.Tensor | None], list[dict[str, Any]]]:
    """load_rows of table `table`'s `kind` files ("rows", "optim") of checkpoint
    `directory`, composed along its chain (the section's doc; `links`: chain_of's, when
    the caller has it). `shape`: the (num_rows, dim) the caller expects (default: the
    manifest's); the files must hold it. The metas returned are those of the newest
    link's files."""
    if links is None:
        links = (chain_of(directory, manifest) if manifest.parent is not None
                 else [Link(Path(directory), manifest)])
    whole = [i for i, link in enumerate(links)
             if not any(s.delta for s in link.manifest.shards(table, kind))]
    if not whole:
        raise CorruptCheckpoint(f"checkpoint {directory}: no link of its chain holds the "
                                f"whole {kind} files of table {table!r}")
    base = links[whole[-1]]
    entry = base.manifest.table(table)
    num_rows, dim = shape or (entry.num_rows, entry.dim)
    out, metas = load_rows(base.directory, table, num_rows, dim,
                           base.manifest.shards(table, kind), start, end, names,
                           verify=verify, dry_run=dry_run, widths=widths,
                           check_meta=check_meta)
    for link in links[whole[-1] + 1:]:
        metas = _apply_deltas(link, table, num_rows, dim, kind, start, end, out,
                              verify=verify, dry_run=dry_run, widths=widths,
                              check_meta=check_meta)
    return out, metas


def _apply_deltas(link: Link, table: str, num_rows: int, dim: int, kind: str, start: int,
                  end: int, out: dict[str, torch.Tensor | None], *, verify: bool,
                  dry_run: bool, widths: Mapping[str, int] | None,
                  check_meta: Callable[[Mapping[str, Any]], None] | None
                  ) -> list[dict[str, Any]]:
    """Copy the rows of [start, end) that `link`'s `kind` shards of `table` hold into `out`."""
    metas: list[dict[str, Any]] = []
    for s in sorted(link.manifest.shards(table, kind), key=lambda s: s.row_start):
        if max(start, s.row_start) >= min(end, s.row_end) and not (start == end and not metas):
            continue
        if verify:
            verify_shards(link.directory, [s])
        path = link.directory / s.file
        data = _read_shard_of(path, path, s, table, num_rows, dim, "its chain has")
        if check_meta is not None:
            check_meta(data["meta"])
        metas.append(dict(data["meta"]))
        ids = data.get("ids") if s.delta else torch.arange(s.row_start, s.row_end)
        if (not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1
                or (ids.numel() and (int(ids.min()) < s.row_start
                                     or int(ids.max()) >= s.row_end))):
            raise CorruptCheckpoint(f"checkpoint file {path}: its row ids are not int64 "
                                    f"ids inside [{s.row_start}, {s.row_end})")
        mine = (ids >= start) & (ids < end)
        at = ids[mine] - start
        for n, dst in out.items():
            saved = data["tensors"].get(n)
            width = (widths or {}).get(n, dim)
            if saved is None or dst is None:
                continue
            if (not isinstance(saved, torch.Tensor) or saved.dtype != torch.float32
                    or tuple(saved.shape) != (ids.numel(), width)):
                raise CorruptCheckpoint(f"checkpoint file {path}: tensor {n!r} is not "
                                        f"float32 [{ids.numel()}, {width}]")
            if not dry_run and at.numel():
                dst.index_copy_(0, at, saved[mine])
    return metas


# -- sparse optimizer state (server partitions and --local-optimizer) ----------------------

@dataclass
class OptimState:
    """The sparse optimizer state of rows [row_start, row_end) of one table."""

    state: dict[str, torch.Tensor | None]  # by the names of the optimizer's state layout
    adam_step: int  # the optimizer's step count (the name from when adam was the only one)
    last_step: int
    # fp32 master rows of a rank with bf16 device rows (None: the rows file is exact)
    master: torch.Tensor | None = None

    @property
    def m(self) -> torch.Tensor | None:
        return self.state.get("m")

    @property
    def v(self) -> torch.Tensor | None:
        return self.state.get("v")


def _widths(optimizer: Mapping[str, Any], dim: int) -> dict[str, int]:
    kind = optimizer.get("kind")
    return dict(state_widths(kind, dim)) if isinstance(kind, str) and is_kind(kind) else {}


def save_optim_state(directory: str | Path, *, table: str, rank: int, num_rows: int, dim: int,
                     row_start: int, row_end: int, state: OptimState,
                     optimizer: Mapping[str, Any], incarnation: int = 0,
                     writer: Writer | None = None, ids: torch.Tensor | None = None
                     ) -> ShardInfo:
    """`optimizer`: dataclasses.asdict of the OptimizerSpec, recorded in the file (a
    restore refuses the state of another optimizer). `ids`: a delta shard of those global
    rows (an incremental checkpoint); `state`'s tensors then hold only them."""
    return save_shard(directory, optim_file(table, rank), kind="optim", table=table, rank=rank,
                      num_rows=num_rows, dim=dim, row_start=row_start, row_end=row_end,
                      tensors={**state.state, "master": state.master},
                      meta={"adam_step": state.adam_step, "last_step": state.last_step,
                            "incarnation": incarnation, "optimizer": dict(optimizer)},
                      widths=_widths(optimizer, dim), writer=writer, ids=ids)


def refuse_other_optimizer(where: str, saved: Mapping[str, Any] | None,
                           running: Mapping[str, Any]) -> None:
    """Conflict, one line naming both, when a checkpoint's optimizer (asdict of its
    OptimizerSpec; None: not recorded) is of another kind than this run's: its state is
    another optimizer's."""
    if saved is None or saved.get("kind") == running.get("kind"):
        return
    raise Conflict(f"{where} was saved with optimizer {describe_saved(saved)}; this run uses "
                   f"{describe_saved(running)}: resume with --optimizer {saved.get('kind')} "
                   "(one optimizer's state does not carry over to another)")


def load_optim_state(directory: str | Path, *, table: str, num_rows: int, dim: int,
                     row_start: int, row_end: int, step: int,
                     optimizer: Mapping[str, Any], master: bool = False, verify: bool = True,
                     dry_run: bool = False) -> OptimState:
    """The optimizer state of rows [row_start, row_end) at checkpoint step `step`, for
    `optimizer` (dataclasses.asdict of this run's OptimizerSpec): Conflict when the files
    hold another optimizer's state.

    `master`: also the fp32 master rows. A checkpoint saved without them (fp32 device
    rows) has its exact rows in the rows files, so they seed the master instead.
    Every file read is checked against the manifest first (`verify`). `dry_run`: every
    check (manifest, files, headers, metadata), no tensor copied: a restore calls it for
    all of a partition's tables before it changes anything.
    """
    manifest = Manifest.read(directory)
    if manifest.step != step:
        raise Conflict(f"checkpoint {directory} is of step {manifest.step}, not {step}")
    widths = _widths(optimizer, dim)
    names = (*widths, *(("master",) if master else ()))

    def same_optimizer(meta: Mapping[str, Any]) -> None:
        saved = meta.get("optimizer")
        refuse_other_optimizer(f"checkpoint {directory} table {table!r}",
                               saved if isinstance(saved, Mapping) else None, optimizer)

    links = chain_of(directory, manifest)
    tensors, metas = load_table_rows(directory, manifest, table, "optim", row_start, row_end,
                                     names, verify=verify, dry_run=dry_run, widths=widths,
                                     check_meta=same_optimizer, links=links,
                                     shape=(num_rows, dim))
    if master and tensors["master"] is None:
        rows, _ = load_table_rows(directory, manifest, table, "rows", row_start, row_end,
                                  ["weight"], verify=verify, dry_run=dry_run, links=links,
                                  shape=(num_rows, dim))
        tensors["master"] = rows["weight"]
    try:
        counts = {int(m["adam_step"]) for m in metas}
        lasts = {int(m["last_step"]) for m in metas}
    except (KeyError, TypeError, ValueError):
        raise CorruptCheckpoint(f"checkpoint {directory} table {table!r}: an optim file's "
                                "metadata lacks adam_step/last_step") from None
    if len(counts) > 1 or lasts - {step}:
        raise Conflict(f"checkpoint {directory} table {table!r}: saved partitions disagree "
                       f"(step counts {sorted(counts)}, last steps {sorted(lasts)}; "
                       f"expected last step {step})")
    missing = [n for n in widths if tensors[n] is None]
    if missing:
        raise Conflict(f"checkpoint {directory} table {table!r} has no optimizer state "
                       f"{', '.join(missing)} (saved with an optimizer without it)")
    adam_step = counts.pop() if counts else step + 1
    return OptimState({n: tensors[n] for n in widths}, adam_step, step, tensors.get("master"))
