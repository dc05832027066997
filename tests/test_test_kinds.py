"""The split between unit and e2e tests (tests/conftest.py, docs/testing.md) holds."""

from __future__ import annotations

import subprocess
import sys

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
