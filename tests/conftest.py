"""Shared fixtures. Helpers live in tests/helpers.py (importable as tests.helpers)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import PsServer, start_ps_server

# Workers' shared-memory arenas in the tests: 8 MiB a rank (their pushes are KBs), so a
# machine with a small /dev/shm (a container's default is 64 MB) holds every arena the
# tests have at once; the workers the tests start read it as --shm-mb.
os.environ.setdefault("HYBRIDPS_SHM_MB", "8")


@pytest.fixture(scope="session", autouse=True)
def _checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Shard servers the tests start (they inherit the environment) checkpoint anywhere
    under this session's temp directory, where every test's tmp_path lives
    (--checkpoint-root; the default, ./checkpoints, would refuse them)."""
    previous = os.environ.get("HYBRIDPS_CHECKPOINT_ROOT")
    os.environ["HYBRIDPS_CHECKPOINT_ROOT"] = str(tmp_path_factory.getbasetemp())
    yield
    if previous is None:
        os.environ.pop("HYBRIDPS_CHECKPOINT_ROOT", None)
    else:
        os.environ["HYBRIDPS_CHECKPOINT_ROOT"] = previous


@pytest.fixture
def ps_server(tmp_path: Path) -> Iterator[str]:
    """A fresh shard server subprocess on a free port; yields "127.0.0.1:PORT"."""
    server = start_ps_server(tmp_path)
    try:
        yield server.address
    finally:
        server.terminate()


@pytest.fixture(scope="module")
def ps_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One shard server shared by a test module's runs (each uses its own run id)."""
    server = start_ps_server(tmp_path_factory.mktemp("ps"))
    try:
        yield server.address
    finally:
        server.terminate()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PsServer]:
    """One shard server (a PsServer: address, stderr, ...) shared by a module's runs."""
    srv = start_ps_server(tmp_path_factory.mktemp("ps"))
    try:
        yield srv
    finally:
        srv.terminate()
