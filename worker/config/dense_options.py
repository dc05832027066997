"""DenseConfig: how the dense part is parallelised (--dense-parallel and friends). Torch-free.

A bad combination is refused here, while the flags are parsed (exit 2, before torch is
imported). What needs the world size (the HSDP mesh shape) is checked in
worker/dense/parallel.py (`check_dense_parallel`), still before any model is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hybridps.cli import check_settings, setting

ParallelKind = Literal["fsdp", "hsdp", "ddp"]  # what is built
DenseParallelKind = Literal["auto", "fsdp", "hsdp", "ddp"]  # what --dense-parallel asks
Precision = Literal["fp32", "bf16", "fp16"]
ReduceDtype = Literal["", "fp32", "bf16", "fp16"]
GradReduce = Literal["mean", "sum"]
DDP_BUCKET_MB_DEFAULT = 25.0
LOSS_SCALE_INIT_DEFAULT = 2.0**16
DDP_FIRST_BUCKET_MB = 1.0  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES / 2**20


@dataclass(frozen=True)
class DenseConfig:
    """The dense part: FSDP2, HSDP or DDP (worker/dense/parallel.py), precision, clipping."""

    dense_parallel: DenseParallelKind = setting(
        "auto", "auto (ddp, or fsdp where sharding pays: worker/dense/policy.py; --plan and "
        "the summary say which and why) | fsdp (FSDP2 over all ranks) | hsdp (replicate "
        "across nodes, shard within) | ddp")
    reshard_after_forward: bool = setting(
        True, "fsdp/hsdp: free the gathered dense parameters of each unit after forward (the "
        "root's are kept for backward, which would gather them again at once)")
    prefetch_dense: bool = setting(
        False, "fsdp/hsdp: start the all-gather of the dense root's parameters at the top of "
        "each step (async), so it runs during the staleness window, the batch and the "
        "embedding exchange instead of at the dense forward (measurements: "
        "docs/performance-log.md)")
    dense_cpu_offload: bool = setting(
        False, "fsdp/hsdp: sharded dense params, grads, optimizer step on CPU "
        "(CPUOffloadPolicy)")
    precision: Precision = setting(
        "fp32", "fsdp/hsdp dense compute dtype (fp16: with a GradScaler)")
    reduce_dtype: ReduceDtype = setting(
        "", "fsdp/hsdp gradient reduce dtype (empty: fp32)")
    loss_scale_init: float = setting(
        LOSS_SCALE_INIT_DEFAULT, "--precision fp16: initial loss scale of the GradScaler", "S",
        at_least=0)
    hsdp_shard_size: int = setting(
        0, "hsdp: ranks per shard group (0: LOCAL_WORLD_SIZE, one node)", "N", at_least=0)
    ddp_bucket_mb: float = setting(
        DDP_BUCKET_MB_DEFAULT, "ddp: gradient bucket size (bucket_cap_mb)", "MB", at_least=0)
    ddp_static_graph: bool = setting(False, "ddp: static_graph")
    ddp_find_unused_parameters: bool = setting(False, "ddp: find_unused_parameters")
    ddp_grad_reduce: GradReduce = setting(
        "mean", "ddp: mean (gradient of the global mean loss) | sum (of the sum over ranks of "
        "each rank's mean loss, i.e. world_size x; embedding gradients follow)")
    compile: bool = setting(
        False, "torch.compile the dense part (the embedding all_to_all stays eager)")
    clip_grad_norm: float = setting(
        0.0, "clip the dense part's total gradient norm (over the full parameters) to X "
        "(0: off)", "X", at_least=0)

    def __post_init__(self) -> None:
        check_settings(self)
        if self.ddp_bucket_mb <= 0:
            raise ValueError(f"ddp_bucket_mb={self.ddp_bucket_mb!r} must be > 0")
        if self.loss_scale_init < 1:
            raise ValueError(f"loss_scale_init={self.loss_scale_init!r} must be >= 1")
        self._check_combination()

    def _check_combination(self) -> None:
        kind = self.dense_parallel
        if kind == "ddp":  # FSDP2-only knobs must stay at their defaults
            if self.dense_cpu_offload:
                raise ValueError(
                    f"dense_cpu_offload=True with dense_parallel={kind!r}: CPU offload is "
                    "FSDP2's CPUOffloadPolicy, use --dense-parallel fsdp or hsdp")
            if not self.reshard_after_forward:
                raise ValueError(
                    f"reshard_after_forward=False with dense_parallel={kind!r}: DDP keeps "
                    "whole parameters on every rank and never reshards; the flag is for "
                    "fsdp/hsdp")
            if self.prefetch_dense:
                raise ValueError(
                    f"prefetch_dense=True with dense_parallel={kind!r}: DDP gathers no "
                    "parameters to prefetch; the flag is for fsdp/hsdp")
            if self.precision != "fp32" or self.reduce_dtype not in ("", "fp32"):
                raise ValueError(
                    f"precision={self.precision!r} reduce_dtype={self.reduce_dtype!r} with "
                    f"dense_parallel={kind!r}: mixed precision comes from FSDP2's "
                    "MixedPrecisionPolicy; use --dense-parallel fsdp or hsdp (ddp runs fp32)")
        if kind != "hsdp" and self.hsdp_shard_size != 0:
            raise ValueError(f"hsdp_shard_size={self.hsdp_shard_size} with dense_parallel="
                             f"{kind!r}: the shard size only applies to --dense-parallel hsdp")
        if kind != "ddp":
            ddp_set = [f"{name}={getattr(self, name)!r}" for name, default in (
                ("ddp_bucket_mb", DDP_BUCKET_MB_DEFAULT), ("ddp_static_graph", False),
                ("ddp_find_unused_parameters", False), ("ddp_grad_reduce", "mean"))
                if getattr(self, name) != default]
            if ddp_set:
                raise ValueError(f"{', '.join(ddp_set)} with dense_parallel={kind!r}: the "
                                 "ddp_* flags only apply to --dense-parallel ddp")
        if kind == "ddp" and self.compile and self.ddp_bucket_mb < DDP_FIRST_BUCKET_MB:
            raise ValueError(
                f"ddp_bucket_mb={self.ddp_bucket_mb!r} with --compile: Dynamo's DDPOptimizer "
                f"splits the compiled graph at DDP's buckets and needs them >= DDP's first "
                f"bucket ({DDP_FIRST_BUCKET_MB:g} MB)")
        if self.precision != "fp16" and self.loss_scale_init != LOSS_SCALE_INIT_DEFAULT:
            raise ValueError(f"loss_scale_init={self.loss_scale_init!r} with precision="
                             f"{self.precision!r}: only --precision fp16 uses a loss scale")
