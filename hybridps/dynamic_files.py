"""A dynamic table's checkpoint files and their re-sharding (docs/dynamic_ids.md).

Next to the rows and optim files of its slots (the format of a static table's rows), a
dynamic table's shard lists two more files per saving rank:

    ids/<table>.r<rank>.pt    written by the worker: per slot of the range, its id, the
                              last step it was seen (-1: free) and its frequency; the ids
                              paged out; the admission state (a count-min sketch)
    paged/<table>.r<rank>.pt  written by whoever holds the paged-out rows (the shard
                              server, or the worker under --local-optimizer):
                              hybridps/paged_rows.py's state_dict

`restore_plan` reads them for a rank at any world size: an id goes to its owner at the
new world size (hybridps/dynamic.py `owner_of_ids`; a table-wise table's to the rank that
holds all its slots, `whole_on`); it keeps its slot when its new
owner holds that slot, and otherwise starts paged out on its new owner (its row from
the rows file, its optimizer state from the optim file, both at its old slot). At the
saving world size every id stays where it was: the resume is exact.

In an incremental checkpoint (a link of a chain, hybridps/checkpoint.py) both are delta
shards: SlotTable.delta_state_dict (the slots looked up since the parent) and
PagedRows.checkpoint_state (the entries stored since, the ids that left, the new
tombstones). `restore_plan` composes each saving rank's files along the chain, from its
newest whole file, before it re-shards.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridps.checkpoint import (
    Link,
    Manifest,
    ShardInfo,
    Writer,
    chain_of,
    load_table_rows,
    save_torch,
    torch_save,
    verify_shards,
)
from hybridps.dynamic import owner_of_ids, whole_on
from hybridps.errors import CorruptCheckpoint
from hybridps.paged_rows import PagedOut, PagedRows, compose_paged, concat_paged

IDS_FORMAT = "hybridps-dynamic-ids-v1"
ROWS_KEY = "weight"


def ids_file(table: str, rank: int) -> str:
    return f"ids/{table}.r{rank:05d}.pt"


def paged_file(table: str, rank: int) -> str:
    return f"paged/{table}.r{rank:05d}.pt"


def _info(directory: Path, rel: str, table: str, rank: int, start: int, end: int,
          payload: Mapping[str, Any], writer: Writer | None = None) -> ShardInfo:
    body = dict(payload)
    saved = (save_torch(directory / rel, body) if writer is None
             else writer(rel, lambda f: torch_save(body, f)))
    return ShardInfo(table, rank, start, end, rel, saved["bytes"], saved["crc32"],
                     delta="since" in body)


def _as_torch(obj: Any) -> Any:
    """numpy arrays (in dicts and lists) as tensors: the file then loads weights_only."""
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj))
    if isinstance(obj, Mapping):
        return {k: _as_torch(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_as_torch(v) for v in obj]
    return obj


def save_ids(directory: str | Path, *, table: str, rank: int, start: int, end: int,
             state: Mapping[str, Any], step: int) -> ShardInfo:
    """The worker's slot map of rows [start, end) (worker/embedding/dynamic/slots.py
    state_dict, or delta_state_dict: a delta shard)."""
    return _info(Path(directory), ids_file(table, rank), table, rank, start, end,
                 _as_torch({**state, "ids_format": IDS_FORMAT, "step": step}))


def save_paged(directory: str | Path, *, table: str, rank: int, start: int, end: int,
               store: PagedRows, step: int, writer: Writer | None = None) -> ShardInfo:
    """A dynamic table's paged-out rows (through `writer` when given: the shard server's,
    ps/core/checkpoint_dirs.py)."""
    return save_paged_state(directory, table=table, rank=rank, start=start, end=end,
                            state=store.state_dict(), step=step, writer=writer)


def save_paged_state(directory: str | Path, *, table: str, rank: int, start: int, end: int,
                     state: Mapping[str, Any], step: int,
                     writer: Writer | None = None) -> ShardInfo:
    """`save_paged` of a store's `state_dict()` or `checkpoint_state()` taken before (a
    snapshot; a delta's is a delta shard)."""
    return _info(Path(directory), paged_file(table, rank), table, rank, start, end,
                 {**state, "step": step}, writer)


def _load(directory: Path, info: ShardInfo, what: str) -> dict[str, Any]:
    path = directory / info.file
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CorruptCheckpoint(f"checkpoint file {path} ({what}) is unreadable: "
                                f"{type(exc).__name__}: {exc}") from None
    if not isinstance(data, dict):
        raise CorruptCheckpoint(f"checkpoint file {path} is not a {what} file")
    return data


@dataclass
class DynamicRestore:
    """What one rank restores of a dynamic table: its slots (local arrays, seen < 0 free),
    the ids it holds paged out (with rows and state), their tombstones, the admission
    states to load, and which local slots kept their saved id (the optimizer state of
    the others is zeroed)."""

    slot_id: np.ndarray
    seen: np.ndarray
    freq: np.ndarray
    paged: PagedOut
    tombstones: tuple[np.ndarray, np.ndarray]
    admission: list[dict[str, Any]] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)

    @property
    def kept(self) -> np.ndarray:
        return self.seen >= 0


