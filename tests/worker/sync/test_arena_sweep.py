"""The sweep of leaked shared-memory arenas when the workers are in another PID namespace
(docker-compose.yml does not share the server's).

There the pid in an arena's name means nothing to the server, so `alive` is replaced by a
function that says every creator is gone: only the kernel's answer (does any process have
the file open or mapped? ps/core/maintenance.py) keeps a live rank's arena. The older rules
(pid, age, owner, links) are tests/ps/core/test_trust_core.py's.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ps.core import maintenance
from ps.core.maintenance import in_use, sweep_dead_arenas

OLD = time.time() + 3600  # "now" an hour later: every file is old enough
FOREIGN = 4_000_000  # a pid from another namespace: nothing here says whether it lives


def no_pid_lives(pid: int) -> bool:
    return False


def arena(tmp_path: Path, rank: int) -> Path:
    path = tmp_path / f"hybridps-{FOREIGN}-r{rank}-0123456789abcdef.arena"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.posix_fallocate(fd, 0, 1 << 16)
    os.close(fd)
    return path


def leases_work(tmp_path: Path) -> bool:
    probe = tmp_path / "probe"
    probe.write_bytes(b"x")
    try:
        return in_use(str(probe)) is False
    finally:
        probe.unlink()


@pytest.fixture
def shm_dir(tmp_path: Path) -> Path:
    """A tmpfs directory like /dev/shm where the kernel has one (leases behave as there)."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        import tempfile

        directory = Path(tempfile.mkdtemp(prefix="hybridps-test-sweep-", dir=shm))
        yield directory
        for child in directory.iterdir():
            child.unlink()
        directory.rmdir()
    else:
        yield tmp_path


MAP_AND_WAIT = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
mapping = mmap.mmap(fd, 1 << 16, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
os.close(fd)  # like a rank: the file stays mapped, no descriptor open
print("mapped", flush=True)
sys.stdin.readline()
"""


@pytest.mark.e2e
def test_a_live_creator_in_another_pid_namespace_keeps_its_arena(shm_dir: Path) -> None:
    if not leases_work(shm_dir):
        pytest.skip("no file leases here (/proc/sys/fs/leases-enable): the pid rule decides")
    live, dead = arena(shm_dir, 0), arena(shm_dir, 1)
    creator = subprocess.Popen([sys.executable, "-c", MAP_AND_WAIT, str(live)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert creator.stdout is not None and creator.stdout.readline() == "mapped\n"
        assert in_use(str(live)) is True and in_use(str(dead)) is False
        removed = sweep_dead_arenas(str(shm_dir), alive=no_pid_lives, now=OLD)
        assert removed == [str(dead)]  # the pid rule alone would have taken both
        assert live.exists()
    finally:
        assert creator.stdin is not None
        creator.stdin.write("\n")
        creator.stdin.close()
        creator.wait(30)
    assert sweep_dead_arenas(str(shm_dir), alive=no_pid_lives, now=OLD) == [str(live)]


def test_an_arena_open_without_a_mapping_is_in_use_too(shm_dir: Path) -> None:
    """Between a rank's O_CREAT and its mmap the file is only open: kept all the same."""
    if not leases_work(shm_dir):
        pytest.skip("no file leases here")
    path = arena(shm_dir, 0)
    fd = os.open(path, os.O_RDWR)
    try:
        assert sweep_dead_arenas(str(shm_dir), alive=no_pid_lives, now=OLD) == []
    finally:
        os.close(fd)
    mapping_fd = os.open(path, os.O_RDWR)
    mapping = mmap.mmap(mapping_fd, 1 << 16)
    os.close(mapping_fd)
    try:  # this process's own mapping (the server's, of an accepted arena) counts
        assert sweep_dead_arenas(str(shm_dir), alive=no_pid_lives, now=OLD) == []
    finally:
        mapping.close()
    assert sweep_dead_arenas(str(shm_dir), alive=no_pid_lives, now=OLD) == [str(path)]


def test_the_arenas_the_server_maps_are_never_swept(shm_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`keep` (ArenaRegistry.paths) holds even where the kernel cannot tell."""
    held, leaked = arena(shm_dir, 0), arena(shm_dir, 1)
    monkeypatch.setattr(maintenance, "F_SETLEASE", None)  # no leases: pid + age rules
    assert in_use(str(held)) is None
    removed = sweep_dead_arenas(str(shm_dir), alive=no_pid_lives, keep=[str(held)], now=OLD)
    assert removed == [str(leaked)] and held.exists()


def test_registry_names_the_paths_it_maps(shm_dir: Path) -> None:
    from hybridps import arena_layout as layout
    from ps.edge.arena_server import ArenaRegistry

    size = layout.MIN_ARENA_BYTES
    nonce = os.urandom(layout.NONCE_BYTES)
    path = shm_dir / "hybridps-1-r0-00ff.arena"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.posix_fallocate(fd, 0, size)
    os.pwrite(fd, layout.pack_header(nonce, size), 0)
    os.close(fd)
    registry = ArenaRegistry(str(shm_dir))
    accepted, reason, _ = registry.attach("run", 0, str(path), size, nonce)
    assert accepted, reason
    assert registry.paths() == [str(path)]
    registry.release("run", 0, "test")
    assert registry.paths() == []
