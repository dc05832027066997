"""docker-compose.yml, checked without a Docker engine.

The compose file is parsed (PyYAML) and interpolated like compose does
(`${VAR:-default}`), then each service's command + environment runs as a local
process, wired like compose wires them: service host names -> 127.0.0.1, the
server's fixed port -> a free one (port 0 + port file), the named volume ->
a temp directory, `depends_on: service_healthy` -> the healthcheck command must
exit 0 before the worker starts. The job must train to the end, print the summary
and shard stats, exit 0, and the server must then stop by itself (exit 0).
`docker compose config` (or `docker-compose config`) validates the files when
such a tool is installed; otherwise that test is skipped, saying so.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers import REPO

COMPOSE = REPO / "docker-compose.yml"
GPU = REPO / "docker-compose.gpu.yml"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
_VAR = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?-)(?P<default>[^}]*))?\}")


def interpolate(value: Any, environ: dict[str, str]) -> Any:
    """Compose's ${VAR}, ${VAR-default}, ${VAR:-default} (and $$ -> $), recursively."""
    if isinstance(value, dict):
        return {k: interpolate(v, environ) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, environ) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        name, op, default = m["name"], m["op"], m["default"] or ""
        got = environ.get(name)
        if op == ":-" and not got:
            return default
        if op == "-" and got is None:
            return default
        return got or ""

    return _VAR.sub(sub, value).replace("$$", "$")


def load(path: Path, environ: dict[str, str]) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return dict(interpolate(data, environ))


