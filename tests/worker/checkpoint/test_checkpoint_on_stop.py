"""A checkpoint on stop (worker/checkpoint/checkpointer.py `save_on_stop`), end to end.

2 gloo ranks under torchrun get SIGTERM mid-run (as from `docker compose stop`): both
stop after the same step S, write a checkpoint of S that is intact, and exit as a
stop does; `--resume` then trains to the end and its final rows and dense part are
bitwise those of the run straight through. With --local-optimizer and with a real shard
server. `--checkpoint-on-stop false` writes none; a stop at a step just checkpointed
writes it once. In process at world 1, dynamic tables with --pipeline: a signal that
comes after the next step's ids were prefetched stops at the next agreement step, so the
stop's checkpoint never holds a pending translation, and a resume from it goes on bitwise.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hybridps.checkpoint import complete_checkpoints, read_manifest, step_dir, verify_files
from tests.testing.helpers import REPO, PsServer
from tests.testing.spawn_helpers import run_ranks
from tests.worker.train.test_worker_e2e import small_config
from worker.config.train_config import TrainConfig
from worker.runtime.dist import DistContext
from worker.runtime.lifecycle import STOP
from worker.train.trainer import Trainer

MAIN = str(REPO / "worker" / "main.py")
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
COMMON = ["--num-rows", "2000", "--dim", "8", "--log-every", "5", "--eval-batches", "1",
          "--progress", "false", "--staleness", "0", "--batch-size", "48"]
MORE = 11  # steps the resumed run trains after the stop's checkpoint


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _cmd(args: list[str]) -> list[str]:
    return [TORCHRUN, "--standalone", "--nproc_per_node", "2", MAIN, *COMMON, *args]


def run_to_end(args: list[str]) -> str:
    proc = subprocess.run(_cmd(args), cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=240, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stderr[-6000:]}"
    return proc.stderr


def stop_mid_run(tmp_path: Path, args: list[str]) -> tuple[int, str]:
    """A long run that gets SIGTERM once training runs: (the step both ranks stopped
    after, their log)."""
    err = tmp_path / f"stopped-{time.monotonic_ns()}.err"
    with open(err, "w") as fe:
        proc = subprocess.Popen(_cmd([*args, "--steps", "100000"]), cwd=REPO, env=_env(),
                                stdout=subprocess.DEVNULL, stderr=fe)
    try:
        deadline = time.monotonic() + 150
        while "event=ready" not in err.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-6000:]
            time.sleep(0.1)
        time.sleep(1.0)  # some steps in
        proc.send_signal(signal.SIGTERM)  # like `docker stop`: torchrun forwards it
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = err.read_text()
    stopped = [int(m) for m in re.findall(r"event=stopped step=(\d+)", text)]
    assert len(stopped) == 2 and stopped[0] == stopped[1], text[-6000:]
    assert text.count("exit_code=143") == 2, text[-6000:]
    assert (stopped[0] + 1) % 5 == 0  # at an agreement step (--log-every)
    return stopped[0], text


def assert_bitwise(a_path: Path, b_path: Path) -> None:
    a, b = torch.load(a_path), torch.load(b_path)
    for part in ("tables", "dense"):
        assert set(a[part]) == set(b[part]) and a[part]
        for key in a[part]:
            assert torch.equal(a[part][key], b[part][key]), f"{part} {key} differs"


def stop_then_resume(tmp_path: Path, mode: list[str], run_id: str) -> None:
    ck = tmp_path / "ck"
    ids = (["--run-id", f"{run_id}-stopped"], ["--run-id", f"{run_id}-resumed"],
           ["--run-id", f"{run_id}-straight"]) if "--ps" in mode else ([], [], [])
    step, text = stop_mid_run(tmp_path, [*mode, *ids[0], "--checkpoint-dir", str(ck)])
    line = re.findall(rf"event=checkpoint_on_stop step={step} seconds=(\d+\.\d+) ", text)
    assert len(line) == 1, text[-6000:]  # rank 0's, with the time
    assert [s for s, _ in complete_checkpoints(ck)] == [step]
    directory = step_dir(ck, step)
    manifest = read_manifest(directory)
    assert manifest["step"] == step and manifest["world_size"] == 2
    verify_files(directory, manifest)  # every file listed, its size and crc32
    steps = ["--steps", str(step + 1 + MORE)]
    resumed = run_to_end([*mode, *ids[1], *steps, "--checkpoint-dir", str(ck), "--resume",
                          "--dump-state", str(tmp_path / "resumed.pt")])
    assert "resumed from" in resumed and f"(step {step}," in resumed, resumed[-6000:]
    run_to_end([*mode, *ids[2], *steps, "--dump-state", str(tmp_path / "straight.pt")])
    assert_bitwise(tmp_path / "straight.pt", tmp_path / "resumed.pt")


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_stop_checkpoints_and_a_resume_goes_on_bitwise(tmp_path: Path) -> None:
    stop_then_resume(tmp_path, ["--local-optimizer"], "local")


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_stop_checkpoints_on_the_server_and_a_resume_goes_on_bitwise(
        tmp_path: Path, server: PsServer) -> None:
    stop_then_resume(tmp_path, ["--ps", server.address], "onstop")


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_no_checkpoint_on_stop_when_off_and_none_twice(tmp_path: Path) -> None:
    off = tmp_path / "off"
    _, text = stop_mid_run(tmp_path, ["--local-optimizer", "--checkpoint-dir", str(off),
                                      "--checkpoint-on-stop", "false"])
    assert "event=checkpoint_on_stop" not in text
    assert complete_checkpoints(off) == []
    # every agreement step is a checkpoint step: the stop's step is checkpointed once
    again = tmp_path / "again"
    step, text = stop_mid_run(tmp_path, ["--local-optimizer", "--checkpoint-dir", str(again),
                                         "--checkpoint-every", "5", "--checkpoint-keep", "0"])
    assert "event=checkpoint_on_stop" not in text
    assert text.count(f"checkpoint step {step} ->") == 1, text[-6000:]
    assert complete_checkpoints(again)[-1][0] == step


DYNAMIC_TABLES = "user:40:dynamic:lfu:expire=6,ad:30:3:dynamic:threshold=2,s:50"


def _train(cfg: TrainConfig, ctx: DistContext, signal_in_push_of: int = -1
           ) -> tuple[dict[str, torch.Tensor], int, int]:
    """(final tables, last step, prefetched lookups); a stop requested as
    `signal_in_push_of`'s push is handed over: after that step's prefetch."""
    trainer = Trainer(cfg, ctx)
    push = trainer.source.push

    def pushing(step: int, grads: dict[str, tuple[torch.Tensor, torch.Tensor]],
                lr: float | None = None) -> None:
        push(step, grads, lr)
        if step == signal_in_push_of:
            STOP.request("SIGTERM")

    try:
        trainer.source.push = pushing  # type: ignore[method-assign]
        trainer.train()
        tables = trainer.embedding.gather_full(dst=0) or {}
        assert trainer.embedding.dynamic is not None
        return tables, trainer.last_step, trainer.embedding.dynamic.prefetched.taken
    finally:
        trainer.close()
        STOP.clear()


def _dynamic_stop_scenario(ctx: DistContext, tmp: str) -> None:
    cfg = small_config(task="tables", tables=DYNAMIC_TABLES, num_rows=300, steps=20,
                       batch_size=32, staleness=1, eval_batches=1, progress=False,
                       log_every=5, pipeline=True)
    ck = f"{tmp}/ck"
    _, last, taken = _train(cfg.replace(checkpoint_dir=ck), ctx, signal_in_push_of=9)
    # step 9's push comes after step 10's ids were prefetched: the stop is at step 14;
    # steps 2..10 took a prefetched translation, none after the signal
    assert (last, taken) == (14, 9)
    assert [s for s, _ in complete_checkpoints(ck)] == [14]
    verify_files(step_dir(ck, 14), read_manifest(step_dir(ck, 14)))
    resumed, last, _ = _train(cfg.replace(checkpoint_dir=ck, resume=True), ctx)
    assert last == 19
    straight, _, _ = _train(cfg, ctx)
    assert set(straight) == set(resumed) and straight
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), f"table {name}: resumed != straight"


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_stop_after_a_prefetch_checkpoints_no_pending_translation(tmp_path: Path) -> None:
    run_ranks("tests.worker.checkpoint.test_checkpoint_on_stop:_dynamic_stop_scenario", 1,
              str(tmp_path))
