"""The server's trust rules over the wire, against real servers (port 0): another run's
checkpoints not overwritten, an idle partition not rolled back without the run secret;
unused registrations freed without stopping an --exit-after-run server; the per-run
state cap; `ps.admin stats` with the admin token alone; a wrong secret in the run's
refusals column; a re-sent step with another payload; a checkpoint directory outside
the root, refused at Register by a real worker."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from hybridps.admin import format_shard_stats, get_shard_stats
from hybridps.checkpoint import complete_checkpoints, optim_file, step_dir, write_manifest
from hybridps.partition_secret import partition_metadata, run_secret_metadata
from hybridps.run_secret import claim_directory
from hybridps.v1 import shard_pb2
from tests.testing.grpc_helpers import (
    ADAM,
    assemble,
    open_channel,
    push_messages,
    register,
    secret_metadata,
    shard_stub,
    table,
)
from tests.testing.helpers import REPO, PsServer, start_ps_server
from tests.worker.checkpoint.test_checkpoint import COMMON, _env, worker_cmd

pytestmark = pytest.mark.e2e

VICTIM, INTRUDER = "1a" * 32, "2b" * 32  # run secrets (hybridps/run_secret.py)
ADMIN_TOKEN = "admin-token-0123456789abcdef"
SPEC = [table("emb", 10, 4, 0, 10)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PsServer]:
    base = tmp_path_factory.mktemp("trust-wire")
    (base / "root").mkdir()
    srv = start_ps_server(base, "--checkpoint-root", str(base / "root"),
                          "--stats-without-token")
    yield srv
    srv.terminate()


def _root(server: PsServer) -> Path:
    return server.directory.parent / "root"


def _push(stub: Any, run: str, step: int, grads: torch.Tensor | None = None,
          metadata: Any = None) -> list[shard_pb2.SyncResponse]:
    grads = torch.full((2, 4), float(step + 1)) if grads is None else grads
    return list(stub.Sync(iter(push_messages(run, step, "emb", torch.tensor([1, 7]), grads)),
                          timeout=30, metadata=metadata))


def _complete_checkpoint(stub: Any, run: str, directory: Path, step: int) -> None:
    reply = stub.Checkpoint(shard_pb2.CheckpointRequest(run_id=run, step=step,
                                                        directory=str(directory)), timeout=30)
    f = reply.files[0]
    entry = {"file": f.file, "bytes": f.bytes, "crc32": f.crc32}
    write_manifest(directory, {"step": step, "world_size": 1, "tables": {"emb": {
        "num_rows": 10, "dim": 4, "shards": [{"rank": 0, "row_start": 0, "row_end": 10,
                                              "rows": entry, "optim": entry}]}}})


def _code(call: Any, *args: Any, **kwargs: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        result = call(*args, **kwargs)
        if not hasattr(result, "SerializeToString"):
            list(result)
    return info.value


def test_another_runs_checkpoints_cannot_be_overwritten(server: PsServer) -> None:
    """The campaign's hole 1: a third party registers its own run with the victim's table
    and asks for a checkpoint into the victim's complete checkpoint directory; and into
    a root-only directory of the root, directly and through a planted link."""
    root = _root(server)
    with open_channel(server.address) as victim_ch, open_channel(server.address) as other_ch:
        victim, other = shard_stub(victim_ch), shard_stub(other_ch)
        claim_directory(root / "victim-ck", prefer=VICTIM)
        register(victim, "victim", SPEC, run_secret=VICTIM)
        _push(victim, "victim", 0)
        target = step_dir(root / "victim-ck", 0)
        _complete_checkpoint(victim, "victim", target, 0)
        before = (target / optim_file("emb", 0)).read_bytes()
        register(other, "intruder", SPEC, run_secret=INTRUDER)  # named like the victim's
        _push(other, "intruder", 0, torch.full((2, 4), 9.0))
        private = root / "private"
        private.mkdir(mode=0o700)
        (root / "planted").symlink_to(private)
        for directory in (str(target), str(step_dir(root / "victim-ck", 5)),
                          "private/x/step-0000000000", "private/step-0000000000",
                          "planted/step-0000000000", "planted/x/step-0000000000"):
            err = _code(other.Checkpoint, shard_pb2.CheckpointRequest(
                run_id="intruder", step=0, directory=directory), timeout=30)
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED, (directory, err)
        assert (target / optim_file("emb", 0)).read_bytes() == before
        assert [s for s, _ in complete_checkpoints(root / "victim-ck")] == [0]
        assert list(private.iterdir()) == []
        stats = get_shard_stats(server.address, run_id="intruder").partitions[0]
        assert stats.refusals["permission_denied"] == 6  # in the run's refusals


def test_an_idle_partition_is_not_rolled_back_without_the_run_secret(
        server: PsServer) -> None:
    """The campaign's hole 3: once no stream was open, a Register without any secret that
    restored an older checkpoint was accepted (the live run's partition went back from
    step 200 to 49 and its next push was refused)."""
    root = _root(server)
    claim_directory(root / "live-ck", prefer=VICTIM)
    with open_channel(server.address) as owner_ch, \
            open_channel(server.address, carry_secrets=False) as other_ch:
        owner, other = shard_stub(owner_ch), shard_stub(other_ch)
        register(owner, "live", SPEC, run_secret=VICTIM,
                 checkpoint_dir=str(root / "live-ck"))
        for step in range(2):
            _push(owner, "live", step)
        _complete_checkpoint(owner, "live", step_dir(root / "live-ck", 1), 1)
        for step in range(2, 6):
            _push(owner, "live", step)  # every stream closed: the partition is idle
        rollback = shard_pb2.RegisterRequest(
            run_id="live", rank=0, world_size=1, incarnation=99, tables=SPEC, optimizer=ADAM,
            restore=shard_pb2.RestoreFrom(directory=str(step_dir(root / "live-ck", 1)),
                                          step=1))
        for metadata in ((), run_secret_metadata(INTRUDER), run_secret_metadata("", VICTIM),
                         partition_metadata("live", 0, "f" * 32)):
            err = _code(other.Register, rollback, timeout=30, metadata=metadata)
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED, (metadata, err)
        row = get_shard_stats(server.address, run_id="live").partitions[0]
        assert (row.last_step, row.incarnation) == (5, 0)
        assert _push(owner, "live", 6)  # the owner goes on
        # A restarted rank of the job (no partition secret, the run secret from its
        # checkpoint directory) may roll it back: that is what --resume does.
        other.Register(rollback, timeout=30, metadata=run_secret_metadata(VICTIM))
        row = get_shard_stats(server.address, run_id="live").partitions[0]
        assert (row.last_step, row.incarnation) == (1, 99)


def test_a_resent_step_with_another_payload_is_refused(server: PsServer) -> None:
    with open_channel(server.address) as ch:
        stub = shard_stub(ch)
        register(stub, "resend", SPEC)
        (first,) = assemble(_push(stub, "resend", 0))
        (again,) = assemble(_push(stub, "resend", 0))  # a true re-send: the saved answer
        assert again[5] and not first[5]
        assert torch.equal(again[3], first[3])
        err = _code(_push, stub, "resend", 0, torch.full((2, 4), 5.0))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
        assert "step 0 was applied with another payload" in (err.details() or "")
        assert _push(stub, "resend", 1)


def test_a_wrong_secret_shows_in_the_runs_refusals_column(server: PsServer) -> None:
    with open_channel(server.address) as owner_ch, \
            open_channel(server.address, carry_secrets=False) as other_ch:
        register(shard_stub(owner_ch), "refused-run", SPEC)
        other = shard_stub(other_ch)
        for rank in (0, -1):
            err = _code(other.Flush, shard_pb2.FlushRequest(run_id="refused-run", rank=rank,
                                                            step=0), timeout=30,
                        metadata=partition_metadata("refused-run", 0, "f" * 32))
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert _code(other.Sync, iter(push_messages("refused-run", 0, "emb",
                                                    torch.tensor([1]), torch.ones(1, 4))),
                     timeout=30, metadata=partition_metadata("refused-run", 0, "f" * 32)
                     ).code() == grpc.StatusCode.PERMISSION_DENIED
    stats = get_shard_stats(server.address, run_id="refused-run")
    row = next(line for line in format_shard_stats(stats).splitlines()
               if line.startswith("refused-run"))
    assert row.endswith("wrong_secret=3"), row


def test_admin_stats_with_the_admin_token_alone(tmp_path: Path) -> None:
    """With --admin-token-file and no auth token, `ps.admin stats` with
    HYBRIDPS_ADMIN_TOKEN failed with "missing token"."""
    token_file = tmp_path / "admin-token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    token_file.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    srv = start_ps_server(tmp_path, "--admin-token-file", str(token_file), env=env)
    try:
        cli = [sys.executable, "-m", "ps.admin", "stats", "--ps", srv.address]
        refused = subprocess.run(cli, cwd=REPO, env=env, capture_output=True, text=True,
                                 timeout=60, check=False)
        assert refused.returncode == 1 and "missing token" in refused.stderr
        for extra, args in (({"HYBRIDPS_ADMIN_TOKEN": ADMIN_TOKEN}, []),
                            ({}, ["--admin-token-file", str(token_file)])):
            done = subprocess.run(cli + args, cwd=REPO, env={**env, **extra},
                                  capture_output=True, text=True, timeout=60, check=False)
            assert done.returncode == 0, done.stderr
            assert "(no partitions registered)" in done.stdout
    finally:
        srv.terminate()


def test_unused_registrations_are_freed_and_do_not_end_an_exit_after_run_server(
        tmp_path: Path) -> None:
    """The campaign's hole 2: registrations that never open a stream held their memory
    for ever, and later Registers were refused for lack of budget. Now they are freed
    after --unused-registration-timeout-s, logged, and that is no run's end: an
    --exit-after-run server keeps serving until a real run is over."""
    per_row = 2 + 8 * 4  # bytes of one row of dim 4 (m, v, touched and changed flags)
    srv = start_ps_server(tmp_path, "--unused-registration-timeout-s", "3",
                          "--exit-after-run", "--max-state-bytes", str(1000 * per_row),
                          "--max-run-state-bytes", str(700 * per_row))
    try:
        with open_channel(srv.address) as ch:
            stub = shard_stub(ch)
            register(stub, "hog", [table("emb", 1200, 4, 0, 600)], world_size=2)
            err = _code(register, stub, "hog", [table("emb", 1200, 4, 600, 800)], rank=1,
                        world_size=2)
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-run-state-bytes" in (err.details() or "")
            err = _code(register, stub, "real", [table("emb", 500, 4, 0, 500)])
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-state-bytes" in (err.details() or "")
            deadline = time.monotonic() + 60
            while "event=registration_expired" not in srv.stderr():
                assert time.monotonic() < deadline, srv.stderr()[-3000:]
                assert srv.proc.poll() is None, srv.stderr()[-3000:]
                time.sleep(0.2)
            time.sleep(1.0)  # a stop would have begun by now
            assert srv.proc.poll() is None, "the expiry stopped the --exit-after-run server"
            assert "run=hog" in srv.stderr() and "stop_requested" not in srv.stderr()
            assert not get_shard_stats(srv.address).partitions
            register(stub, "real", [table("emb", 500, 4, 0, 500)])  # fits now
            list(stub.Sync(iter(push_messages("real", 0, "emb", torch.tensor([3]),
                                              torch.ones(1, 4))), timeout=30))
            stub.Finish(shard_pb2.FinishRequest(run_id="real", rank=0, last_step=0),
                        timeout=30, metadata=secret_metadata(srv.address, "real", 0))
        assert srv.proc.wait(timeout=60) == 0  # the real run's end stops it
        assert "--exit-after-run: run real is over" in srv.stderr()
    finally:
        srv.terminate()


def test_a_checkpoint_dir_outside_the_root_is_refused_at_register(tmp_path: Path) -> None:
    """A worker stops at Register, before training, with one line naming the directory
    and the root (not at the first checkpoint, after --checkpoint-every steps, with a
    partial step directory left)."""
    root = tmp_path / "root"
    root.mkdir()
    srv = start_ps_server(tmp_path, "--checkpoint-root", str(root))
    outside = tmp_path / "outside"
    try:
        proc = subprocess.run(
            worker_cmd([*COMMON, "--batch-size", "32", "--ps", srv.address, "--steps", "40",
                        "--run-id", "outside-run", "--checkpoint-every", "20",
                        "--checkpoint-dir", str(outside)], 1),
            cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300, check=False)
    finally:
        srv.terminate()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, proc.stderr[-3000:]
    line = errors[0]
    assert line.startswith("hybridps worker: error:"), line
    assert str(outside) in line and str(root) in line and "--checkpoint-root" in line
    assert "samples/s" not in proc.stdout  # no step trained
    assert not list(outside.glob("step-*"))
