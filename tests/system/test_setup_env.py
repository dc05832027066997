"""scripts/setup_env.sh picks the torch build for the machine and says which, and installs
nothing on a second run. Run against a stand-in venv whose `python` records pip's
arguments (nothing is downloaded or installed), with `nvidia-smi` and the reachability of
torch's CPU index faked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.testing.helpers import REPO

pytestmark = pytest.mark.e2e  # runs bash

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
FAKE_PYTHON = """#!/usr/bin/env bash
if [ "${1:-}" = "-m" ] && [ "${2:-}" = "pip" ]; then echo "$*" >> "$PIP_LOG"; exit 0; fi
if [ "${1:-}" = "-c" ] && [[ "$2" == *importlib.metadata* ]]; then
    [ -n "${FAKE_TORCH:-}" ] && echo "$FAKE_TORCH"; exit 0
fi
if [ "${1:-}" = "-c" ] && [[ "$2" == *urlopen* ]]; then exit "${FAKE_UNREACHABLE:-0}"; fi
exec REAL_PYTHON "$@"
"""


def _setup(tmp_path: Path, *, gpu: bool, reachable: bool = True, torch: str = "",
           **extra: str) -> tuple[list[str], str]:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON.replace("REAL_PYTHON", sys.executable))
    python.chmod(0o755)
    tools = tmp_path / "tools"
    tools.mkdir(exist_ok=True)
    smi = tools / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nexit {0 if gpu else 1}\n")
    smi.chmod(0o755)
    log = tmp_path / "pip.log"
    log.unlink(missing_ok=True)
    env = {"PATH": f"{tools}:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"),
           "HYBRIDPS_VENV": str(venv), "PIP_LOG": str(log), "FAKE_TORCH": torch,
           "FAKE_UNREACHABLE": "0" if reachable else "1", **extra}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "setup_env.sh")], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text().splitlines() if log.exists() else []
    return calls, proc.stderr


def test_a_machine_without_a_gpu_gets_the_cpu_wheel_from_torchs_index(tmp_path: Path) -> None:
    calls, err = _setup(tmp_path, gpu=False)
    assert calls[0].endswith(f"torch==2.13.0 --index-url {CPU_INDEX}"), calls
    assert calls[1].endswith(f"-e {REPO}[dev]"), calls
    assert f"setup_env: installed torch  from {CPU_INDEX} (no GPU here: the CPU build)" in err


def test_an_unreachable_cpu_index_falls_back_to_the_plain_name(tmp_path: Path) -> None:
    calls, err = _setup(tmp_path, gpu=False, reachable=False)
    assert calls[0].endswith("install -q --disable-pip-version-check torch==2.13.0"), calls
    assert f"by name ({CPU_INDEX} unreachable)" in err


def test_a_gpu_machine_or_a_chosen_index(tmp_path: Path) -> None:
    calls, err = _setup(tmp_path, gpu=True)
    assert calls[0].endswith("torch==2.13.0") and "--index-url" not in calls[0], calls
    assert "a GPU is here" in err
    cu = "https://download.pytorch.org/whl/cu128"
    calls, err = _setup(tmp_path / "chosen", gpu=False, TORCH_INDEX_URL=cu)
    assert calls[0].endswith(f"torch==2.13.0 --index-url {cu}"), calls
    assert f"from {cu} (TORCH_INDEX_URL)" in err


def test_a_second_run_installs_nothing(tmp_path: Path) -> None:
    calls, _ = _setup(tmp_path, gpu=False, torch="2.13.0+cpu")  # torch there: only the package
    assert len(calls) == 1 and calls[0].endswith("[dev]"), calls
    calls, err = _setup(tmp_path, gpu=False, torch="2.13.0+cpu")
    assert calls == [] and err == ""
    calls, _ = _setup(tmp_path, gpu=False, torch="2.12.0")  # another torch: replaced
    assert calls[0].endswith(f"--index-url {CPU_INDEX}"), calls
