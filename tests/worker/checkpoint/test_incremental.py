"""Incremental checkpoints (--checkpoint-mode incremental): chains of delta links.

- unit: a chain of delta shards composes to the full rows at any row range (another world
  size); a damaged, missing or foreign link is refused naming its file; the server writes
  only the rows whose state changed since its last checkpoint, and restores a chain at
  another world size; --checkpoint-keep removes only the links no kept point needs;
- end to end (a real server, real ranks): a resume from an incremental checkpoint equals
  the straight run bitwise at --staleness 0, 1, 2, with static and with dynamic tables;
  at another world size it is the same run up to float rounding; a damaged link makes
  --resume fall back to the newest intact point, naming the file; export of a chain
  equals export of a full checkpoint; an incremental checkpoint after few rows are
  touched writes far fewer bytes than a full one.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridps.checkpoint import (
    Manifest,
    ManifestShard,
    ManifestTable,
    ParentEntry,
    ShardInfo,
    chain_of,
    complete_checkpoints,
    load_optim_state,
    load_table_rows,
    save_shard,
    step_dir,
    verify_chain,
)
from hybridps.errors import Conflict, CorruptCheckpoint
from hybridps.optim import OptimizerSpec
from ps.core.store import Store
from tests.testing.helpers import PsServer
from tests.worker.checkpoint.test_checkpoint import REPO, _env, _push, assert_states, run
from worker.checkpoint.checkpointer import prune
from worker.checkpoint.parts import file_entry

N, D = 20, 3


def _link(directory: Path, step: int, shards: list[ShardInfo], parent: Path | None = None,
          *, chain: str = "chain-a", run_id: str = "run") -> Path:
    """A checkpoint of table "t" ([N, D]) with `shards` as its rows files."""
    table = ManifestTable(N, D, tuple(ManifestShard(s.rank, s.row_start, s.row_end,
                                                    {"rows": file_entry(s)}) for s in shards))
    Manifest(step=step, tables={"t": table}, world_size=2, run_id=run_id, chain_id=chain,
             parent=None if parent is None else ParentEntry.describe(parent)).write(directory)
    return directory


def _rows(directory: Path, rank: int, lo: int, hi: int, weight: torch.Tensor,
          ids: torch.Tensor | None = None) -> ShardInfo:
    return save_shard(directory, f"rows/t.r{rank:05d}.pt", kind="rows", table="t", rank=rank,
                      num_rows=N, dim=D, row_start=lo, row_end=hi,
                      tensors={"weight": weight}, ids=ids)


def _chain(tmp_path: Path) -> tuple[list[Path], list[torch.Tensor]]:
    """A full checkpoint at world 2 (rows [0, 10) and [10, 20)), then two delta links;
    and the rows each composes to."""
    rows = torch.randn(N, D)
    full = step_dir(tmp_path, 3)
    _link(full, 3, [_rows(full, 0, 0, 10, rows[:10]), _rows(full, 1, 10, 20, rows[10:])])
    dirs, states = [full], [rows.clone()]
    for step, changed in ((7, [[3, 7], [12]]), (11, [[7], [15, 19]])):
        d = step_dir(tmp_path, step)
        shards = []
        for rank, (lo, ids) in enumerate(zip((0, 10), changed, strict=True)):
            ids_t = torch.tensor(ids)
            rows[ids_t] = torch.randn(len(ids), D)
            shards.append(_rows(d, rank, lo, lo + 10, rows[ids_t], ids_t))
        dirs.append(_link(d, step, shards, parent=dirs[-1]))
        states.append(rows.clone())
    return dirs, states


def test_a_chain_composes_to_the_full_rows_at_any_range(tmp_path: Path) -> None:
    dirs, states = _chain(tmp_path)
    newest, want = dirs[-1], states[-1]
    assert [link.manifest.step for link in chain_of(newest)] == [3, 7, 11]
    verify_chain(newest)
    manifest = Manifest.read(newest)
    assert manifest.incremental and manifest.parent is not None
    assert manifest.parent.step == 7 and manifest.parent.path == dirs[1].name
    for lo, hi in [(0, N), (0, 7), (7, 14), (14, N), (5, 5)]:  # three readers, one empty
        got, metas = load_table_rows(newest, manifest, "t", "rows", lo, hi, ["weight"])
        assert torch.equal(got["weight"], want[lo:hi]), (lo, hi)
        assert metas  # the newest link's files were read
    for d, rows in zip(dirs, states, strict=True):  # each link: the rows of its step
        got, _ = load_table_rows(d, Manifest.read(d), "t", "rows", 0, N, ["weight"])
        assert torch.equal(got["weight"], rows), d.name
    assert not torch.equal(states[1], states[2])


def test_a_damaged_missing_or_foreign_link_is_refused_naming_its_file(tmp_path: Path
                                                                       ) -> None:
    dirs, _ = _chain(tmp_path)
    delta = dirs[1] / "rows" / "t.r00000.pt"
    data = bytearray(delta.read_bytes())
    data[-20] ^= 0xFF
    delta.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint, match=str(delta)):
        verify_chain(dirs[2])  # the newest is intact itself: its link is not
    verify_chain(dirs[0])  # the full checkpoint before it is still a restorable point
    # another checkpoint of the parent's step (another chain) is never composed with it
    parent = Manifest.read(dirs[1])
    dataclasses.replace(parent, created_unix=parent.created_unix + 1).write(dirs[1])
    with pytest.raises(CorruptCheckpoint, match=str(dirs[1] / "manifest.json")):
        chain_of(dirs[2])
    (dirs[1] / "manifest.json").unlink()
    with pytest.raises(CorruptCheckpoint, match=f"{dirs[1] / 'manifest.json'}.*missing"):
        chain_of(dirs[2])
    # a link naming a parent of another chain or another run
    for chain, run_id in (("chain-b", "run"), ("chain-a", "other-run")):
        full = step_dir(tmp_path / chain / run_id, 3)
        _link(full, 3, [_rows(full, 0, 0, 10, torch.zeros(10, D)),
                        _rows(full, 1, 10, 20, torch.zeros(10, D))])  # chain-a, run
        d = step_dir(full.parent, 9)
        one = torch.zeros(1, D)
        _link(d, 9, [_rows(d, 0, 0, 10, one, torch.tensor([1])),
                     _rows(d, 1, 10, 20, one, torch.tensor([11]))], chain=chain,
              run_id=run_id, parent=full)
        with pytest.raises(CorruptCheckpoint, match=f"{full / 'manifest.json'}.*(chain|run)"):
            chain_of(d)


def test_keep_removes_only_the_links_no_kept_point_needs(tmp_path: Path) -> None:
    # chains 1 <- 3 <- 5 <- 7 and 9 <- 11 <- 13 <- 15 (one chain id each)
    for step in range(1, 16, 2):
        full = step in (1, 9)
        d = step_dir(tmp_path, step)
        d.mkdir(parents=True)
        Manifest(step=step, tables={}, run_id="run", chain_id="a" if step < 9 else "b",
                 parent=None if full else ParentEntry.describe(step_dir(tmp_path, step - 2))
                 ).write(d)
    step_dir(tmp_path, 8).mkdir()  # torn, older than the newest: removed too
    steps = lambda: [s for s, _ in complete_checkpoints(tmp_path)]  # noqa: E731
    assert prune(tmp_path, 5) == [step_dir(tmp_path, 8)]  # 7's chain needs 1, 3, 5
    assert steps() == [1, 3, 5, 7, 9, 11, 13, 15]
    prune(tmp_path, 2)  # 13 and 15 need 9 and 11
    assert steps() == [9, 11, 13, 15]
    assert prune(tmp_path, 1) == []  # 15 needs all of them
    assert prune(tmp_path, 0) == []  # 0: keep all


def test_the_server_writes_only_the_changed_rows_and_restores_a_chain(tmp_path: Path
                                                                      ) -> None:
    opt = OptimizerSpec()
    store = Store()
    from ps.core.partition import TableSpec

    for rank, (lo, hi) in enumerate([(0, 5), (5, 10)]):
        store.register("run", rank, 2, 0, [TableSpec("t", 10, 4, lo, hi)], opt)
    for step in range(3):
        _push(store, 0, step, [0, 3, 4][: step + 1])
        _push(store, 1, step, [9, 5][: step + 1])
    full, inc = step_dir(tmp_path, 2), step_dir(tmp_path, 4)
    saved = {2: store.checkpoint("run", [], 2, str(full))}
    with pytest.raises(Conflict, match="since step 1"):
        store.checkpoint("run", [], 2, str(inc), since=1)  # not its last checkpoint
    for step in (3, 4):
        _push(store, 0, step, [3])
        _push(store, 1, step, [9])
    saved[4] = store.checkpoint("run", [], 4, str(inc), since=2)
    assert all(not i.delta for _, i in saved[2]) and all(i.delta for _, i in saved[4])
    deltas = {r: torch.load(inc / i.file, weights_only=True) for r, i in saved[4]}
    assert deltas[0]["ids"].tolist() == [3] and deltas[1]["ids"].tolist() == [9]

    def manifest(step: int, parent: Path | None) -> Manifest:
        shards = tuple(ManifestShard(r, i.row_start, i.row_end, {"optim": file_entry(i)})
                       for r, i in saved[step])
        return Manifest(step=step, tables={"t": ManifestTable(10, 4, shards)}, world_size=2,
                        run_id="run", chain_id="c",
                        parent=None if parent is None else ParentEntry.describe(parent))

    manifest(2, None).write(full)
    manifest(4, full).write(inc)
    held = {r: store.partition("run", r).tables["t"] for r in (0, 1)}  # type: ignore
    m_now = torch.cat([held[r].m for r in (0, 1)])
    v_now = torch.cat([held[r].v for r in (0, 1)])
    asdict = dataclasses.asdict(opt)
    for lo, hi in [(0, 3), (3, 6), (6, 10)]:
        got = load_optim_state(inc, table="t", num_rows=10, dim=4, row_start=lo, row_end=hi,
                               step=4, optimizer=asdict)
        assert got.adam_step == 5 and got.last_step == 4
        assert torch.equal(got.state["m"], m_now[lo:hi]) and torch.equal(got.state["v"],
                                                                         v_now[lo:hi])
    new = Store()
    for rank, (lo, hi) in enumerate([(0, 3), (3, 6), (6, 10)]):
        new.register("run", rank, 3, 5, [TableSpec("t", 10, 4, lo, hi)], opt,
                     restore=(str(inc), 4))
        t = new.partition("run", rank).tables["t"]  # type: ignore[union-attr]
        assert torch.equal(t.m, m_now[lo:hi]) and torch.equal(t.v, v_now[lo:hi])


def test_checkpoint_mode_flags_validate() -> None:
    from hybridps.cli import parse_config
    from worker.config.train_config import TrainConfig

    cfg = parse_config(TrainConfig, ["--checkpoint-mode", "full", "--checkpoint-full-every",
                                     "4"], environ={"HYBRIDPS_LOCAL_OPTIMIZER": "1"})
    assert (cfg.checkpoint.checkpoint_mode, cfg.checkpoint.checkpoint_full_every) == (
        "full", 4)
    defaults = TrainConfig.of(local_optimizer=True).checkpoint
    assert (defaults.checkpoint_mode, defaults.checkpoint_full_every) == ("incremental", 10)
    for kwargs, named in [({"checkpoint_full_every": 0}, "checkpoint_full_every=0"),
                          ({"checkpoint_mode": "delta"}, "checkpoint_mode='delta'")]:
        with pytest.raises(ValueError, match=named):
            TrainConfig.of(local_optimizer=True, **kwargs)


# -- end to end ---------------------------------------------------------------------------

def _manifest(ck: Path, step: int) -> dict:
    return json.loads((step_dir(ck, step) / "manifest.json").read_text())


CHAIN = ["--steps", "16", "--checkpoint-every", "4"]  # 3 (full) <- 7 <- 11 <- 15


@pytest.fixture(scope="module")
def stale_runs(server: PsServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """--staleness 2, 2 ranks: 16 steps without checkpoints, with incremental ones, and
    with full ones."""
    d = tmp_path_factory.mktemp("inc-k2")
    ps = ["--ps", server.address, "--staleness", "2", *CHAIN]
    run(["--ps", server.address, "--staleness", "2", "--steps", "16", "--run-id", "inc-plain",
         "--dump-state", str(d / "plain.pt")])
    run([*ps, "--run-id", "inc-ck", "--checkpoint-dir", str(d / "ck"),
         "--dump-state", str(d / "ck.pt")])
    run([*ps, "--run-id", "inc-full", "--checkpoint-mode", "full", "--checkpoint-dir",
         str(d / "full"), "--dump-state", str(d / "full.pt")])
    return d


@pytest.mark.e2e
@pytest.mark.timeout(900)
@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_incremental_resume_is_bitwise(server: PsServer, stale_runs: Path, tmp_path: Path,
                                       staleness: int) -> None:
    if staleness == 2:
        d = stale_runs
        assert_states(d / "plain.pt", d / "ck.pt", exact=True)  # checkpoints change nothing
        assert_states(d / "plain.pt", d / "full.pt", exact=True)
    else:
        d = tmp_path
        run(["--ps", server.address, "--staleness", str(staleness), *CHAIN, "--run-id",
             f"inc-ck{staleness}", "--checkpoint-dir", str(d / "ck"),
             "--dump-state", str(d / "ck.pt")])
    ck = d / "ck"
    assert _manifest(ck, 3).get("parent") is None
    assert [_manifest(ck, s)["parent"]["step"] for s in (7, 11, 15)] == [3, 7, 11]
    assert {_manifest(ck, s)["chain_id"] for s in (3, 7, 11, 15)} == {_manifest(ck, 3)[
        "chain_id"]}
    out = tmp_path / "resumed.pt"
    run(["--ps", server.address, "--staleness", str(staleness), "--steps", "16", "--run-id",
         f"inc-resumed{staleness}", "--resume-from", str(step_dir(ck, 11)),
         "--checkpoint-dir", str(tmp_path / "ck2"), "--dump-state", str(out)])
    assert_states(d / "ck.pt", out, exact=True)


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_a_chain_resumes_at_another_world_size(server: PsServer, stale_runs: Path) -> None:
    out = stale_runs / "resumed3.pt"
    run(["--ps", server.address, "--staleness", "2", "--steps", "16", "--run-id",
         "inc-resumed3", "--resume-from", str(step_dir(stale_runs / "ck", 11)),
         "--checkpoint-dir", str(stale_runs / "ck3"), "--dump-state", str(out)], nproc=3)
    assert_states(stale_runs / "plain.pt", out, exact=False)


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_a_damaged_link_falls_back_to_the_newest_intact_point(server: PsServer,
                                                              stale_runs: Path,
                                                              tmp_path: Path) -> None:
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(stale_runs / "ck", ck)
    damaged = step_dir(ck, 7) / "rows" / "user.r00001.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    out = tmp_path / "fallback.pt"
    proc = run(["--ps", server.address, "--staleness", "2", "--steps", "16", "--run-id",
                "inc-fallback", "--resume", "--checkpoint-dir", str(ck), "--dump-state",
                str(out)])
    log = proc.stdout + proc.stderr
    for step in (15, 11, 7):  # each needs the damaged link: skipped, naming the file
        assert f"checkpoint {step_dir(ck, step).resolve()} is damaged" in log
    assert str(damaged.resolve()) in log
    assert f"resuming from {step_dir(ck, 3).resolve()} (step 3)" in log
    assert_states(stale_runs / "plain.pt", out, exact=True)
    with pytest.raises(AssertionError, match="damaged"):  # --resume-from the link: refused
        run(["--ps", server.address, "--staleness", "2", "--steps", "16", "--run-id",
             "inc-refused", "--resume-from", str(step_dir(ck, 15)), "--checkpoint-dir",
             str(tmp_path / "other")])


def _export(checkpoint: Path, out: Path) -> dict[str, torch.Tensor]:
    subprocess.run([sys.executable, "-m", "worker.export", "--checkpoint", str(checkpoint),
                    "--out", str(out)], cwd=REPO, env=_env(), check=True, capture_output=True,
                   timeout=120)
    return torch.load(out)


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_export_of_a_chain_equals_export_of_a_full_checkpoint(stale_runs: Path,
                                                              tmp_path: Path) -> None:
    assert _manifest(stale_runs / "full", 15).get("parent") is None
    for step in (7, 15):
        chain = _export(step_dir(stale_runs / "ck", step), tmp_path / f"chain{step}.pt")
        full = _export(step_dir(stale_runs / "full", step), tmp_path / f"full{step}.pt")
        assert set(chain) == set(full)
        for key, value in full.items():
            assert torch.equal(chain[key], value), (step, key)


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_dynamic_tables_resume_bitwise_from_a_chain(server: PsServer, tmp_path: Path) -> None:
    from tests.worker.embedding.dynamic.test_dynamic_e2e import TABLES, export, same_tables
    from tests.worker.embedding.dynamic.test_dynamic_e2e import run as run_dynamic

    ps = ["--ps", server.address, "--tables", TABLES, "--staleness", "2", "--steps", "20"]
    run_dynamic([*ps, "--run-id", "dyn-inc-plain", "--dump-state", str(tmp_path / "plain.pt")],
                nproc=2)
    run_dynamic([*ps, "--run-id", "dyn-inc-ck", "--checkpoint-every", "4", "--checkpoint-dir",
                 str(tmp_path / "ck"), "--dump-state", str(tmp_path / "ck.pt")], nproc=2)
    ck = tmp_path / "ck"
    assert [_manifest(ck, s)["parent"]["step"] for s in (7, 11, 15, 19)] == [3, 7, 11, 15]
    same_tables(tmp_path / "plain.pt", tmp_path / "ck.pt")
    run_dynamic([*ps, "--run-id", "dyn-inc-resumed", "--resume-from", str(step_dir(ck, 15)),
                 "--checkpoint-dir", str(tmp_path / "ck2"), "--dump-state",
                 str(tmp_path / "resumed.pt")], nproc=2)
    same_tables(tmp_path / "plain.pt", tmp_path / "resumed.pt")
    # the chain's export equals the resumed run's full checkpoint of the same step
    run_dynamic([*ps, "--run-id", "dyn-inc-full", "--checkpoint-every", "4",
                 "--checkpoint-mode", "full", "--checkpoint-dir", str(tmp_path / "full")],
                nproc=2)
    chain = export(step_dir(ck, 19), tmp_path / "chain.pt")
    full = export(step_dir(tmp_path / "full", 19), tmp_path / "full.pt")
    assert set(chain) == set(full)
    for key, value in full.items():
        assert torch.equal(chain[key], value), key


def _part_bytes(directory: Path) -> dict[str, int]:
    manifest = json.loads((directory / "manifest.json").read_text())
    out = {"rows": 0, "optim": 0}
    for table in manifest["tables"].values():
        for shard in table["shards"]:
            for kind in out:
                out[kind] += shard[kind]["bytes"]
    return out


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_an_incremental_checkpoint_writes_what_changed(server: PsServer, tmp_path: Path
                                                       ) -> None:
    """200,000 rows a table, 2 steps between checkpoints: the second checkpoint's rows and
    optimizer files are a small fraction of the first's (full) ones."""
    ck = tmp_path / "ck"
    run(["--ps", server.address, "--run-id", "inc-bytes", "--num-rows", "200000",
         "--steps", "4", "--checkpoint-every", "2", "--checkpoint-dir", str(ck),
         "--results", str(tmp_path / "r.json")], nproc=1)
    full, inc = _part_bytes(step_dir(ck, 1)), _part_bytes(step_dir(ck, 3))
    assert _manifest(ck, 3)["parent"]["step"] == 1
    for kind in ("rows", "optim"):
        assert inc[kind] * 20 < full[kind], (kind, inc, full)
    written = json.loads((tmp_path / "r.json").read_text())["checkpoint"]["written"]
    assert [w["kind"] for w in written] == ["full", "incremental"]
    assert written[1]["bytes"] * 5 < written[0]["bytes"], written
