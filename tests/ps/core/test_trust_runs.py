"""The transport-free server core's run rules: checkpoints are the run's own, no takeover
without proof, nothing holds server memory without using it, the refusals column, and a
re-sent step with another payload.

- a run writes checkpoint files only into a directory its run secret claimed
  (hybridps/run_secret.py), never into another run's, never over a complete checkpoint,
  never through a symbolic link, and the server creates no directory above the step;
- a partition with state is taken over (restored) only with the run's secret, and one
  registered without any never moves back; a restore reads only a directory of the
  caller's run (or restore) secret;
- a Register naming a checkpoint directory outside the root, or one the run did not
  claim, is refused at once;
- runs that registered and never opened a stream are freed after the unused timeout,
  without being "over"; one run's state is capped by --max-run-state-bytes;
- a wrong secret counts in the partition's refusals; a re-sent step with another payload
  is refused naming it, a true re-send gets the saved answer.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import torch

from hybridps import native
from hybridps.checkpoint import MANIFEST, optim_file, step_dir, write_manifest
from hybridps.errors import Conflict, PermissionDenied, ResourceExhausted, WrongSecret
from hybridps.push_checks import digest_lanes, payload_digest
from hybridps.run_secret import (
    OWNER_FILE,
    SECRET_FILE,
    RunClaimError,
    claim_directory,
    read_owner,
    read_secret,
    secret_digest,
)
from ps.core.lifecycle import RunTracker
from ps.core.maintenance import RunReaper
from ps.core.partition import TableSpec
from ps.core.store import Store
from tests.ps.core.test_partition import ADAM, DIM, EMB, RUN, SMALL, feed, push

VICTIM, INTRUDER = "1a" * 32, "2b" * 32  # run secrets


def _store(root: Path, **kwargs: object) -> Store:
    root.mkdir(exist_ok=True)
    return Store(checkpoint_root=root, **kwargs)  # type: ignore[arg-type]


def _train(store: Store, run: str, secret: str, steps: int = 3) -> None:
    """Ranks 0 and 1 of a 2-rank run (rank 1: EMB, SMALL) through step `steps` - 1."""
    emb0, small0 = TableSpec("emb", 20, DIM, 0, 10), TableSpec("small", 5, 2, 3, 5)
    store.register(run, 0, 2, 0, [emb0, small0], ADAM, run_secret=secret)
    store.register(run, 1, 2, 0, [EMB, SMALL], ADAM, run_secret=secret)
    for step in range(steps):
        for rank, ids, small in ((0, [1, 4], [3]), (1, [11, 15], [0, 2])):
            feed(store, push(step, ids, run=run, rank=rank))
            feed(store, push(step, small, table="small", dim=2, run=run, rank=rank))


def _complete(store: Store, run: str, directory: Path, step: int) -> None:
    """Checkpoint `run` into `directory` and write its manifest (a complete checkpoint)."""
    files = store.checkpoint(run, [], step, str(directory))
    tables = {}
    for name, num_rows, dim in (("emb", 20, DIM), ("small", 5, 2)):
        shards = [{"rank": r, "row_start": i.row_start, "row_end": i.row_end,
                   "rows": {"file": i.file, "bytes": i.bytes, "crc32": i.crc32},
                   "optim": {"file": i.file, "bytes": i.bytes, "crc32": i.crc32}}
                  for r, i in files if i.table == name]
        tables[name] = {"num_rows": num_rows, "dim": dim, "shards": shards}
    write_manifest(directory, {"step": step, "world_size": 2, "tables": tables})


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


# -- the run secret and its claim ----------------------------------------------------------

def test_claiming_a_directory_keeps_its_secret_private_and_its_digest_readable(
        tmp_path: Path) -> None:
    ck = tmp_path / "a" / "ck"
    secret = claim_directory(ck)
    assert len(secret) == 64 and read_secret(ck) == secret
    assert stat.S_IMODE((ck / SECRET_FILE).stat().st_mode) == 0o600
    assert stat.S_IMODE((ck / OWNER_FILE).stat().st_mode) == 0o644
    assert read_owner(ck) == secret_digest(secret) and secret not in (ck / OWNER_FILE).read_text()
    assert claim_directory(ck, prefer=INTRUDER) == secret  # the one kept there wins
    fresh = tmp_path / "fresh"
    assert claim_directory(fresh, prefer=VICTIM) == VICTIM  # a resume adopts its source's


def test_a_directory_of_another_run_or_with_a_link_cannot_be_claimed(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    claim_directory(ck, prefer=VICTIM)
    (ck / SECRET_FILE).unlink()
    with pytest.raises(RunClaimError, match="belongs to another run"):
        claim_directory(ck, prefer=INTRUDER)  # the owner file still names the victim
    assert not (ck / SECRET_FILE).exists()  # nothing written
    assert claim_directory(ck, prefer=VICTIM) == VICTIM  # the run itself (its resume)
    linked = tmp_path / "linked"
    linked.mkdir()
    (tmp_path / "elsewhere").write_text(INTRUDER + "\n")
    (linked / SECRET_FILE).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(RunClaimError, match="cannot read the run secret"):
        claim_directory(linked)


# -- checkpoints are the run's own ----------------------------------------------------------

def test_a_checkpoint_into_another_runs_directory_is_refused_and_changes_nothing(
        tmp_path: Path) -> None:
    """The attack: a third party registers its own run with the victim's table
    names and asks for a checkpoint into the victim's complete checkpoint directory."""
    root = tmp_path / "root"
    store = _store(root)
    _train(store, "victim", VICTIM)
    claim_directory(root / "victim", prefer=VICTIM)
    target = step_dir(root / "victim", 2)
    _complete(store, "victim", target, 2)
    before = _tree(root / "victim")
    _train(store, "intruder", INTRUDER)
    claim_directory(root / "intruder", prefer=INTRUDER)
    for directory in (target, step_dir(root / "victim", 7), root / "victim" / "new"):
        with pytest.raises(PermissionDenied, match="belongs to another run"):
            store.checkpoint("intruder", [], 2, str(directory))
    assert _tree(root / "victim") == before
    assert not step_dir(root / "victim", 7).exists()
    store.checkpoint("intruder", [], 2, str(step_dir(root / "intruder", 2)))  # its own: fine


