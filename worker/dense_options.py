"""Torch-free checks of the dense-part flags (--dense-parallel and friends).

TrainConfig.__post_init__ calls `check_dense_options(self)` so a bad
combination is a usage error (exit 2) before torch is imported. What needs
the world size (the HSDP mesh shape) is checked in worker/parallel.py
(`check_dense_parallel`), still before any model is built.
"""

from __future__ import annotations

import math
from typing import Any

DENSE_PARALLEL = ("fsdp", "hsdp", "ddp")
PRECISIONS = ("fp32", "bf16", "fp16")
REDUCE_DTYPES = ("", "fp32", "bf16", "fp16")
DDP_GRAD_REDUCE = ("mean", "sum")
DDP_BUCKET_MB_DEFAULT = 25.0
LOSS_SCALE_INIT_DEFAULT = 2.0**16
DDP_FIRST_BUCKET_MB = 1.0  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES / 2**20


def check_dense_options(cfg: Any) -> None:
    """ValueError naming the offending values; `cfg` is a TrainConfig (duck-typed)."""
    kind = cfg.dense_parallel
    if kind not in DENSE_PARALLEL:
        raise ValueError(f"dense_parallel={kind!r} is not one of {', '.join(DENSE_PARALLEL)}")
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"precision={cfg.precision!r} is not one of {', '.join(PRECISIONS)}")
    if cfg.reduce_dtype not in REDUCE_DTYPES:
        raise ValueError(f"reduce_dtype={cfg.reduce_dtype!r} is not one of "
                         f"{', '.join(d for d in REDUCE_DTYPES if d)} (or empty: fp32)")
    if cfg.ddp_grad_reduce not in DDP_GRAD_REDUCE:
        raise ValueError(f"ddp_grad_reduce={cfg.ddp_grad_reduce!r} is not one of "
                         f"{', '.join(DDP_GRAD_REDUCE)}")
    if cfg.hsdp_shard_size < 0:
        raise ValueError(f"hsdp_shard_size={cfg.hsdp_shard_size} must be >= 0 "
                         "(0: LOCAL_WORLD_SIZE, the ranks of one node)")
    for name in ("clip_grad_norm", "ddp_bucket_mb", "loss_scale_init"):
        value = getattr(cfg, name)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name}={value!r} must be finite and >= 0")
    if cfg.ddp_bucket_mb <= 0:
        raise ValueError(f"ddp_bucket_mb={cfg.ddp_bucket_mb!r} must be > 0")
    if cfg.loss_scale_init < 1:
        raise ValueError(f"loss_scale_init={cfg.loss_scale_init!r} must be >= 1")

    sharded = kind in ("fsdp", "hsdp")
    if not sharded:  # ddp: FSDP2-only knobs must stay at their defaults
        if cfg.dense_cpu_offload:
            raise ValueError(
                f"dense_cpu_offload=True with dense_parallel={kind!r}: CPU offload is FSDP2's "
                "CPUOffloadPolicy, use --dense-parallel fsdp or hsdp")
        if not cfg.reshard_after_forward:
            raise ValueError(
                f"reshard_after_forward=False with dense_parallel={kind!r}: DDP keeps whole "
                "parameters on every rank and never reshards; the flag is for fsdp/hsdp")
        if cfg.prefetch_dense:
            raise ValueError(
                f"prefetch_dense=True with dense_parallel={kind!r}: DDP gathers no "
                "parameters to prefetch; the flag is for fsdp/hsdp")
        if cfg.precision != "fp32" or cfg.reduce_dtype not in ("", "fp32"):
            raise ValueError(
                f"precision={cfg.precision!r} reduce_dtype={cfg.reduce_dtype!r} with "
                f"dense_parallel={kind!r}: mixed precision comes from FSDP2's "
                "MixedPrecisionPolicy; use --dense-parallel fsdp or hsdp (ddp runs fp32)")
    if kind != "hsdp" and cfg.hsdp_shard_size != 0:
        raise ValueError(f"hsdp_shard_size={cfg.hsdp_shard_size} with dense_parallel={kind!r}: "
                         "the shard size only applies to --dense-parallel hsdp")
    if kind != "ddp":
        ddp_set = [f"{name}={getattr(cfg, name)!r}" for name, default in (
            ("ddp_bucket_mb", DDP_BUCKET_MB_DEFAULT), ("ddp_static_graph", False),
            ("ddp_find_unused_parameters", False), ("ddp_grad_reduce", "mean"))
            if getattr(cfg, name) != default]
        if ddp_set:
            raise ValueError(f"{', '.join(ddp_set)} with dense_parallel={kind!r}: the ddp_* "
                             "flags only apply to --dense-parallel ddp")
    if kind == "ddp" and cfg.compile and cfg.ddp_bucket_mb < DDP_FIRST_BUCKET_MB:
        raise ValueError(
            f"ddp_bucket_mb={cfg.ddp_bucket_mb!r} with --compile: Dynamo's DDPOptimizer splits "
            f"the compiled graph at DDP's buckets and needs them >= DDP's first bucket "
            f"({DDP_FIRST_BUCKET_MB:g} MB)")
    if cfg.precision != "fp16" and cfg.loss_scale_init != LOSS_SCALE_INIT_DEFAULT:
        raise ValueError(f"loss_scale_init={cfg.loss_scale_init!r} with precision="
                         f"{cfg.precision!r}: only --precision fp16 uses a loss scale")