def restore_plan(directory: str | Path, manifest: Manifest, table: str, dim: int,
                 layout: Sequence[tuple[str, int]], rank: int, world: int, start: int,
                 end: int, *, verify: bool = True) -> DynamicRestore:
    """The module doc's re-shard for rank `rank` of `world` holding slots [start, end)."""
    directory = Path(directory)
    entry = manifest.table(table)
    ids_infos = manifest.shards(table, "ids")
    paged_infos = manifest.shards(table, "paged")
    links = (chain_of(directory, manifest) if manifest.parent is not None
             else [Link(directory, manifest)])
    n = end - start
    slot_id = np.zeros(n, dtype=np.int64)
    seen = np.full(n, -1, dtype=np.int64)
    freq = np.zeros(n, dtype=np.int64)
    moved: list[PagedOut] = []
    admission: list[dict[str, Any]] = []
    # the saving layout (world size and this rank's slots): every id stays where it was
    same_world = manifest.world_size == world and any(
        (i.rank, i.row_start, i.row_end) == (rank, start, end) for i in ids_infos)
    owner_rank = whole_on(rank, world, start, end, entry.num_rows)
    for info in ids_infos:
        data, s_ids, s_seen, s_freq = _composed_ids(links, table, info, verify)
        if not same_world or info.rank == rank:
            admission.append(dict(data.get("admission", {})))
        used = np.flatnonzero(s_seen >= 0)
        owner = owner_of_ids(torch.from_numpy(s_ids[used]), world, owner_rank).numpy()
        glob = used + info.row_start
        mine = used[owner == rank]
        here = mine[(glob[owner == rank] >= start) & (glob[owner == rank] < end)]
        local = here + info.row_start - start
        slot_id[local], seen[local], freq[local] = s_ids[here], s_seen[here], s_freq[here]
        away = np.setdiff1d(mine, here)
        if away.size:
            moved.append(_rows_at(directory, manifest, table, dim, layout, info,
                                  away, s_ids, s_seen, s_freq))
    paged: list[PagedOut] = []
    tomb_ids, tomb_steps = [], []
    counters: dict[str, int] = {}
    for info in paged_infos:
        entries, tombs, saved_counters = _composed_paged(links, table, info, verify)
        mine_t = owner_of_ids(entries.ids, world, owner_rank) == rank
        paged.append(PagedOut(entries.ids[mine_t], entries.rows[mine_t],
                              {k: v[mine_t] for k, v in entries.state.items()},
                              entries.seen[mine_t], entries.freq[mine_t]))
        tomb_mine = owner_of_ids(torch.from_numpy(tombs[0]), world,
                                 owner_rank).numpy() == rank
        tomb_ids.append(tombs[0][tomb_mine])
        tomb_steps.append(tombs[1][tomb_mine])
        if same_world and info.rank == rank:
            counters = saved_counters
    del entry
    return DynamicRestore(slot_id, seen, freq, concat_paged([*moved, *paged], dim, layout),
                          (np.concatenate(tomb_ids) if tomb_ids else np.empty(0, np.int64),
                           np.concatenate(tomb_steps) if tomb_steps
                           else np.empty(0, np.int64)), admission, counters)


def _chain_files(links: Sequence[Link], table: str, kind: str, info: ShardInfo,
                 verify: bool, what: str) -> list[tuple[dict[str, Any], str]]:
    """The `kind` file of the saving rank and range of `info` in each link, from the newest
    whole one (a delta shard holds what changed since its link's parent), loaded, oldest
    first, with the path of each."""
    found: list[tuple[Path, ShardInfo]] = []
    for link in reversed(links):
        mine = [i for i in link.manifest.shards(table, kind)
                if (i.rank, i.row_start, i.row_end) == (info.rank, info.row_start,
                                                        info.row_end)]
        if not mine:
            raise CorruptCheckpoint(f"checkpoint {link.directory}: no {kind} file of table "
                                    f"{table!r} rank {info.rank} rows [{info.row_start}, "
                                    f"{info.row_end}) (its chain's newest link has one)")
        found.append((link.directory, mine[0]))
        if not mine[0].delta:
            break
    else:
        raise CorruptCheckpoint(f"checkpoint {links[-1].directory}: no link of its chain "
                                f"holds the whole {kind} file of table {table!r} rank "
                                f"{info.rank}")
    out = []
    for where, got in reversed(found):
        if verify:
            verify_shards(where, [got])
        out.append((_load(where, got, what), str(where / got.file)))
    return out


