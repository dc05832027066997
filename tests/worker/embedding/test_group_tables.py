"""--group-tables: a rank's tables of one width as one unit (worker/embedding/groups.py) give
exactly the results of separate tables, and checkpoints stay per table.

(a) end to end, 2 gloo ranks + a real shard server: grouping on and off give bitwise equal
    rows, dense weights and losses, with one-hot and multi-hot (pooled at the owner, at
    the requester, auto) tables of two widths, --staleness 0 and 1 (with prediction);
(b) checkpoints: written grouped at world size 2, resumed grouped and ungrouped at world
    sizes 2 (bitwise) and 1; written ungrouped, resumed grouped; the files are per table;
(c) the server checks the members it is told (ps/core/table_members.py): a bad one is refused
    with INVALID_ARGUMENT naming the value, and nothing is registered.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridps.checkpoint import read_shard, step_dir
from hybridps.errors import InvalidArgument
from hybridps.optim import OptimizerSpec
from ps.core.partition import TableSpec
from ps.core.store import Store
from ps.core.table_members import MemberSpec
from tests.testing.helpers import PsServer, start_ps_server
from tests.worker.checkpoint.test_checkpoint import assert_states
from worker.embedding.groups import plan_units
from worker.embedding.rows import TableConfig

REPO = Path(__file__).resolve().parents[3]
MAIN = str(REPO / "worker" / "main.py")
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
TABLES = "a:300,b:200:3,c_wide:150,d_wide:120:4,e:50"
GLOBAL_BATCH = 64


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])})
    return env


def run(args: list[str], nproc: int = 2, tables: str = TABLES) -> None:
    common = ["--task", "tests.testing.group_tables_task:TwoWidths", "--tables", tables,
              "--dim", "4", "--batch-size", str(GLOBAL_BATCH // nproc), "--lr", "0.05",
              "--log-every", "1", "--eval-batches", "1", "--progress", "false"]
    cmd = ([sys.executable, "-m", "worker.main"] if nproc == 1 else
           [TORCHRUN, "--standalone", "--nproc_per_node", str(nproc), MAIN])
    proc = subprocess.run([*cmd, *common, *args], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-6000:]


def assert_same(a_dir: Path, b_dir: Path, exact: bool = True) -> None:
    assert_states(a_dir / "state.pt", b_dir / "state.pt", exact=exact)
    if exact:
        ra = json.loads((a_dir / "res.json").read_text())
        rb = json.loads((b_dir / "res.json").read_text())
        resumed_from = rb["loss_curve"][0][0]  # a resumed run logs its steps only
        assert [e for e in ra["loss_curve"] if e[0] >= resumed_from] == rb["loss_curve"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> PsServer:
    with start_ps_server(tmp_path_factory.mktemp("ps")) as ps:
        yield ps


def _train(server: PsServer, out: Path, run_id: str, grouped: bool, *extra: str,
           nproc: int = 2, tables: str = TABLES) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    run(["--ps", server.address, "--run-id", run_id, "--group-tables", str(grouped).lower(),
         "--dump-state", str(out / "state.pt"), "--results", str(out / "res.json"), *extra],
        nproc=nproc, tables=tables)
    return out


# -- (a) the same results ----------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.timeout(600)
@pytest.mark.parametrize("staleness,pool_at,predict,row_dtype", [
    ("0", "auto", False, "fp32"), ("1", "owner", True, "fp32"),
    ("1", "requester", False, "bf16")])
def test_grouping_changes_nothing(server: PsServer, tmp_path: Path, staleness: str,
                                  pool_at: str, predict: bool, row_dtype: str) -> None:
    """bf16 rows: the server's fp32 master of a group is seeded per unit and answers rows."""
    extra = ["--steps", "12", "--staleness", staleness, "--pool-at", pool_at,
             "--row-dtype", row_dtype,
             *(["--staleness-compensation", "predict"] if predict else [])]
    tag = f"s{staleness}-{pool_at}"
    on = _train(server, tmp_path / "on", f"on-{tag}", True, *extra)
    off = _train(server, tmp_path / "off", f"off-{tag}", False, *extra)
    assert_same(on, off)
    res_on = json.loads((on / "res.json").read_text())
    res_off = json.loads((off / "res.json").read_text())
    assert res_on["table_groups"] == {"group-d4": ["a", "b", "e"],
                                      "group-d8": ["c_wide", "d_wide"]}
    assert res_off["table_groups"] == {}
    # the server's stats show a group as its member tables, like separate tables
    for res, run_id in ((res_on, f"on-{tag}"), (res_off, f"off-{tag}")):
        rows = [p for p in res["server_stats"]["partitions"] if p["run_id"] == run_id]
        assert sorted((p["table"], p["rank"]) for p in rows) == sorted(
            (t, r) for t in ("a", "b", "c_wide", "d_wide", "e") for r in (0, 1))
        assert all(p["pushes_applied"] == 12 for p in rows)
    stats = {(p["table"], p["rank"]): p for p in res_off["server_stats"]["partitions"]
             if p["run_id"] == f"off-{tag}"}
    for p in res_on["server_stats"]["partitions"]:
        if p["run_id"] == f"on-{tag}":
            same = stats[(p["table"], p["rank"])]
            for key in ("row_start", "row_end", "rows_held", "state_bytes", "rows_updated",
                        "distinct_rows_touched", "last_step"):
                assert p[key] == same[key], (p["table"], key)
    assert res_on["sync"]["pushes"] == res_off["sync"]["pushes"] == 12 * 5
    curve = [v for _, v in res_on["loss_curve"]]
    assert curve[0] != curve[-1]


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_grouping_changes_nothing_local_optimizer_and_a_lone_table(tmp_path: Path) -> None:
    """--local-optimizer, bf16 rows (fp32 masters per unit), a table alone in its width."""
    tables = "a:300,b:200:3,solo_wide:40"
    outs = []
    for grouped in (True, False):
        out = tmp_path / str(grouped)
        out.mkdir()
        run(["--local-optimizer", "--group-tables", str(grouped).lower(), "--steps", "10",
             "--staleness", "1", "--row-dtype", "bf16", "--dump-state", str(out / "state.pt"),
             "--results", str(out / "res.json")], tables=tables)
        outs.append(out)
    assert_same(*outs)
    res = json.loads((outs[0] / "res.json").read_text())
    assert res["table_groups"] == {"group-d4": ["a", "b"]}