def test_never_over_a_complete_checkpoint_even_the_runs_own(tmp_path: Path) -> None:
    root = tmp_path / "root"
    store = _store(root)
    _train(store, RUN, VICTIM)
    claim_directory(root / "ck", prefer=VICTIM)
    target = step_dir(root / "ck", 2)
    _complete(store, RUN, target, 2)
    before = _tree(target)
    with pytest.raises(Conflict, match="complete checkpoint"):
        store.checkpoint(RUN, [], 2, str(target))
    assert _tree(target) == before
    (target / MANIFEST).unlink()  # what the worker does before it saves a step again
    store.checkpoint(RUN, [], 2, str(target))


def test_the_server_creates_no_run_directory_and_writes_into_no_unclaimed_one(
        tmp_path: Path) -> None:
    """As user nobody, a client made the root server create directories inside a root-only
    0700 directory under the root: the server now needs the run's owner file there."""
    root = tmp_path / "root"
    store = _store(root)
    _train(store, RUN, VICTIM)
    private = root / "private"
    private.mkdir(mode=0o700)
    for directory in ("private/x/step-0000000002", "private/step-0000000002",
                      "nowhere/step-0000000002"):
        with pytest.raises(PermissionDenied, match=r"does not exist|claimed by no run"):
            store.checkpoint(RUN, [], 2, directory)
    assert list(private.iterdir()) == [] and not (root / "nowhere").exists()
    unregistered = _store(tmp_path / "root2")
    unregistered.register(RUN, 1, 2, 0, [EMB, SMALL], ADAM)  # no run secret: owns nothing
    claim_directory(tmp_path / "root2" / "ck", prefer=VICTIM)
    with pytest.raises(PermissionDenied, match="without a run secret"):
        unregistered.checkpoint(RUN, [], -1, "ck/step-0000000000")