def _composed_ids(links: Sequence[Link], table: str, info: ShardInfo, verify: bool
                  ) -> tuple[dict[str, Any], np.ndarray, np.ndarray, np.ndarray]:
    """(the newest ids file, and its range's slot ids, steps seen and frequencies composed
    along the chain: the whole file's, then each delta's slots over them)."""
    files = _chain_files(links, table, "ids", info, verify, "dynamic ids")
    n = info.row_end - info.row_start
    arrays: list[np.ndarray] = []
    for data, path in files:
        if data.get("ids_format") != IDS_FORMAT:
            raise CorruptCheckpoint(f"checkpoint file {path} is not a {IDS_FORMAT} file")
        try:
            got = [np.asarray(data[k], dtype=np.int64) for k in ("slot_id", "seen", "freq")]
            if "since" not in data:
                arrays = got
            else:
                slot = np.asarray(data["slot"], dtype=np.int64)
                if slot.size and (int(slot.min()) < 0 or int(slot.max()) >= n):
                    raise ValueError(f"slots outside [0, {n})")
                for dst, values in zip(arrays, got, strict=True):
                    dst[slot] = values
                if int((arrays[1] >= 0).sum()) != int(data["used"]):
                    raise ValueError(f"composed with its chain it has "
                                     f"{int((arrays[1] >= 0).sum())} used slots; the map "
                                     f"had {int(data['used'])}")
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptCheckpoint(f"checkpoint file {path}: {exc}") from None
        if any(a.size != n for a in arrays):
            raise CorruptCheckpoint(f"checkpoint file {path}: {arrays[0].size} slots for "
                                    f"rows [{info.row_start}, {info.row_end})")
        arrays = [a.copy() for a in arrays]
    return files[-1][0], arrays[0], arrays[1], arrays[2]


def _composed_paged(links: Sequence[Link], table: str, info: ShardInfo, verify: bool
                    ) -> tuple[PagedOut, tuple[np.ndarray, np.ndarray], dict[str, int]]:
    files = _chain_files(links, table, "paged", info, verify, "paged rows")
    try:
        return compose_paged(files)
    except ValueError as exc:
        raise CorruptCheckpoint(f"checkpoint file {exc}") from None


def _rows_at(directory: Path, manifest: Manifest, table: str, dim: int,
             layout: Sequence[tuple[str, int]], info: ShardInfo, local: np.ndarray,
             s_ids: np.ndarray, s_seen: np.ndarray, s_freq: np.ndarray) -> PagedOut:
    """The saved rows and optimizer state of slots `local` of the range `info` saved."""
    num_rows = manifest.table(table).num_rows
    lo, hi = info.row_start, info.row_end
    rows, _ = load_table_rows(directory, manifest, table, "rows", lo, hi, [ROWS_KEY],
                              verify=False, shape=(num_rows, dim))
    names = [n for n, _ in layout]
    state, _ = (load_table_rows(directory, manifest, table, "optim", lo, hi, names,
                                verify=False, shape=(num_rows, dim)) if names else ({}, []))
    at = torch.from_numpy(local)
    weight = rows[ROWS_KEY]
    assert weight is not None
    got_state: dict[str, torch.Tensor] = {}
    for name, width in layout:
        t = state.get(name)
        got_state[name] = (torch.zeros(local.size, width) if t is None
                           else t.index_select(0, at))
    return PagedOut(torch.from_numpy(s_ids[local]), weight.index_select(0, at), got_state,
                    torch.from_numpy(s_seen[local]), torch.from_numpy(s_freq[local]))


@dataclass
class LiveRows:
    """Every live id of a dynamic table in a checkpoint (on a slot or paged out), sorted
    by id: its row and the last step it was looked up in; and the tombstones (ids dropped
    from the paged store, with the step) of ids that are not live again."""

    ids: torch.Tensor
    rows: torch.Tensor
    seen: torch.Tensor
    tomb_ids: torch.Tensor
    tomb_steps: torch.Tensor


def live_rows(directory: str | Path, manifest: Manifest, table: str) -> LiveRows:
    """For export (worker/export.py): the checkpoint read as by one rank holding all."""
    entry = manifest.table(table)
    plan = restore_plan(directory, manifest, table, entry.dim, (), 0, 1, 0, entry.num_rows)
    rows, _ = load_table_rows(directory, manifest, table, "rows", 0, entry.num_rows,
                              [ROWS_KEY])
    weight = rows[ROWS_KEY]
    assert weight is not None
    kept = torch.from_numpy(np.flatnonzero(plan.kept))
    ids = torch.cat([torch.from_numpy(plan.slot_id).index_select(0, kept), plan.paged.ids])
    order = torch.argsort(ids)
    tomb_ids = torch.from_numpy(plan.tombstones[0])
    tomb_steps = torch.from_numpy(plan.tombstones[1])
    dead = ~torch.isin(tomb_ids, ids)
    return LiveRows(ids[order],
                    torch.cat([weight.index_select(0, kept), plan.paged.rows])[order],
                    torch.cat([torch.from_numpy(plan.seen).index_select(0, kept),
                               plan.paged.seen])[order],
                    tomb_ids[dead], tomb_steps[dead])