# -- (b) checkpoints stay per table -------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_checkpoints_are_per_table_and_reshard(server: PsServer, tmp_path: Path) -> None:
    common = ["--staleness", "1", "--staleness-compensation", "predict", "--pool-at", "owner"]
    straight = _train(server, tmp_path / "straight", "straight", True, "--steps", "20",
                      *common)
    ck = tmp_path / "ck"
    _train(server, tmp_path / "first", "first", True, "--steps", "10",
           "--checkpoint-every", "10", "--checkpoint-dir", str(ck), *common)
    saved = step_dir(ck, 9)
    manifest = json.loads((saved / "manifest.json").read_text())
    assert set(manifest["tables"]) == {"a", "b", "c_wide", "d_wide", "e"}
    for table, rows in (("a", 300), ("d_wide", 120)):
        for rank in (0, 1):
            rows_file = read_shard(saved / f"rows/{table}.r{rank:05d}.pt")
            optim = read_shard(saved / f"optim/{table}.r{rank:05d}.pt")
            lo, hi = rank * rows // 2, (rank + 1) * rows // 2
            assert (rows_file["row_start"], rows_file["row_end"]) == (lo, hi)
            assert (optim["row_start"], optim["row_end"]) == (lo, hi)
            assert optim["tensors"]["m"].shape[0] == hi - lo
            assert optim["meta"]["adam_step"] == 10 and optim["meta"]["last_step"] == 9
    for grouped, nproc in ((True, 2), (False, 2), (True, 1)):
        out = _train(server, tmp_path / f"resume-{grouped}-{nproc}", f"resume-{grouped}-{nproc}",
                     grouped, "--steps", "20", "--resume-from", str(saved),
                     "--checkpoint-dir", str(tmp_path / f"ck-{grouped}-{nproc}"), *common,
                     nproc=nproc)
        assert_same(straight, out, exact=nproc == 2)
    # a checkpoint of an ungrouped run resumes grouped, bitwise
    ck_off = tmp_path / "ck_off"
    _train(server, tmp_path / "first_off", "first-off", False, "--steps", "10",
           "--checkpoint-every", "10", "--checkpoint-dir", str(ck_off), *common)
    out = _train(server, tmp_path / "off-on", "off-on", True, "--steps", "20",
                 "--resume-from", str(step_dir(ck_off, 9)),
                 "--checkpoint-dir", str(tmp_path / "ck-off-on"), *common)
    assert_same(straight, out)


