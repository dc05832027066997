"""A shared checkpoint root (mode 1777): another user may add files to it, but gains no
right to the run directories of others in it (ps/core/checkpoint_dirs.py, "A claim").

An owner file counts only when the same user owns it and its directory, and it claims
that directory alone, never one below it that is another's; below a claimed run
directory the server writes only into directories of the run's user or its own. These
tests need root: they make files of another user (chown, or a child process of user
nobody: tests/testing/other_user.py)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from hybridps.checkpoint import optim_file, step_dir
from hybridps.errors import PermissionDenied
from hybridps.run_secret import (
    OWNER_FILE,
    SECRET_FILE,
    RunClaimError,
    claim_directory,
    owner_bytes,
    secret_digest,
)
from hybridps.v1 import shard_pb2
from ps.core.store import Store
from tests.ps.core.test_partition import ADAM, EMB, SMALL
from tests.ps.core.test_trust_runs import INTRUDER, VICTIM, _train, _tree
from tests.testing.grpc_helpers import open_channel, push_messages, register, shard_stub, table
from tests.testing.helpers import start_ps_server
from tests.testing.other_user import nobody, run_as

NOBODY = nobody()

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or NOBODY is None,
                                reason="needs root (files of another user) and user nobody")


def _uid() -> int:
    assert NOBODY is not None
    return NOBODY.pw_uid


def _chown_nobody(path: Path) -> None:
    assert NOBODY is not None
    os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid, follow_symlinks=False)


def _shared_root(base: Path) -> tuple[Path, Path]:
    """(a mode-1777 root, the victim's run directory in it: root's, 0755, claimed)."""
    root = base / "root"
    root.mkdir()
    root.chmod(0o1777)
    victim = root / "victim"
    victim.mkdir(mode=0o755)
    claim_directory(victim, prefer=VICTIM)
    return root, victim


def _intruder_claims(directory: Path) -> None:
    """What user nobody can do in a 1777 directory: add an owner file of its own run."""
    owner = directory / OWNER_FILE
    owner.write_bytes(owner_bytes(secret_digest(INTRUDER)))
    _chown_nobody(owner)


def test_an_owner_file_in_a_shared_root_claims_nothing(tmp_path: Path) -> None:
    """The attack: the intruder's owner file in the root, and a Checkpoint naming the
    victim's run directory as its step directory; the server (root) used to create
    victim/optim/emb.r00000.pt, where the intruder itself cannot write."""
    root, victim = _shared_root(tmp_path)
    _intruder_claims(root)
    store = Store(checkpoint_root=root)
    _train(store, "intruder", INTRUDER)
    before = _tree(victim)
    claimed_by_nobody = rf"claimed by no run: its {OWNER_FILE} belongs to uid {_uid()}"
    with pytest.raises(PermissionDenied, match=claimed_by_nobody):
        store.checkpoint("intruder", [], 2, str(victim))
    for directory in (victim / "optim", step_dir(victim, 2)):  # the victim's claim
        with pytest.raises(PermissionDenied, match="belongs to another run"):
            store.checkpoint("intruder", [], 2, str(directory))
    with pytest.raises(PermissionDenied, match=claimed_by_nobody):  # nor at Register
        store.register("intruder-2", 1, 2, 0, [EMB, SMALL], ADAM, run_secret=INTRUDER,
                       checkpoint_dir=str(root))
    with pytest.raises(PermissionDenied, match=claimed_by_nobody):  # nor for a restore
        store.register("intruder-2", 1, 2, 0, [EMB, SMALL], ADAM, run_secret=INTRUDER,
                       restore=(str(victim), 2))
    assert _tree(victim) == before
    assert sorted(p.name for p in victim.iterdir()) == [OWNER_FILE, SECRET_FILE]


def test_below_a_claim_only_the_runs_or_the_servers_directories(tmp_path: Path) -> None:
    """A run directory of nobody's, claimed by nobody: the server (root) writes into its
    step directories of nobody's and into those it made itself, not into one of a third
    user's (uid 1)."""
    root = tmp_path / "root"
    root.mkdir()
    run_dir = root / "run"
    run_dir.mkdir()
    _chown_nobody(run_dir)
    _intruder_claims(run_dir)
    store = Store(checkpoint_root=root)
    _train(store, "run", INTRUDER)
    mine = step_dir(run_dir, 2)
    mine.mkdir()
    _chown_nobody(mine)
    store.checkpoint("run", [], 2, str(mine))  # the run user's step directory
    assert (mine / optim_file("emb", 1)).is_file()
    assert (mine / "optim").stat().st_uid == os.geteuid()  # made by the server
    store.checkpoint("run", [], 2, str(mine))  # again: into the server's optim/
    store.checkpoint("run", [], 2, str(step_dir(run_dir, 3)))  # one the server makes
    for where in ("step", "optim"):
        other = step_dir(run_dir, 7 if where == "step" else 8)
        (other / "optim").mkdir(parents=True)
        os.chown(other if where == "step" else other / "optim", 1, 1)
        before = _tree(other)
        with pytest.raises(PermissionDenied, match="belongs to uid 1, neither to the run's"):
            store.checkpoint("run", [], 2, str(other))
        assert _tree(other) == before and list((other / "optim").iterdir()) == []


