"""TrainConfig: flags <-> HYBRIDPS_* env vars, precedence, and validation messages."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from hybridps.cli import (
    ConfigError,
    env_name,
    flag_name,
    parse_config,
    section,
    setting,
    settings,
)
from worker.config.train_config import TrainConfig, parse_host_port

SAMPLES: dict[str, tuple[str, object]] = {
    "ps": ("10.0.0.1:5000", "10.0.0.1:5000"),
    "local_optimizer": ("false", False),
    "staleness": ("3", 3),
    "ps_timeout": ("2.5", 2.5),
    "local_memory_budget_mb": ("512", 512),  # these four: with --local-optimizer (LOCAL)
    "local_spill_dir": ("/tmp/spill", "/tmp/spill"),
    "local_spill_max_gb": ("1.5", 1.5),
    "local_spill_page_kb": ("16", 16),
    "max_chunk_bytes": ("1048576", 1048576),
    "wire_dtype": ("bf16", "bf16"),  # tests/worker/sync/test_wire_fast.py
    "staleness_compensation": ("none", "none"),  # tests/worker/updates/test_staleness.py
    "same_node": ("require", "require"),  # tests/worker/sync/test_shm.py
    "same_node_mb": ("128", 128),
    "run_id": ("r1", "r1"),
    "task": ("synthetic", "synthetic"),
    "steps": ("17", 17),
    "epochs": ("2", 2),
    "batch_size": ("9", 9),
    "time_budget": ("12.5", 12.5),  # tests/worker/train/test_time_budget.py
    "seed": ("4", 4),
    "optimizer": ("adamw", "adamw"),
    "dense_optimizer": ("adagrad", "adagrad"),
    "lr": ("0.5", 0.5),
    "dense_lr": ("0.25", 0.25),
    "weight_decay": ("0.01", 0.01),
    "init_std": ("0.2", 0.2),
    "row_dtype": ("bf16", "bf16"),  # tests/worker/embedding/test_row_dtype.py
    "dense_parallel": ("hsdp", "hsdp"),  # dense part: tests/worker/dense/test_dense_parallel.py
    "reshard_after_forward": ("false", False),
    "prefetch_dense": ("true", True),
    "dense_cpu_offload": ("true", True),
    "precision": ("bf16", "bf16"),
    "reduce_dtype": ("bf16", "bf16"),
    "loss_scale_init": ("65536", 65536.0),  # another value needs --precision fp16
    "hsdp_shard_size": ("0", 0),  # > 0 needs --dense-parallel hsdp
    "ddp_bucket_mb": ("25", 25.0),  # ddp_* other than the default need --dense-parallel ddp
    "ddp_static_graph": ("false", False),
    "ddp_find_unused_parameters": ("0", False),
    "ddp_grad_reduce": ("mean", "mean"),
    "compile": ("true", True),
    "clip_grad_norm": ("1.5", 1.5),
    "num_rows": ("1234", 1234),
    "dim": ("8", 8),
    "tables": ("a:100,b:20:3", "a:100,b:20:3"),  # --task tables:
                                                 # tests/worker/train/test_pipeline.py
    "zipf_rows": ("1000", 1000),  # --task tables: tests/worker/tasks/test_tables_task.py
    "device": ("cpu", "cpu"),
    "log_every": ("5", 5),
    "eval_batches": ("0", 0),
    "results": ("/tmp/r.json", "/tmp/r.json"),
    "tensorboard": ("runs/tb", "runs/tb"),  # tests/worker/report/test_tensorboard.py
    "dump_state": ("/tmp/s.pt", "/tmp/s.pt"),
    "progress": ("0", False),
    "pipeline": ("false", False),  # tests/worker/train/test_pipeline.py
    "pool_at": ("owner", "owner"),  # tests/worker/embedding/test_pooled_e2e.py
    "group_tables": ("false", False),  # tests/worker/embedding/test_group_tables.py
    "sharding": ("table_wise", "table_wise"),  # tests/worker/embedding/test_sharding_e2e.py
    "auth_token_file": ("/tmp/token", "/tmp/token"),
    "tls": ("true", True),
    "tls_ca": ("/tmp/ca.pem", "/tmp/ca.pem"),
    "tls_cert": ("/tmp/c.pem", "/tmp/c.pem"),  # without --tls-key: refused at start (exit 2)
    "tls_key": ("/tmp/c.key", "/tmp/c.key"),
    "tls_server_name": ("node0", "node0"),
    "log_level": ("debug", "debug"),
    "plan": ("1", True),
    "device_memory_gb": ("80", 80.0),
    "host_memory_gb": ("512.5", 512.5),
    "checkpoint_dir": ("/tmp/ck", "/tmp/ck"),
    "checkpoint_every": ("0", 0),  # > 0 needs --checkpoint-dir
                                   # (tests/worker/checkpoint/test_checkpoint.py)
    "checkpoint_mode": ("full", "full"),  # tests/worker/checkpoint/test_incremental.py
    "checkpoint_full_every": ("4", 4),
    "checkpoint_keep": ("2", 2),
    "checkpoint_on_stop": ("false", False),
    "checkpoint_async": ("false", False),
    "resume": ("false", False),
    "resume_from": ("/tmp/ck/step-0000000009", "/tmp/ck/step-0000000009"),
    "data_dir": ("/data/UMLS", "/data/UMLS"),  # --task kge|dlrm:
                                               # tests/worker/tasks/kge/test_kge_task.py ...
    "model": ("keci", "keci"),
    "training": ("negsample", "negsample"),
    "neg_ratio": ("4", 4),
    # --task kge trainer (worker/config/kge_options.py)
    "preset": ("fb15k237-complex", "fb15k237-complex"),
    "loss": ("ce", "ce"),
    "label_smoothing": ("0.1", 0.1),
    "reg": ("n3", "n3"),
    "reg_weight": ("0.05", 0.05),
    "rel_reg_weight": ("0.01", 0.01),
    "entity_dropout": ("0.2", 0.2),
    "relation_dropout": ("0.1", 0.1),
    "warmup_epochs": ("1.5", 1.5),
    "plateau_factor": ("0.5", 0.5),
    "plateau_patience": ("3", 3),
    "min_lr_scale": ("0.01", 0.01),
    "early_stop_patience": ("4", 4),
    "eval_every_epochs": ("2", 2),
    "eval_budget": ("0.05", 0.05),
    "eval_test": ("false", False),
    "keep_best": ("false", False),
    "on_collapse": ("warn", "warn"),  # tests/worker/tasks/kge/test_kge_collapse.py
    "planted_community": ("4", 4),
    "planted_relations": ("3", 3),
    "planted_test": ("50", 50),
    "data_path": ("/data/day_0.tsv", "/data/day_0.tsv"),
    "table_rows": ("100,200", "100,200"),
    "model_config": ("/tmp/m.json", "/tmp/m.json"),
    "eval_every": ("50", 50),
    # --task files: tests/worker/data/
    "train_files": ("/data/train-*.parquet", "/data/train-*.parquet"),
    "valid_files": ("/data/valid-*.parquet", "/data/valid-*.parquet"),
    "features": ("/tmp/f.json", "/tmp/f.json"),
    "pooling": ("sum", "sum"),
    "id_overflow": ("hash", "hash"),
    "shuffle_buffer": ("0", 0),
    "data_workers": ("2", 2),
}
BASE = {"HYBRIDPS_OPTIMIZER": "adamw"}  # weight_decay samples need a decaying optimizer
LOCAL = {"local_memory_budget_mb", "local_spill_dir", "local_spill_max_gb",
         "local_spill_page_kb"}


def test_samples_cover_every_field() -> None:
    assert set(SAMPLES) == {s.name for s in settings(TrainConfig)}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_each_field_reads_its_flag_and_env(name: str) -> None:
    text, value = SAMPLES[name]
    base = {"HYBRIDPS_PS": "127.0.0.1:1", **BASE}
    if name in LOCAL:
        base = {"HYBRIDPS_LOCAL_OPTIMIZER": "1", "HYBRIDPS_LOCAL_MEMORY_BUDGET_MB": "64", **BASE}
    from_env = parse_config(TrainConfig, [], environ={**base, env_name(name): text})
    assert from_env.flat()[name] == value
    from_flag = parse_config(TrainConfig, [flag_name(name), text], environ=base)
    assert from_flag.flat()[name] == value
    assert env_name(name) == "HYBRIDPS_" + name.upper()
    assert flag_name(name) == "--" + name.replace("_", "-")


def test_flag_beats_env_and_env_beats_default() -> None:
    env = {"HYBRIDPS_STALENESS": "4", "HYBRIDPS_LOCAL_OPTIMIZER": "1"}
    assert parse_config(TrainConfig, [], environ=env).sync.staleness == 4
    assert parse_config(TrainConfig, ["--staleness", "2"], environ=env).sync.staleness == 2
    assert parse_config(TrainConfig, ["--local-optimizer"], environ={}).sync.staleness == 1


def test_bool_flag_alone_means_true() -> None:
    cfg = parse_config(TrainConfig, ["--local-optimizer"], environ={})
    assert cfg.sync.local_optimizer and cfg.sync.ps == ""


@pytest.mark.parametrize(("argv", "message"), [
    (["--local-optimizer", "--staleness", "-1"], "staleness=-1 must be >= 0"),
    (["--ps", "localhost"], "ps='localhost' is not HOST:PORT"),
    (["--ps", "localhost:99999"], "port 99999 is outside 1..65535"),
    (["--ps", "a b:1"], "ps='a b:1' is not HOST:PORT"),
    ([], "--ps HOST:PORT is required unless --local-optimizer"),
    (["--ps", "h:1", "--local-optimizer"], "ps='h:1' given together with --local-optimizer"),
    (["--local-optimizer", "--optimizer", "lamb"], "optimizer='lamb' is not one of"),
    (["--local-optimizer", "--weight-decay", "0.1"], "weight_decay=0.1 with optimizer='adam'"),
    (["--local-optimizer", "--device", "tpu"], "device='tpu' is not one of"),
    (["--local-optimizer", "--steps", "0"], "steps=0 must be >= 1"),
    (["--local-optimizer", "--batch-size", "0"], "batch_size=0 must be >= 1"),
    (["--local-optimizer", "--ps-timeout", "0"], "ps_timeout=0.0 must be"),
    (["--local-optimizer", "--lr", "nan"], "lr=nan must be finite"),
    (["--local-optimizer", "--max-chunk-bytes", "100"], "max_chunk_bytes=100 must be >= 65536"),
    (["--local-optimizer", "--reg", "n5"], "reg='n5' is not one of"),
    (["--local-optimizer", "--preset", "nope"], "preset='nope' is not one of"),
    (["--local-optimizer", "--task", "no such"], "task='no such' is not a task name"),
    (["--local-optimizer", "--staleness", "x"], "--staleness='x': expected int"),
    (["--local-optimizer", "--zipf-rows", "-1"], "zipf_rows=-1 must be >= 0"),
])
def test_validation_errors_name_the_value(argv: list[str], message: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_config(TrainConfig, argv, environ={})
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_env_errors_name_the_variable() -> None:
    import argparse

    from hybridps.cli import from_namespace
    ns = argparse.Namespace()
    with pytest.raises(ConfigError, match="HYBRIDPS_STALENESS='soon'"):
        from_namespace(TrainConfig, ns, {"HYBRIDPS_STALENESS": "soon"})


def test_direct_construction_validates() -> None:
    with pytest.raises(ValueError, match="staleness=-2"):
        TrainConfig.of(local_optimizer=True, staleness=-2)
    assert TrainConfig.of(ps="[::1]:50061").sync.ps_address == "[::1]:50061"
    assert parse_host_port("[::1]:50061") == ("::1", 50061)
    assert parse_host_port("ps-0.node:7") == ("ps-0.node", 7)


@pytest.mark.e2e
def test_config_module_does_not_import_torch() -> None:
    code = "import sys, worker.config.train_config; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# -- one error line, last, before torch ------------------------------------------------------

def _run_main(module_code: str, *argv: str) -> tuple[int, str, list[str]]:
    """Run an entry point in a fresh interpreter: (exit code, stderr, heavy modules loaded)."""
    code = (f"import sys, runpy; sys.argv = ['prog', *{list(argv)!r}]\n"
            f"try:\n    {module_code}\nexcept SystemExit as exc:\n    code = exc.code\n"
            "print(code, *[m for m in ('torch', 'grpc') if m in sys.modules])")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True, cwd=str(ROOT), env=env)
    code_s, *heavy = proc.stdout.split()
    return int(code_s), proc.stderr, heavy


ROOT = Path(__file__).resolve().parents[3]
WORKER_MAIN = "runpy.run_path('worker/main.py', run_name='__main__')"
PS_MAIN = "runpy.run_module('ps', run_name='__main__', alter_sys=True)"


@pytest.mark.e2e
@pytest.mark.parametrize(("entry", "argv", "message"), [
    (PS_MAIN, ["--port", "abc"], "python -m ps: error: --port='abc': expected int"),
    (PS_MAIN, ["--port", "70000"], "--port 70000 must be in [0, 65535]"),
    (PS_MAIN, ["--shm", "maybe"], "--shm='maybe': expected bool"),
    (WORKER_MAIN, ["--ps", "h:1", "--steps", "x"], "--steps='x': expected int"),
    (WORKER_MAIN, ["--ps", "h:1", "--wire-dtype", "fp8"], "wire_dtype='fp8' is not one of"),
    (WORKER_MAIN, ["--ps", "h:1", "--shm", "on"], "unrecognized arguments: --shm on"),
    (WORKER_MAIN, ["--ps", "h:1", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_a_bad_flag_is_one_line_last_before_torch(entry: str, argv: list[str],
                                                  message: str) -> None:
    code, err, heavy = _run_main(entry, *argv)
    lines = err.strip().splitlines()
    assert code == 2
    assert message in lines[-1], err
    assert len(lines) <= 2, f"more than a usage hint before the error:\n{err}"
    assert heavy == [], f"{heavy} imported before the flags were checked"


def test_the_worker_ignores_variables_that_are_not_its_settings() -> None:
    # HYBRIDPS_SHM configures the server; HYBRIDPS_SHM_MB and HYBRIDPS_SHM_SOCKET name no
    # setting at all
    plain = parse_config(TrainConfig, ["--local-optimizer"], environ={})
    cfg = parse_config(TrainConfig, ["--local-optimizer"],
                       environ={"HYBRIDPS_SHM": "false", "HYBRIDPS_SHM_SOCKET": "false",
                                "HYBRIDPS_SHM_MB": "8"})
    assert cfg == plain and cfg.node.same_node == "auto"


@pytest.mark.parametrize(("same_node", "shm"), [
    ("auto", "auto"), ("off", "off"), ("require", "on")])
def test_same_node_maps_to_the_client_arguments(same_node: str, shm: str) -> None:
    from worker.config.train_config import SHM_MODES

    args = TrainConfig.of(ps="h:1", same_node=same_node, same_node_mb=3).node.client_args()
    assert args == {"shm": shm, "shm_bytes": 3 << 20}
    assert args["shm"] in SHM_MODES


# -- the config tree -------------------------------------------------------------------------

def test_sections_group_the_settings_by_concern() -> None:
    paths = {s.name: s.path for s in settings(TrainConfig)}
    assert paths["staleness"] == ("sync", "staleness")
    assert paths["same_node"] == ("node", "same_node")
    assert paths["neg_ratio"] == ("kge", "neg_ratio")
    assert paths["zipf_rows"] == ("tables", "zipf_rows")
    assert paths["data_path"] == ("dlrm", "data_path")
    assert paths["checkpoint_every"] == ("checkpoint", "checkpoint_every")
    assert paths["dense_parallel"] == ("dense", "dense_parallel")
    assert paths["tls_ca"] == ("security", "tls_ca")
    cfg = TrainConfig.of(local_optimizer=True, task="kge", data_dir="/d", model="keci")
    assert cfg.kge.model == "keci" and cfg.run.task == "kge"


def test_flat_values_round_trip_and_replace_revalidates() -> None:
    cfg = TrainConfig.of(local_optimizer=True, dim=8, staleness=3)
    assert TrainConfig.of(**cfg.flat()) == cfg
    assert cfg.replace(staleness=0).sync.staleness == 0 and cfg.sync.staleness == 3
    with pytest.raises(ValueError, match="staleness=-1"):
        cfg.replace(staleness=-1)
    with pytest.raises(TypeError, match="no setting 'stalenes'"):
        TrainConfig.of(stalenes=1)


@dataclass(frozen=True)
class _PartA:
    x: int = setting(1, "x")


@dataclass(frozen=True)
class _PartB:
    x: int = setting(2, "x again")


@dataclass(frozen=True)
class _TwoX:
    a: _PartA = section(_PartA, "a")
    b: _PartB = section(_PartB, "b")


def test_a_setting_name_used_twice_is_refused() -> None:
    with pytest.raises(TypeError, match=r"'x' appears twice: a\.x and b\.x"):
        settings(_TwoX)


def test_help_lists_the_everyday_flags_first_then_one_heading_per_section(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config(TrainConfig, ["--help"], prog="worker/main.py", environ={})
    out = capsys.readouterr().out
    headings = [line[:-1] for line in out.splitlines() if line and not line.startswith(" ")
                and line.endswith(":")]
    assert headings[:2] == ["options", "everyday flags"], headings
    everyday = out.split("everyday flags:")[1].split("\n\n")[0]
    for flag in ("--ps", "--task", "--steps", "--epochs", "--batch-size", "--lr",
                 "--staleness", "--results", "--checkpoint-dir", "--resume"):
        assert f"  {flag} " in everyday, flag
    for title in ("shard server and staleness", "same-node fast path", "dense part",
                  "checkpoints", "--task kge", "--task dlrm"):
        assert any(h.startswith(title) for h in headings), title
    assert "--shm " not in out  # removed


def test_choice_lists_agree_with_their_users() -> None:
    """One list per choice (the Literal); the torch-side maps must cover exactly it."""
    from typing import get_args

    import ps.core.partition
    import ps.core.shard_core
    from ps import config as ps_config
    from worker.config.task_options import KGE_MODELS
    from worker.config.train_config import RowDtype, WireDtype
    from worker.embedding.sharded import ROW_DTYPES
    from worker.sync.client import WIRE_DTYPES
    from worker.tasks.kge.models import _MODELS

    assert set(get_args(WireDtype)) == set(WIRE_DTYPES)
    assert set(get_args(RowDtype)) == set(ROW_DTYPES)
    assert set(KGE_MODELS) == set(_MODELS)
    assert ps_config.DEFAULT_FLUSH_TIMEOUT_S == ps.core.shard_core.DEFAULT_FLUSH_TIMEOUT_S
    assert ps_config.DEFAULT_ANSWER_CACHE_STEPS == ps.core.partition.DEFAULT_ANSWER_CACHE_STEPS
    assert ps_config.DEFAULT_RATE_WINDOW_S == ps.core.partition.DEFAULT_RATE_WINDOW_S