# -- (c) the server checks the members ------------------------------------------------------

def _group(members: tuple[MemberSpec, ...], rows: int = 30, start: int = 0,
           end: int = 30) -> TableSpec:
    return TableSpec("group-d4", rows, 4, start, end, members)


GOOD = (MemberSpec("a", 20, 0, 20, 0), MemberSpec("b", 10, 0, 10, 20))


@pytest.mark.parametrize("spec,named", [
    (_group((MemberSpec("a/b", 20, 0, 20, 0), GOOD[1])), "'a/b'"),
    (_group((MemberSpec("a", 0, 0, 0, 0), MemberSpec("b", 30, 0, 30, 0))), "num_rows=0"),
    (_group((GOOD[0], MemberSpec("b", 10, 0, 10, 19))), "offset=19"),
    (_group((GOOD[0], MemberSpec("b", 10, 0, 11, 20))), "[0, 11)"),
    (_group((GOOD[0], MemberSpec("a", 10, 0, 10, 20))), "'a' appears twice"),
    (_group(GOOD, rows=31, end=31), "hold 30 rows"),
    (_group(GOOD, rows=40), "sum to 30"),
])
def test_server_refuses_bad_members(spec: TableSpec, named: str) -> None:
    store = Store()
    with pytest.raises(InvalidArgument, match=named.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)")):
        store.register("run", 0, 1, 0, [spec], OptimizerSpec())
    assert store.partitions() == []


def test_server_refuses_a_member_named_like_a_table() -> None:
    store = Store()
    with pytest.raises(InvalidArgument, match="'a' appears twice"):
        store.register("run", 0, 1, 0, [_group(GOOD), TableSpec("a", 5, 2, 0, 5)],
                       OptimizerSpec())
    assert store.partitions() == []
    store.register("run", 0, 1, 0, [_group(GOOD)], OptimizerSpec())
    assert [t.spec.members for p in store.partitions() for t in p.tables.values()] == [GOOD]


def test_units_are_rank_major() -> None:
    """Member t's global row x on rank r is unit row S_r + offset_t + (x - start_t)."""
    tables = [TableConfig("a", 10, 4), TableConfig("b", 7, 4), TableConfig("w", 5, 8)]
    units = [plan_units(tables, r, 3, True) for r in range(3)]
    assert [list(u) for u in units] == [["group-d4", "w"]] * 3
    spans = [(u["group-d4"].start, u["group-d4"].end) for u in units]
    assert spans == [(0, 5), (5, 10), (10, 17)]  # tiles the 17 rows of the group
    g = units[1]["group-d4"]
    b = g.members[1]
    assert (b.start, b.end, b.offset) == (2, 4, 3)
    ids = torch.tensor([2, 3])
    assert g.to_unit_ids(b, ids).tolist() == [8, 9]
    assert g.to_table_ids(b, g.to_unit_ids(b, ids)).tolist() == [2, 3]
    assert not units[0]["w"].grouped and units[0]["w"].name == "w"
    assert list(plan_units(tables, 0, 1, False)) == ["a", "b", "w"]


