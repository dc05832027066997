"""--dense-parallel auto: replicate the dense part (DDP) unless sharding it (FSDP2) pays.

Torch-free: the worker (worker/dense/parallel.py `dense_facts`) and the plan (worker/plan.py)
call `choose_dense_parallel` with the same `DenseFacts`, so `--plan` shows the choice the
run makes. An explicit --dense-parallel fsdp|hsdp|ddp is taken as it is.

Under auto, in this order:
  1. a flag only FSDP2 has (--precision bf16|fp16, --reduce-dtype, --dense-cpu-offload,
     --prefetch-dense, --reshard-after-forward false) -> fsdp: the flag asks for it;
  2. one rank -> ddp: nothing to shard or to average (the loop runs the plain module);
  3. memory: the dense part's parameters + gradients + optimizer state, replicated on every
     rank, above SHARD_MEMORY_SHARE of a rank's memory (its GPU; on the CPU the host's
     memory over the ranks that share it) -> fsdp: sharding keeps 1/W of them per rank;
  4. speed: on NCCL from SHARD_SPEED_PARAM_BYTES of parameters at SHARD_SPEED_MIN_WORLD
     ranks or more -> fsdp (a paper figure, docs/performance.md "The dense part"); on gloo
     never: measured on a 2-core CPU host, FSDP2 full sharding is 1.4-2.8x slower than
     DDP from 0.1 to 48 MB of parameters (bench/bench_dense_parallel.py);
  5. else ddp: replication costs one all-reduce a step and no per-step gather.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridps.optim_kinds import DENSE_OPTIMIZERS
from worker.config.dense_options import DenseConfig, ParallelKind

SHARD_MEMORY_SHARE = 0.10  # replicated dense state above this share of a rank's memory
SHARD_SPEED_PARAM_BYTES = 10**9  # NCCL: fp32 dense parameters from which FSDP2 is faster
SHARD_SPEED_MIN_WORLD = 4  # NCCL: below it the optimizer work sharding saves is too small
# optimizer state tensors a parameter, by the dense optimizer's torch class (SGD without
# momentum, as DENSE_OPTIMIZERS builds it)
STATE_COPIES = {"Adam": 2, "AdamW": 2, "Adagrad": 1, "SGD": 0}
MB = 10**6


def state_copies(dense_optimizer: str) -> int:
    """Optimizer state tensors a dense parameter has under `dense_optimizer` (the
    --dense-optimizer kind, OptimConfig.dense_kind)."""
    return STATE_COPIES[DENSE_OPTIMIZERS[dense_optimizer].torch_class]


@dataclass(frozen=True)
class DenseFacts:
    """What the choice reads: the dense part's size and the world it trains in."""

    param_bytes: int  # the dense parameters (fp32: 4 a parameter)
    state_copies: int  # optimizer state tensors a parameter (Adam: m and v, 2)
    world_size: int
    backend: str  # the dense collectives' backend: gloo | nccl
    memory_per_rank: int | None  # bytes of one rank's memory (None: not known)

    @property
    def replicated_bytes(self) -> int:
        """Parameters + gradients + optimizer state, whole on every rank (ddp)."""
        return self.param_bytes * (2 + self.state_copies)


@dataclass(frozen=True)
class DenseChoice:
    kind: ParallelKind  # fsdp | hsdp | ddp: what is built
    requested: str  # the --dense-parallel value: auto or the kind
    reason: str  # one line: the numbers the choice was made on

    def describe(self) -> str:
        return f"{self.kind} ({self.requested}: {self.reason})"


def fsdp_flags(cfg: DenseConfig) -> list[str]:
    """The flags set in `cfg` that only FSDP2 implements."""
    return [flag for flag, on in (
        (f"--precision {cfg.precision}", cfg.precision != "fp32"),
        (f"--reduce-dtype {cfg.reduce_dtype}", bool(cfg.reduce_dtype)),
        ("--dense-cpu-offload", cfg.dense_cpu_offload),
        ("--prefetch-dense", cfg.prefetch_dense),
        ("--reshard-after-forward false", not cfg.reshard_after_forward)) if on]


def _size(n: float) -> str:
    for unit, scale in (("GB", 10**9), ("MB", MB), ("KB", 10**3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def choose_dense_parallel(cfg: DenseConfig, facts: DenseFacts) -> DenseChoice:
    """The wrapper the dense part gets (module doc: the rule)."""
    if cfg.dense_parallel != "auto":
        return DenseChoice(cfg.dense_parallel, cfg.dense_parallel, "as asked")
    flags = fsdp_flags(cfg)
    if flags:
        return DenseChoice("fsdp", "auto", f"{', '.join(flags)}: FSDP2 only")
    if facts.world_size == 1:
        return DenseChoice("ddp", "auto", "one rank: nothing to shard")
    replicated, world = facts.replicated_bytes, facts.world_size
    state = f"params+grads+state {_size(replicated)} replicated"
    memory = facts.memory_per_rank
    share = ("memory unknown" if memory is None
             else f"{SHARD_MEMORY_SHARE:g} x {_size(memory)} a rank")
    if memory is not None and replicated > SHARD_MEMORY_SHARE * memory:
        return DenseChoice("fsdp", "auto", f"{state} > {share}")
    if (facts.backend == "nccl" and world >= SHARD_SPEED_MIN_WORLD
            and facts.param_bytes >= SHARD_SPEED_PARAM_BYTES):
        return DenseChoice("fsdp", "auto", f"params {_size(facts.param_bytes)} >= "
                                           f"{_size(SHARD_SPEED_PARAM_BYTES)} on nccl at "
                                           f"{world} ranks: sharding is faster")
    speed = ("gloo: DDP faster" if facts.backend != "nccl"
             else f"nccl: params < {_size(SHARD_SPEED_PARAM_BYTES)} or < "
                  f"{SHARD_SPEED_MIN_WORLD} ranks")
    return DenseChoice("ddp", "auto", f"{state} {'' if memory is None else '<= '}{share}; "
                                      f"{speed}")