@pytest.mark.parametrize("where", ["run", "step", "optim", "file"])
def test_no_symbolic_link_is_followed(tmp_path: Path, where: str) -> None:
    """A link planted at the run directory, the step directory, its optim/ or a file name
    leads nowhere: refused (or, at a file name, replaced), the target untouched."""
    root = tmp_path / "root"
    store = _store(root)
    _train(store, RUN, VICTIM)
    target = root / "private"  # inside the root, like a user's 0700 directory
    target.mkdir(mode=0o700)
    claim_directory(target, prefer=VICTIM)  # even one the run could claim
    (target / "kept").write_text("untouched")
    ck = root / "ck"
    claim_directory(ck, prefer=VICTIM)
    step = step_dir(ck, 2)
    if where == "run":
        (root / "via-link").symlink_to(target)
        directory = step_dir(root / "via-link", 2)
    elif where == "step":
        step.symlink_to(target)
        directory = step
    elif where == "optim":
        step.mkdir()
        (step / "optim").symlink_to(target)
        directory = step
    else:
        (step / "optim").mkdir(parents=True)
        (step / optim_file("emb", 1)).symlink_to(target / "kept")
        directory = step
    before = _tree(target)
    if where == "file":  # renamed over the link: the link goes, its target stays
        store.checkpoint(RUN, [], 2, str(directory))
        assert not (step / optim_file("emb", 1)).is_symlink()
    else:
        with pytest.raises(PermissionDenied, match="symbolic link"):
            store.checkpoint(RUN, [], 2, str(directory))
    assert _tree(target) == before
    assert not any(p.name.startswith(".") for p in root.rglob("*"))  # no temporary left


# -- no takeover without proof ------------------------------------------------------------------

def test_a_partition_is_restored_over_only_with_the_runs_secret(tmp_path: Path) -> None:
    """The idle takeover: no stream open, a Register restoring an older checkpoint used to
    be accepted without any secret. Now it needs the run secret; the run itself (a
    restarted rank, a new job resuming) has it."""
    root = tmp_path / "root"
    store = _store(root)
    _train(store, RUN, VICTIM, steps=2)
    claim_directory(root / "ck", prefer=VICTIM)
    _complete(store, RUN, step_dir(root / "ck", 1), 1)
    for step in range(2, 6):
        feed(store, push(step, [12], run=RUN))
        feed(store, push(step, [1], table="small", dim=2, run=RUN))
    restore = (str(step_dir(root / "ck", 1)), 1)
    refusals = [  # the directory is the victim's: refused before the takeover rule
        ({}, PermissionDenied, "belongs to another run"),
        ({"run_secret": INTRUDER}, PermissionDenied, "belongs to another run"),
        # a secret that opens the directory, but not the run's: the takeover rule
        ({"restore_secret": VICTIM}, WrongSecret, "carries none"),
        ({"run_secret": INTRUDER, "restore_secret": VICTIM}, WrongSecret, "carries another"),
    ]
    for proof, error, why in refusals:
        with pytest.raises(error, match=why):
            store.register(RUN, 1, 2, 9, [EMB, SMALL], ADAM, restore=restore, **proof)
        part = store.partition(RUN, 1)
        assert part is not None and part.incarnation == 0
        assert {t.last_step for t in part.tables.values()} == {5}
    counted = next(r for r in store.stats().partitions if r.rank == 1).refusals
    assert (counted.get("permission_denied"), counted.get("wrong_secret")) == (2, 2)
    tables = store.register(RUN, 1, 2, 9, [EMB, SMALL], ADAM, restore=restore,
                            run_secret=VICTIM)  # the job itself rolls back
    assert {t.last_step for t in tables} == {1}


def test_a_partition_without_a_run_secret_never_moves_back(tmp_path: Path) -> None:
    root = tmp_path / "root"
    store = _store(root)
    _train(store, "proven", VICTIM, steps=2)
    claim_directory(root / "ck", prefer=VICTIM)
    _complete(store, "proven", step_dir(root / "ck", 1), 1)
    store.register(RUN, 1, 2, 0, [EMB, SMALL], ADAM)  # an older client: no run secret
    for step in range(4):
        feed(store, push(step, [12], run=RUN))
        feed(store, push(step, [1], table="small", dim=2, run=RUN))
    with pytest.raises(WrongSecret, match="may not move it back to step 1"):
        store.register(RUN, 1, 2, 1, [EMB, SMALL], ADAM,
                       restore=(str(step_dir(root / "ck", 1)), 1), run_secret=VICTIM)
    assert {t.last_step for t in store.partition(RUN, 1).tables.values()} == {3}  # type: ignore


