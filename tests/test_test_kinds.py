"""The split between unit and e2e tests (tests/conftest.py, docs/testing.md) holds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def test_a_unit_test_cannot_start_a_python_process() -> None:
    with pytest.raises(pytest.fail.Exception, match="is not marked e2e"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_a_unit_test_cannot_start_ranks() -> None:
    import multiprocessing

    with pytest.raises(pytest.fail.Exception, match="is not marked e2e"):
        multiprocessing.get_context("spawn").Process(target=print).start()


def test_other_programs_are_not_ours() -> None:
    """Libraries may run system tools (e.g. `uname`) inside a unit test."""
    assert subprocess.run(["true"], check=False).returncode == 0


@pytest.mark.e2e
def test_an_e2e_test_may() -> None:
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_the_markers_are_registered(pytestconfig: pytest.Config) -> None:
    lines = pytestconfig.getini("markers")
    assert any(line.startswith("e2e:") for line in lines)
    assert any(line.startswith("slow:") for line in lines)
    assert any(line.startswith("gpu:") for line in lines)
    assert "--strict-markers" in pytestconfig.getini("addopts")


class _Item:
    """What tests/conftest.py's ordering reads of a collected test: its file and markers."""

    def __init__(self, path: str, *marks: str) -> None:
        self.path = Path(path)
        self.marks = marks

    def get_closest_marker(self, name: str) -> object | None:
        return name if name in self.marks else None


def _order(monkeypatch: pytest.MonkeyPatch, worker: str | None, items: list[_Item]) -> list[str]:
    from tests.conftest import pytest_collection_modifyitems

    if worker is None:
        monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    else:
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    pytest_collection_modifyitems(None, items)  # type: ignore[arg-type]
    return [f"{item.path.name}:{','.join(item.marks)}" for item in items]


def test_xdist_workers_take_the_longest_files_first(monkeypatch: pytest.MonkeyPatch) -> None:
    def items() -> list[_Item]:
        return [_Item("a.py"), _Item("a.py"), _Item("b.py", "e2e"), _Item("c.py", "e2e"),
                _Item("c.py", "e2e", "slow"), _Item("c.py"), _Item("d.py", "e2e"),
                _Item("d.py", "e2e")]

    assert _order(monkeypatch, "gw0", items()) == [
        "c.py:e2e", "c.py:e2e,slow", "c.py:", "d.py:e2e", "d.py:e2e", "b.py:e2e", "a.py:",
        "a.py:"]
    unchanged = [f"{i.path.name}:{','.join(i.marks)}" for i in items()]
    assert _order(monkeypatch, None, items()) == unchanged  # one process: file order


def test_xdist_hands_the_files_out_in_that_order(pytestconfig: pytest.Config) -> None:
    """pytest-xdist's own reordering (largest test count first) is off, else the order
    above never reaches its scheduler."""
    if not pytestconfig.pluginmanager.hasplugin("xdist"):
        pytest.skip("pytest-xdist is not loaded (-p no:xdist)")
    assert pytestconfig.option.loadscopereorder is False