def test_one_block_and_one_gradient_per_width() -> None:
    """World size 1: the tables of one width are one weight, looked up with one gather and
    popped as one gradient in unit row ids; rows, gradients and whole tables equal the
    separate tables'."""
    from worker.embedding.sharded import ShardedEmbedding

    tables = [TableConfig("a", 10, 4), TableConfig("b", 7, 4), TableConfig("w", 5, 8)]
    grouped = ShardedEmbedding(tables, seed=3, group_tables=True)
    plain = ShardedEmbedding(tables, seed=3)
    assert list(grouped.weights) == ["group-d4", "w"] and list(plain.weights) == ["a", "b", "w"]
    ids_a, ids_b = torch.tensor([[1, 9], [1, 0]]), torch.tensor([6, 2, 2])
    offsets = torch.tensor([0, 1])
    out = {}
    for name, emb in (("grouped", grouped), ("plain", plain)):
        rows_a, bags_b = emb.lookup_many(["a", "b"], [ids_a, ids_b], [None, (offsets, "sum")])
        rows_w = emb.lookup("w", torch.tensor([4, 4]))
        (rows_a.pow(2).sum() + 3 * bags_b.sum() + rows_w.sum()).backward()
        out[name] = (rows_a, bags_b, rows_w, emb.pop_grads())
    for x, y in zip(out["grouped"][:3], out["plain"][:3], strict=True):
        assert torch.equal(x, y)
    grads = out["grouped"][3]
    assert list(grads) == ["group-d4", "w"]
    ids_U, grads_UD = grads["group-d4"]
    assert ids_U.tolist() == [0, 1, 9, 12, 16]  # a's rows 0, 1, 9; b's 2, 6 at offset 10
    plain_grads = out["plain"][3]
    assert torch.equal(grads_UD, torch.cat([plain_grads["a"][1], plain_grads["b"][1]]))
    assert torch.equal(grads["w"][1], plain_grads["w"][1])
    grouped.apply_update("group-d4", ids_U, grads_UD, 0.5)
    plain.apply_update("a", plain_grads["a"][0], plain_grads["a"][1], 0.5)
    plain.apply_update("b", plain_grads["b"][0], plain_grads["b"][1], 0.5)
    full_g, full_p = grouped.gather_full(), plain.gather_full()
    assert full_g is not None and full_p is not None
    assert all(torch.equal(full_g[t], full_p[t]) for t in ("a", "b", "w"))
    assert full_g["b"].untyped_storage().nbytes() == 7 * 4 * 4  # its own rows, not the block
    assert grouped.device_bytes() == plain.device_bytes()
    assert grouped.groups() == {"group-d4": ["a", "b"]} and plain.groups() == {}


@pytest.mark.e2e
def test_bad_members_over_grpc_are_invalid_argument(server: PsServer) -> None:
    """Through the real server: INVALID_ARGUMENT naming the value, nothing registered; a
    good group registers and its stats rows are its member tables."""
    import grpc

    from hybridps.admin import get_shard_stats
    from hybridps.v1 import shard_pb2
    from tests.testing.grpc_helpers import open_channel, register, shard_stub, table

    stub = shard_stub(open_channel(server.address))
    group = table("group-d4", 30, 4, 0, 30)
    group.members.extend([shard_pb2.TableMember(name="a", num_rows=20, row_end=20),
                          shard_pb2.TableMember(name="b", num_rows=10, row_end=10, offset=7)])
    with pytest.raises(grpc.RpcError) as err:
        register(stub, "bad-members", [group])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "offset=7" in str(err.value.details())
    assert not [p for p in get_shard_stats(server.address).partitions
                if p.run_id == "bad-members"]
    group.members[1].offset = 20
    register(stub, "good-members", [group])
    rows = [p for p in get_shard_stats(server.address).partitions
            if p.run_id == "good-members"]
    assert [(p.table, p.row_start, p.row_end, p.rows_held) for p in rows] == [
        ("a", 0, 20, 20), ("b", 0, 10, 10)]
