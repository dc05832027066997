"""Test helpers shared by the shard-server and worker tests.

    from tests.testing.helpers import start_ps_server
    with start_ps_server(tmp_path, "--max-message-bytes", "65536") as ps:
        ps.address  # "127.0.0.1:PORT"

The `ps_server` fixture (tests/conftest.py) wraps this for the common case.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 60.0


class PsServer:
    """A `python -m ps` subprocess; stdout/stderr go to files under its directory."""

    def __init__(self, proc: subprocess.Popen[bytes], host: str, port: int, directory: Path):
        self.proc = proc
        self.host = host
        self.port = port
        self.directory = directory

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def stdout_path(self) -> Path:
        return self.directory / "stdout.log"

    @property
    def stderr_path(self) -> Path:
        return self.directory / "stderr.log"

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def terminate(self, timeout: float = 15.0) -> int:
        """SIGTERM, wait; SIGKILL if it does not exit in `timeout`. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    stop = terminate

    def __enter__(self) -> PsServer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.terminate()


def launch_ps(directory: Path, *extra_args: str, env: dict[str, str] | None = None
              ) -> tuple[subprocess.Popen[bytes], Path]:
    """Start `python -m ps` without waiting; returns (process, port file path)."""
    directory.mkdir(parents=True, exist_ok=True)
    port_file = directory / "ps.port"
    port_file.unlink(missing_ok=True)
    args = [sys.executable, "-m", "ps", "--host", "127.0.0.1", "--port", "0",
            "--port-file", str(port_file), *extra_args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(directory / "stdout.log", "wb") as out, open(directory / "stderr.log", "wb") as err:
        proc = subprocess.Popen(args, cwd=REPO, env=full_env, stdout=out, stderr=err)
    return proc, port_file


def start_ps_server(tmp_path: Path, *extra_args: str, env: dict[str, str] | None = None,
                    timeout: float = STARTUP_TIMEOUT_S) -> PsServer:
    """Start a shard server on a free port and wait until it serves.

    Later flags win, so `extra_args` may override --host/--port. Raises RuntimeError
    (with the server's stderr) if it exits or does not come up within `timeout`.
    """
    directory = Path(tmp_path) / f"ps-{time.monotonic_ns()}"
    proc, port_file = launch_ps(directory, *extra_args, env=env)
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            err = (directory / "stderr.log").read_text(errors="replace")
            raise RuntimeError(f"shard server did not start (exit {proc.returncode}):\n{err}")
        time.sleep(0.05)
    port = int(port_file.read_text().strip())
    return PsServer(proc, "127.0.0.1", port, directory)
