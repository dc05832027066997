"""TrainConfig: flags <-> HYBRIDPS_* env vars, precedence, and validation messages."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from hybridps.cli import ConfigError, env_name, flag_name, parse_config
from worker.config import TrainConfig, parse_host_port

SAMPLES: dict[str, tuple[str, object]] = {
    "ps": ("10.0.0.1:5000", "10.0.0.1:5000"),
    "local_optimizer": ("false", False),
    "staleness": ("3", 3),
    "ps_timeout": ("2.5", 2.5),
    "max_chunk_bytes": ("1048576", 1048576),
    "wire_dtype": ("bf16", "bf16"),  # tests/test_wire_fast.py
    "staleness_compensation": ("none", "none"),  # tests/test_staleness.py
    "shm": ("off", "off"),  # tests/test_shm.py
    "shm_mb": ("128", 128),
    "shm_socket": ("off", "off"),  # tests/test_direct.py
    "run_id": ("r1", "r1"),
    "task": ("synthetic", "synthetic"),
    "steps": ("17", 17),
    "epochs": ("2", 2),
    "batch_size": ("9", 9),
    "seed": ("4", 4),
    "optimizer": ("adamw", "adamw"),
    "lr": ("0.5", 0.5),
    "dense_lr": ("0.25", 0.25),
    "weight_decay": ("0.01", 0.01),
    "init_std": ("0.2", 0.2),
    "row_dtype": ("bf16", "bf16"),  # tests/test_row_dtype.py
    "dense_parallel": ("hsdp", "hsdp"),  # dense part: tests/test_dense_parallel.py
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
    "tables": ("a:100,b:20:3", "a:100,b:20:3"),  # --task tables: tests/test_pipeline.py
    "zipf_rows": ("1000", 1000),  # --task tables: tests/test_tables_task.py
    "device": ("cpu", "cpu"),
    "log_every": ("5", 5),
    "eval_batches": ("0", 0),
    "results": ("/tmp/r.json", "/tmp/r.json"),
    "dump_state": ("/tmp/s.pt", "/tmp/s.pt"),
    "progress": ("0", False),
    "pipeline": ("false", False),  # tests/test_pipeline.py
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
    "checkpoint_every": ("0", 0),  # > 0 needs --checkpoint-dir (tests/test_checkpoint.py)
    "checkpoint_keep": ("2", 2),
    "resume": ("false", False),
    "resume_from": ("/tmp/ck/step-0000000009", "/tmp/ck/step-0000000009"),
    "data_dir": ("/data/UMLS", "/data/UMLS"),  # --task kge|dlrm: tests/test_kge_task.py ...
    "model": ("keci", "keci"),
    "training": ("negsample", "negsample"),
    "neg_ratio": ("4", 4),
    "kge": ("loss=ce,reg=n3,reg_weight=0.01", "loss=ce,reg=n3,reg_weight=0.01"),
    "preset": ("fb15k237-complex", "fb15k237-complex"),
    "data_path": ("/data/day_0.tsv", "/data/day_0.tsv"),
    "table_rows": ("100,200", "100,200"),
    "model_config": ("/tmp/m.json", "/tmp/m.json"),
    "eval_every": ("50", 50),
}
BASE = {"HYBRIDPS_OPTIMIZER": "adamw"}  # weight_decay samples need a decaying optimizer


def test_samples_cover_every_field() -> None:
    assert set(SAMPLES) == {f.name for f in dataclasses.fields(TrainConfig)}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_each_field_reads_its_flag_and_env(name: str) -> None:
    text, value = SAMPLES[name]
    base = {"HYBRIDPS_PS": "127.0.0.1:1", **BASE}
    from_env = parse_config(TrainConfig, [], environ={**base, env_name(name): text})
    assert getattr(from_env, name) == value
    from_flag = parse_config(TrainConfig, [flag_name(name), text], environ=base)
    assert getattr(from_flag, name) == value
    assert env_name(name) == "HYBRIDPS_" + name.upper()
    assert flag_name(name) == "--" + name.replace("_", "-")


def test_flag_beats_env_and_env_beats_default() -> None:
    env = {"HYBRIDPS_STALENESS": "4", "HYBRIDPS_LOCAL_OPTIMIZER": "1"}
    assert parse_config(TrainConfig, [], environ=env).staleness == 4
    assert parse_config(TrainConfig, ["--staleness", "2"], environ=env).staleness == 2
    assert parse_config(TrainConfig, ["--local-optimizer"], environ={}).staleness == 1


def test_bool_flag_alone_means_true() -> None:
    cfg = parse_config(TrainConfig, ["--local-optimizer"], environ={})
    assert cfg.local_optimizer and cfg.ps == ""


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
    (["--local-optimizer", "--kge", "reg=n5"], "kge reg='n5' is not one of"),
    (["--local-optimizer", "--kge", "lr=1"], "unknown key 'lr'"),
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
        TrainConfig(local_optimizer=True, staleness=-2)
    assert TrainConfig(ps="[::1]:50061").ps_address == "[::1]:50061"
    assert parse_host_port("[::1]:50061") == ("::1", 50061)
    assert parse_host_port("ps-0.node:7") == ("ps-0.node", 7)


def test_config_module_does_not_import_torch() -> None:
    import subprocess

    code = "import sys, worker.config; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
