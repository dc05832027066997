"""Multi-node on one machine: one shard server per "node", ranks split across them.

Two torchrun agents (`--nnodes 2 --rdzv-backend c10d`, one rank each; bare torchrun, and
hybridps-run as docs/deploy.md launches them) stand for two nodes; both get `--ps A,B`,
so rank r uses entry r // LOCAL_WORLD_SIZE. The result must equal the single-process
reference (as the single-server run does, tests/worker/train/test_worker_e2e.py), and each
server must hold exactly its node's rank.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridps.cli import parse_config
from ps.admin import get_shard_stats
from tests.testing.helpers import REPO, start_ps_server
from tests.worker.train.test_worker_e2e import SMALL, assert_matches_reference, small_config
from worker.config.nodes import node_ps_address, rank_layout
from worker.config.train_config import TrainConfig

MAIN = str(REPO / "worker" / "main.py")
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
LAUNCH = [sys.executable, "-m", "worker.launch"]  # hybridps-run


def test_node_indexing() -> None:
    assert node_ps_address("a:1", 13, 8) == "a:1"  # one address: every rank
    assert [node_ps_address("a:1, b:2", r, 2) for r in range(4)] == ["a:1", "a:1", "b:2", "b:2"]
    with pytest.raises(ValueError, match=r"lists 2 servers .* rank 4 is on node 2"):
        node_ps_address("a:1,b:2", 4, 2)
    with pytest.raises(ValueError, match="empty entry"):
        node_ps_address("a:1,,b:2", 0, 1)
    assert rank_layout({"RANK": "5", "LOCAL_WORLD_SIZE": "4"}) == (5, 4)
    assert rank_layout({}) == (0, 1)


def test_ps_list_in_config_and_env() -> None:
    cfg = parse_config(TrainConfig, [], environ={"HYBRIDPS_PS": "10.0.0.1:1,10.0.0.2:1"})
    assert cfg.sync.ps == "10.0.0.1:1,10.0.0.2:1"
    with pytest.raises(SystemExit):
        parse_config(TrainConfig, ["--ps", "10.0.0.1:1,nope"], environ={})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", [[TORCHRUN], LAUNCH], ids=["torchrun", "hybridps-run"])
def test_two_nodes_two_servers_match_the_reference(launcher: list[str], tmp_path: Path
                                                   ) -> None:
    servers = [start_ps_server(tmp_path / f"node{i}") for i in range(2)]
    try:
        ps = ",".join(s.address for s in servers)
        endpoint = f"127.0.0.1:{free_port()}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        dump = tmp_path / "state.pt"
        agents = []
        for i in range(2):
            cmd = [*launcher, "--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", endpoint, "--rdzv-id", "multinode-test", "--local-addr",
                   "127.0.0.1", MAIN, "--ps", ps, "--staleness", "0", "--run-id", "two-nodes",
                   "--dump-state", str(dump), *SMALL]
            log = open(tmp_path / f"agent{i}.log", "w")  # noqa: SIM115 - closed below
            agents.append((subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log,
                                            stderr=subprocess.STDOUT), log))
            time.sleep(0.5)  # the first agent hosts the rendezvous store
        for proc, log in agents:
            try:
                proc.wait(240)
            finally:
                log.close()
        logs = [(tmp_path / f"agent{i}.log").read_text() for i in range(2)]
        for (proc, _), text in zip(agents, logs, strict=True):
            assert proc.returncode == 0, text[-4000:]
            assert "Traceback" not in text and "hybridps-run: error" not in text, text[-4000:]
        # Each server holds exactly the rank of its node, all of its tables, all steps.
        for node, server in enumerate(servers):
            stats = get_shard_stats(server.address, run_id="two-nodes")
            assert {p.rank for p in stats.partitions} == {node}, stats
            assert len(stats.partitions) == 4
            assert all(p.last_step == 19 and p.queue_depth == 0 for p in stats.partitions)
        assert any(f"ps={servers[1].address}" in t for t in logs)  # rank 1 used server B
        assert_matches_reference(dump, small_config())
    finally:
        for server in servers:
            server.terminate()