def test_a_worker_claims_no_directory_of_another_user(tmp_path: Path) -> None:
    """The worker's side (hybridps/run_secret.py): refused with nothing written, as the
    servers would refuse the claim."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    _chown_nobody(theirs)
    with pytest.raises(RunClaimError, match=rf"belongs to uid {_uid()}, not to this user"):
        claim_directory(theirs, prefer=VICTIM)
    assert list(theirs.iterdir()) == []
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    _intruder_claims(mixed)
    with pytest.raises(RunClaimError, match="claimed by no run"):
        claim_directory(mixed, prefer=INTRUDER)
    assert sorted(p.name for p in mixed.iterdir()) == [OWNER_FILE]
    ours = tmp_path / "ours"  # a directory of one's own is claimed as before
    assert claim_directory(ours, prefer=VICTIM) == VICTIM


@pytest.fixture
def shared_base() -> Iterator[Path]:
    """A directory user nobody can reach (pytest's own is root's, mode 0700)."""
    base = Path(tempfile.mkdtemp(prefix="hybridps-shared-root-"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _as_the_intruder(root: Path, victim: Path, owner: bytes) -> dict[str, str]:
    """User nobody's moves in the shared root: its owner file there, its own run
    directory; and (the control) a file of its own in the victim's directory."""
    try:
        with open(victim / "by-intruder", "w") as f:
            f.write("x")
        direct = "written"
    except PermissionError:
        direct = "denied"
    with open(root / OWNER_FILE, "wb") as f:
        f.write(owner)
    os.mkdir(root / "intruder-own", 0o755)
    with open(root / "intruder-own" / OWNER_FILE, "wb") as f:
        f.write(owner)
    return {"direct_write": direct}


def _checkpoint(stub: object, directory: str) -> tuple[str, str]:
    try:
        stub.Checkpoint(shard_pb2.CheckpointRequest(  # type: ignore[attr-defined]
            run_id="intruder", step=1, directory=directory), timeout=30)
    except grpc.RpcError as exc:
        return exc.code().name, exc.details() or ""
    return "OK", ""


@pytest.mark.e2e
def test_an_unprivileged_client_cannot_make_the_server_write_into_a_victims_directory(
        shared_base: Path) -> None:
    """A server of root's, a 1777 root, and user nobody claiming the root: Checkpoint
    with the victim's run directory as the step directory, and a Register naming the
    root, are PERMISSION_DENIED; the intruder's own run directory is fine."""
    assert NOBODY is not None
    root, victim = _shared_root(shared_base)
    before = _tree(victim)
    moves = run_as(NOBODY, lambda: _as_the_intruder(
        root, victim, owner_bytes(secret_digest(INTRUDER))))
    assert moves == {"direct_write": "denied"}  # the intruder itself cannot write there
    assert (root / OWNER_FILE).stat().st_uid == _uid()
    emb = [table("emb", 10, 4, 0, 10)]
    with start_ps_server(shared_base, "--checkpoint-root", str(root)) as server, \
            open_channel(server.address) as channel:
        stub = shard_stub(channel)
        register(stub, "intruder", emb, run_secret=INTRUDER)
        for step in range(2):
            list(stub.Sync(iter(push_messages("intruder", step, "emb", torch.tensor([1, 7]),
                                              torch.ones(2, 4))), timeout=30))
        code, details = _checkpoint(stub, str(victim))
        assert code == "PERMISSION_DENIED", details
        assert f"claimed by no run: its {OWNER_FILE} belongs to uid {_uid()}" in details
        with pytest.raises(grpc.RpcError) as info:
            register(stub, "intruder", emb, run_secret=INTRUDER, checkpoint_dir=str(root))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "claimed by no run" in (info.value.details() or "")
        assert _checkpoint(stub, str(root / "intruder-own" / "step-0000000001")) == ("OK", "")
    assert _tree(victim) == before
    assert sorted(p.name for p in victim.iterdir()) == [OWNER_FILE, SECRET_FILE]