def env_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def test_compose_file_shape() -> None:
    text = COMPOSE.read_text()
    assert "--exit-code-from worker" in text  # documented alternative
    spec = load(COMPOSE, {})
    ps, worker = spec["services"]["ps"], spec["services"]["worker"]
    assert ps["command"] == ["python", "-m", "ps", "--host", "0.0.0.0", "--port", "50051"]
    assert ps["healthcheck"]["test"][:5] == ["CMD", "python", "-m", "ps.admin", "health"]
    assert env_of(ps)["HYBRIDPS_EXIT_AFTER_RUN"] == "true"
    assert worker["command"][:5] == ["torchrun", "--standalone", "--nproc_per_node", "2",
                                     "worker/main.py"]
    assert worker["command"][5:] == ["--ps", "ps:50051"]
    assert worker["depends_on"] == {"ps": {"condition": "service_healthy"}}
    assert env_of(worker)["HYBRIDPS_RESULTS"].startswith("/data/")
    assert env_of(worker)["HYBRIDPS_CHECKPOINT_DIR"].startswith("/data/")
    assert "hybridps-data" in spec["volumes"]
    for svc in (ps, worker):
        assert svc["volumes"] == ["hybridps-data:/data"]
        assert svc["image"] == worker["image"]  # one image for both
    gpu = load(GPU, {})
    devices = gpu["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert env_of(gpu["services"]["worker"])["HYBRIDPS_DEVICE"] == "cuda"


def _rewrite(args: list[str], mapping: dict[str, str]) -> list[str]:
    out = []
    for a in args:
        for old, new in mapping.items():
            a = a.replace(old, new)
        out.append(a)
    return out


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_compose_services_train_to_the_end_and_both_exit_0(tmp_path: Path) -> None:
    overrides = {"HYBRIDPS_STEPS": "30", "HYBRIDPS_CHECKPOINT_EVERY": "15"}
    spec = load(COMPOSE, overrides)
    ps_svc, worker_svc = spec["services"]["ps"], spec["services"]["worker"]
    volume = tmp_path / "volume"
    volume.mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    base.update(PYTHONUNBUFFERED="1")

    def service_env(svc: dict[str, Any]) -> dict[str, str]:
        env = {k: v.replace("/data", str(volume)) if v.startswith("/data") else v
               for k, v in env_of(svc).items()}
        return {**base, **env}

    # -- ps: the same command, on 127.0.0.1 and a free port --------------------------
    port_file = tmp_path / "ps.port"
    cmd = ps_svc["command"]
    assert cmd[:3] == ["python", "-m", "ps"]
    ps_cmd = [sys.executable, *_rewrite(cmd[1:], {"0.0.0.0": "127.0.0.1"})]
    ps_cmd[ps_cmd.index("--port") + 1] = "0"
    ps_cmd += ["--port-file", str(port_file)]
    ps_out, ps_err = open(tmp_path / "ps.out", "w"), open(tmp_path / "ps.err", "w")  # noqa: SIM115
    ps = subprocess.Popen(ps_cmd, cwd=REPO, env=service_env(ps_svc), stdout=ps_out,
                          stderr=ps_err)
    worker = None
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert ps.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "ps.err").read_text()
            time.sleep(0.1)
        address = f"127.0.0.1:{port_file.read_text().strip()}"
        # -- depends_on: service_healthy = the healthcheck command exits 0 -----------
        check = ps_svc["healthcheck"]["test"]
        assert check[0] == "CMD"
        health_cmd = [sys.executable, *_rewrite(check[2:], {"127.0.0.1:50051": address})]
        for _ in range(int(ps_svc["healthcheck"]["retries"])):
            probe = subprocess.run(health_cmd, cwd=REPO, env=service_env(ps_svc),
                                   capture_output=True, text=True, timeout=60, check=False)
            if probe.returncode == 0:
                break
            time.sleep(1)
        assert probe.returncode == 0, probe.stderr
        assert "SERVING" in probe.stdout
        # -- worker: torchrun ... --ps ps:50051 -> the local server -----------------
        wcmd = worker_svc["command"]
        assert wcmd[0] == "torchrun"
        worker_cmd = [TORCHRUN, *_rewrite(wcmd[1:], {"ps:50051": address})]
        worker = subprocess.run(worker_cmd, cwd=REPO, env=service_env(worker_svc),
                                capture_output=True, text=True, timeout=240, check=False)
        assert worker.returncode == 0, worker.stderr[-4000:]
        assert "hybridps worker: task=synthetic mode=server world=2" in worker.stdout
        assert "steps 30" in worker.stdout
        assert "shard server stats (this node):" in worker.stdout
        results = json.loads((volume / "results" / "results.json").read_text())
        assert results["steps"] == 30 and results["world_size"] == 2
        checkpoints = sorted(p.name for p in (volume / "checkpoints").glob("step-*"))
        assert checkpoints, "no checkpoint written to the volume"
        # -- the server stops by itself once the run is over ------------------------
        assert ps.wait(60) == 0
        err = (tmp_path / "ps.err").read_text()
        assert "event=run_over" in err and "every rank finished" in err
        assert "event=stopped" in err
    finally:
        if ps.poll() is None:
            ps.kill()
            ps.wait()
        ps_out.close()
        ps_err.close()


def _compose_tool() -> list[str] | None:
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) is None:
            continue
        probe = subprocess.run([*cmd, "version"], capture_output=True, text=True, timeout=60,
                               check=False)
        if probe.returncode == 0:
            return cmd
    return None


@pytest.mark.e2e
def test_docker_compose_config_is_valid(tmp_path: Path) -> None:
    tool = _compose_tool()
    if tool is None:
        pytest.skip("no `docker compose` plugin nor `docker-compose` here: the compose files "
                    "are checked by parsing only (test_compose_file_shape)")
    for files in (["-f", str(COMPOSE)], ["-f", str(COMPOSE), "-f", str(GPU)]):
        proc = subprocess.run([*tool, *files, "config"], cwd=REPO, capture_output=True,
                              text=True, timeout=60, check=False)
        assert proc.returncode == 0, proc.stderr
        rendered = yaml.safe_load(proc.stdout)
        assert set(rendered["services"]) == {"ps", "worker"}