def test_a_restore_reads_only_the_callers_runs_checkpoints(tmp_path: Path) -> None:
    """A new run id resuming from another directory needs that directory's secret (the
    worker sends it as the restore secret); nobody else may load it."""
    root = tmp_path / "root"
    store = _store(root)
    _train(store, "old", VICTIM, steps=2)
    claim_directory(root / "old", prefer=VICTIM)
    _complete(store, "old", step_dir(root / "old", 1), 1)
    restore = (str(step_dir(root / "old", 1)), 1)
    with pytest.raises(PermissionDenied, match="belongs to another run"):
        store.register("thief", 1, 2, 0, [EMB, SMALL], ADAM, restore=restore,
                       run_secret=INTRUDER)
    (root / "unclaimed").mkdir()
    with pytest.raises(PermissionDenied, match="claimed by no run"):
        store.register("thief", 1, 2, 0, [EMB, SMALL], ADAM,
                       restore=("unclaimed/step-0000000001", 1), run_secret=INTRUDER)
    assert store.partition("thief", 1) is None
    tables = store.register("new", 1, 2, 0, [EMB, SMALL], ADAM, restore=restore,
                            run_secret=INTRUDER, restore_secret=VICTIM)
    assert {t.last_step for t in tables} == {1}


def test_register_refuses_a_checkpoint_dir_the_run_may_not_write(tmp_path: Path) -> None:
    """Refused at Register, naming the directory and the root, not at the
    first checkpoint after --checkpoint-every steps."""
    root = tmp_path / "root"
    store = _store(root)
    outside = tmp_path / "outside"
    outside.mkdir()
    with pytest.raises(PermissionDenied) as info:
        store.register(RUN, 1, 2, 0, [EMB], ADAM, run_secret=VICTIM,
                       checkpoint_dir=str(outside))
    assert str(outside) in str(info.value) and str(root) in str(info.value)
    assert "--checkpoint-root" in str(info.value)
    (root / "not-mine").mkdir()
    claim_directory(root / "theirs", prefer=INTRUDER)
    for directory, why in (("not-mine", "claimed by no run"), ("theirs", "another run"),
                           ("missing", "does not exist")):
        with pytest.raises(PermissionDenied, match=why):
            store.register(RUN, 1, 2, 0, [EMB], ADAM, run_secret=VICTIM,
                           checkpoint_dir=directory)
    assert store.partitions() == []
    claim_directory(root / "mine", prefer=VICTIM)
    store.register(RUN, 1, 2, 0, [EMB], ADAM, run_secret=VICTIM, checkpoint_dir="mine")


# -- nothing holds memory without using it ---------------------------------------------------

def test_unused_registrations_are_freed_without_ending_the_run() -> None:
    over: list[str] = []
    now = [0.0]
    store = Store(clock=lambda: now[0])
    tracker = RunTracker(lambda run, why: over.append(run), clock=lambda: now[0])
    reaper = RunReaper(store, tracker, retention_s=600, unused_timeout_s=300)
    for run in ("idle", "busy", "streamed"):
        store.register(run, 0, 1, 0, [TableSpec("emb", 20, DIM, 0, 20)], ADAM)
        tracker.registered(run, 0)
    tracker.stream_opened("streamed", 0)
    now[0] = 200.0
    tracker.activity("busy")  # a SeedRows, Flush or Checkpoint counts as use
    now[0] = 299.0
    reaper.tick()
    assert {p.run_id for p in store.partitions()} == {"idle", "busy", "streamed"}
    now[0] = 300.0
    reaper.tick()
    assert {p.run_id for p in store.partitions()} == {"busy", "streamed"}
    assert store.stats().runs_freed == 1 and over == []  # freed, never called over
    assert [r for r, _, _ in tracker.snapshot()] == ["busy", "streamed"]
    now[0] = 500.0
    reaper.tick()
    assert {p.run_id for p in store.partitions()} == {"streamed"} and over == []


