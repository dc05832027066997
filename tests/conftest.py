"""Shared fixtures, and the guard that keeps unit tests free of processes.

Helpers live in tests/testing/helpers.py (importable as tests.testing.helpers). docs/testing.md
says how to
run each kind of test. A test that starts a process (a shard server, torchrun, spawned
ranks, another Python) is marked `e2e`; while any other test runs, starting one fails it,
so `pytest -m "not e2e"` stays the fast, process-free unit suite.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import sys
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.testing.helpers import PsServer, start_ps_server

# Workers' shared-memory arenas in the tests: 8 MiB a rank (their pushes are KBs), so a
# machine with a small /dev/shm (a container's default is 64 MB) holds every arena the
# tests have at once; the workers the tests start read it as --same-node-mb.
os.environ.setdefault("HYBRIDPS_SAME_NODE_MB", "8")
# The console wraps its reports to COLUMNS when set: the tests (and the programs they
# start) run as off a terminal, whatever the runner's environment carries, unless a test
# sets a width itself.
os.environ.pop("COLUMNS", None)


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


# -- unit tests start no processes -----------------------------------------------------------

_running_unit_test: list[str] = []  # the node id of the unit test running now, if any


def _refuse_in_unit_tests(what: str) -> None:
    if _running_unit_test:
        pytest.fail(f"{_running_unit_test[0]} starts a process ({what}) but is not marked "
                    "e2e: add @pytest.mark.e2e (docs/testing.md)", pytrace=False)


def _is_our_program(args: Any) -> bool:
    argv0 = args[0] if isinstance(args, (list, tuple)) and args else str(args).split(" ")[0]
    name = Path(str(argv0)).name
    return str(argv0) == sys.executable or name.startswith("python") or name == "torchrun"


def _guarded_popen_init(original: Callable[..., None]) -> Callable[..., None]:
    def init(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
        if _is_our_program(args):
            _refuse_in_unit_tests(" ".join(map(str, args))[:120]
                                  if isinstance(args, (list, tuple)) else str(args)[:120])
        original(self, args, *rest, **kwargs)
    return init


def _guarded_start(original: Callable[..., None]) -> Callable[..., None]:
    def start(self: multiprocessing.process.BaseProcess) -> None:
        _refuse_in_unit_tests(f"multiprocessing {self.name}")
        original(self)
    return start


subprocess.Popen.__init__ = _guarded_popen_init(subprocess.Popen.__init__)  # type: ignore[method-assign]
multiprocessing.process.BaseProcess.start = _guarded_start(  # type: ignore[method-assign]
    multiprocessing.process.BaseProcess.start)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None
                            ) -> Generator[None, None, None]:
    """From the test's setup (fixtures included) to its teardown."""
    unit = item.get_closest_marker("e2e") is None
    if unit:
        _running_unit_test.append(item.nodeid)
    try:
        yield
    finally:
        if unit:
            _running_unit_test.clear()


# -- the order files go out to pytest-xdist's workers -----------------------------------------

def pytest_configure(config: pytest.Config) -> None:
    """pytest-xdist (3.5 on) hands `--dist loadfile` files out largest test count first
    unless told not to, which undoes the order below: a file of one 2-minute test would
    go out last and end the run alone."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On pytest-xdist's workers (scripts/test.sh, `--dist loadfile`), the files expected
    to take longest go out first and the unit-test files last, so the run does not end
    with one worker in a long file while the others idle. The cost guessed per test: a
    slow one 30, another end-to-end one 5, a unit test 0.1 (seconds, roughly as measured
    in docs/testing.md). A file's own tests keep their order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    cost: dict[Path, float] = {}
    for item in items:
        guess = (30.0 if item.get_closest_marker("slow") else
                 5.0 if item.get_closest_marker("e2e") else 0.1)
        cost[item.path] = cost.get(item.path, 0.0) + guess
    items.sort(key=lambda item: -cost[item.path])  # stable: in-file order kept


@pytest.fixture
def world_of_one(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A one-rank gloo world in this process (no torchrun variables), destroyed after."""
    from worker.runtime.dist import destroy_distributed, init_distributed

    for var in ("MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    ctx = init_distributed("cpu")
    try:
        yield ctx
    finally:
        destroy_distributed()