def test_one_runs_state_is_capped_within_the_servers() -> None:
    per_row = 2 + 8 * DIM  # m, v; the touched and changed flags
    store = Store(max_state_bytes=100 * per_row, max_run_state_bytes=30 * per_row)
    store.register("a", 0, 2, 0, [TableSpec("emb", 40, DIM, 0, 20)], ADAM)
    with pytest.raises(ResourceExhausted) as info:
        store.register("a", 1, 2, 0, [TableSpec("emb", 40, DIM, 20, 40)], ADAM)
    text = str(info.value)
    assert "--max-run-state-bytes" in text and f"limit of {30 * per_row} bytes" in text
    assert f"holds {20 * per_row} bytes" in text
    store.register("b", 0, 1, 0, [TableSpec("emb", 30, DIM, 0, 30)], ADAM)  # another run
    assert sorted((p.run_id, p.rank) for p in store.partitions()) == [("a", 0), ("b", 0)]


# -- the refusals column, and a re-sent step's payload ----------------------------------------

def test_a_wrong_secret_counts_in_the_partitions_refusals() -> None:
    store = Store()
    store.register(RUN, 1, 2, 0, [EMB, SMALL], ADAM)
    for given in ("", "f" * 32):
        with pytest.raises(WrongSecret):
            store.authorize(RUN, [1], given, "flush")
    with pytest.raises(WrongSecret):
        store.authorize(RUN, [], "f" * 32, "checkpoint")  # a call naming every rank
    rows = store.stats().partitions
    assert sum(r.refusals.get("wrong_secret", 0) for r in rows) == 3


def test_a_resent_step_with_another_payload_is_refused_a_true_resend_answered() -> None:
    store = Store()
    store.register(RUN, 1, 2, 0, [EMB, SMALL], ADAM)
    first = feed(store, push(0, [11, 15]))
    feed(store, push(1, [12]))
    assert first is not None
    again = feed(store, push(0, [11, 15]))
    assert again is not None and again.duplicate and torch.equal(again.delta, first.delta)
    for changed in (push(0, [11, 15], seed=99), push(0, [11, 16]), push(0, [11])):
        with pytest.raises(Conflict, match="step 0 was applied with another payload"):
            feed(store, changed)
    lr = push(0, [11, 15])
    lr.lr = 0.5
    with pytest.raises(Conflict, match="step 0"):
        feed(store, lr)
    part = store.partition(RUN, 1)
    assert part is not None and part.tables["emb"].last_step == 1


def test_the_payload_digest_is_the_same_natively_and_in_numpy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(513, 7, generator=gen), torch.arange(13), torch.randn(1),
               torch.randn(4096, 16, generator=gen)]
    built = [digest_lanes(t, offset) for t in tensors for offset in (0, 3, 8, 1001)]
    monkeypatch.setattr(native, "ext", None)
    assert [digest_lanes(t, offset) for t in tensors for offset in (0, 3, 8, 1001)] == built
    ids, grads = torch.arange(8), torch.randn(8, 4, generator=gen)
    base = payload_digest(ids, grads, None)
    flipped = grads.clone()
    flipped.view(torch.int32)[5, 2] ^= 1  # one bit of one gradient
    assert payload_digest(ids, flipped, None) != base
    assert payload_digest(ids, grads, 0.1) != base
    assert payload_digest(ids, grads, None) == base


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_the_digest_of_the_checks_pass_is_that_of_the_whole_push(
        kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunk by chunk, in the pass that checks them (native scan_push), at any chunk
    boundary, the digest is the whole push's."""
    from hybridps import optim
    from hybridps.push_checks import PayloadDigest, scan_push_max

    previous = optim.kernel_name()
    optim.set_kernel(kernel)
    try:
        gen = torch.Generator().manual_seed(5)
        ids = torch.arange(3, 3 + 1001, dtype=torch.int64)
        grads = torch.randn(1001, 7, generator=gen)
        whole = payload_digest(ids, grads, 0.25)
        for cuts in ([1001], [1, 1000], [333, 333, 335], [8, 993]):
            digest, at = PayloadDigest(), 0
            for n in cuts:
                bad, _, nonfinite, _ = scan_push_max(ids[at:at + n], grads[at:at + n], 0,
                                                     2000, digest)
                assert bad < 0 and nonfinite < 0
                at += n
            assert digest.value(0.25) == whole, cuts
    finally:
        optim.set_kernel(previous)
    monkeypatch.setattr(native, "ext", None)  # the numpy lanes: the same numbers
    assert payload_digest(ids, grads, 0.25) == whole
