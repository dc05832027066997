"""The dense part's parallelism: FSDP2, HSDP or DDP, and its per-step gradient work.

The dense part (MLPs, relation embeddings; never the sharded tables) is
wrapped per --dense-parallel (auto, the default: ddp, or fsdp where sharding pays,
worker/dense/policy.py; `dense_facts` measures what it decides on) by one `apply_*`
function each:
  fsdp  `apply_fsdp`: FSDP2 `fully_shard` over all ranks (1-D mesh), with
        --reshard-after-forward, --dense-cpu-offload and the mixed precision
        policy of --precision / --reduce-dtype;
  hsdp  `apply_hsdp`: `fully_shard` on a 2-D (replicate, shard) mesh:
        replicate across nodes, shard within a node (--hsdp-shard-size);
  ddp   `apply_ddp`: DistributedDataParallel (--ddp-bucket-mb, --ddp-static-graph,
        --ddp-find-unused-parameters, --ddp-grad-reduce mean|sum).
`build_dense_parallel` picks one and returns a `DenseParallel`, which also
owns what the loop does per step with the dense gradients: the fp16 GradScaler
(whose inf check covers the embedding gradients too, on every rank), the
--clip-grad-norm clipping and the factor the embedding gradients get before
they are pushed. `check_dense_parallel` validates the world-size dependent
numbers before anything is built.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from worker.dense.policy import DenseChoice, DenseFacts, choose_dense_parallel, state_copies
from worker.runtime.dist import DistContext
from worker.runtime.memory import rank_memory_bytes

if TYPE_CHECKING:
    from worker.config.dense_options import DenseConfig
    from worker.embedding.sharded import ShardedEmbedding

Grads = dict[str, tuple[torch.Tensor, torch.Tensor]]  # table -> (ids_U, grads_UD)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class DenseParallelError(ValueError):
    """A --dense-parallel setup this world cannot run; the message names every number."""


# -- checks before anything is built ------------------------------------------------------
def hsdp_mesh_shape(world_size: int, local_world_size: int, shard_size: int = 0
                    ) -> tuple[int, int]:
    """(replicate, shard) of the HSDP mesh: shard within a node, replicate across nodes.

    `shard_size` 0 means LOCAL_WORLD_SIZE (one node per shard group); a positive value
    overrides it (e.g. 4 CPU ranks on one host simulating 2 nodes x 2).
    """
    shard = shard_size or local_world_size
    numbers = (f"world size {world_size}, local world size (LOCAL_WORLD_SIZE) "
               f"{local_world_size}, shard size {shard}"
               + ("" if shard_size else " (= local world size; set --hsdp-shard-size to "
                  "override)"))
    if shard < 1 or shard > world_size:
        raise DenseParallelError(f"--dense-parallel hsdp: shard size must be in 1..world size: "
                                 f"{numbers}")
    if world_size % shard:
        raise DenseParallelError(
            f"--dense-parallel hsdp: world size {world_size} is not divisible by the shard "
            f"size {shard} ({numbers}); the mesh is (world size / shard size) replicas x shard "
            "size ranks")
    return world_size // shard, shard


def check_dense_parallel(cfg: DenseConfig, world_size: int, local_world_size: int,
                         device: torch.device) -> None:
    """DenseParallelError for a setup this world cannot run (call before building)."""
    if cfg.dense_parallel == "hsdp":
        hsdp_mesh_shape(world_size, local_world_size, cfg.hsdp_shard_size)
    if cfg.precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise DenseParallelError(
            f"--precision bf16 on {device} ({torch.cuda.get_device_name(device)}): this GPU "
            "has no bf16 support; use --precision fp16 or fp32")


# -- one apply_* per --dense-parallel choice -----------------------------------------------
def mixed_precision_policy(precision: str = "fp32", reduce_dtype: str = "") -> MixedPrecisionPolicy:
    """--precision/--reduce-dtype -> FSDP2 policy: compute in `precision`, reduce in fp32
    (unless --reduce-dtype), outputs cast back to fp32 so the loss is computed in fp32."""
    param = None if precision == "fp32" else DTYPES[precision]
    reduce = DTYPES[reduce_dtype] if reduce_dtype else (None if param is None else torch.float32)
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce,
                                output_dtype=None if param is None else torch.float32)


def apply_fsdp(module: nn.Module, mesh: DeviceMesh, units: list[nn.Module] | None = None, *,
               reshard_after_forward: bool = True, mp_policy: MixedPrecisionPolicy | None = None,
               offload_policy: OffloadPolicy | None = None) -> nn.Module:
    """FSDP2: shard each of `units` (e.g. transformer blocks), then the root.

    One root unit is the right call for the small MLPs of the bundled tasks:
    every unit costs an all-gather and a reduce-scatter per step. Only the
    dense part goes through here; the embedding rows are sharded by
    ShardedEmbedding and trained by the sparse optimizer, never by FSDP.
    A 1-D mesh shards over all its ranks; a 2-D (replicate, shard) mesh is HSDP.
    """
    kwargs: dict[str, Any] = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy(),
                              "offload_policy": offload_policy or OffloadPolicy()}
    for unit in units or []:
        fully_shard(unit, reshard_after_forward=reshard_after_forward, **kwargs)
    # The root's parameters would be all-gathered again as soon as backward starts, so
    # resharding them after forward buys no memory and costs a collective a step; None
    # lets FSDP2 apply that root heuristic of its own (an explicit True turns it off).
    fully_shard(module, reshard_after_forward=None if reshard_after_forward else False,
                **kwargs)
    return module


def apply_hsdp(module: nn.Module, device: torch.device, world_size: int, local_world_size: int,
               units: list[nn.Module] | None = None, *, shard_size: int = 0,
               **fsdp_kwargs: Any) -> tuple[nn.Module, DeviceMesh]:
    """HSDP: FSDP2 on a (replicate, shard) mesh; gradients reduce-scatter within a shard
    group, then all-reduce across the replicas. Returns (module, mesh)."""
    shape = hsdp_mesh_shape(world_size, local_world_size, shard_size)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))
    return apply_fsdp(module, mesh, units, **fsdp_kwargs), mesh


def _allreduce_sum_hook(group, bucket):  # type: ignore[no-untyped-def]
    """DDP comm hook: all-reduce a bucket WITHOUT the 1/world_size of the default hook.

    (group: ProcessGroup | None, bucket: dist.GradBucket) -> Future[Tensor]. Unannotated on
    purpose: DDP checks the annotation object, and `from __future__ import annotations` would
    make it a string.
    """
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    assert work is not None
    return work.get_future().then(lambda f: f.value()[0])


def apply_ddp(module: nn.Module, device: torch.device, group: dist.ProcessGroup | None, *,
              bucket_mb: float = 25.0, static_graph: bool = False,
              find_unused_parameters: bool = False, grad_reduce: str = "mean"
              ) -> DistributedDataParallel:
    """DistributedDataParallel; grad_reduce 'sum' replaces the averaging with a plain sum."""
    ddp = DistributedDataParallel(
        module, device_ids=[device.index] if device.type == "cuda" else None,
        process_group=group, bucket_cap_mb=bucket_mb, static_graph=static_graph,
        find_unused_parameters=find_unused_parameters)
    if grad_reduce == "sum":
        ddp.register_comm_hook(group, _allreduce_sum_hook)
    return ddp


def compile_dense(module: nn.Module, units: list[nn.Module] | None = None) -> None:
    """torch.compile the forward of each unit (or of the root without units), in place.

    Only `forward` is replaced, so parameter names/state_dict keys stay as they are and the
    FSDP2/DDP hooks around the call stay eager (the embedding all_to_all runs outside the
    dense module anyway). `nn.Module.compile()` is not used: on torch 2.13 Dynamo skips the
    `_call_impl` frame it compiles and silently runs eager.
    """
    for target in units or [module]:
        target.forward = torch.compile(target.forward)  # type: ignore[method-assign]


# -- the per-step arithmetic of the dense gradients ----------------------------------------
class DenseParallel:
    """The wrapped dense module plus what each step does with its gradients.

    The loop calls `backward(loss)` and then `step(optimizer, embedding)`, which returns
    the embedding gradients to push:
      1. fp16: unscale the dense grads (GradScaler; for DTensor grads the inf check is
         reduced over the FSDP mesh), take the embedding grads divided by the same scale,
         and all-reduce "any inf/NaN, dense or embedding, on any rank" so every rank skips
         the same steps;
      2. --clip-grad-norm: torch.nn.utils.clip_grad_norm_ (for FSDP2 DTensor grads the
         norm is the one of the full, un-sharded gradients);
      3. optimizer step (skipped by the scaler on inf/NaN), zero_grad;
      4. the embedding grads times `embedding_grad_scale` (1/W for the mean, 1 for ddp sum),
         or, on a skipped step, zero rows for every table (the step is still pushed so the
         server's step sequence stays contiguous, but nothing changes any row).
    """

    def __init__(self, cfg: DenseConfig, ctx: DistContext, module: nn.Module,
                 mesh_shape: tuple[int, ...], *, choice: DenseChoice,
                 wrapped: bool = True) -> None:
        self.cfg, self.ctx, self.module = cfg, ctx, module
        self.kind = choice.kind  # cfg.dense_parallel is it too (build_dense_parallel)
        self.choice = choice
        self.wrapped = wrapped  # False: one rank, the plain module (wrapper_needed)
        self.mesh_shape = mesh_shape
        sum_reduce = self.kind == "ddp" and cfg.ddp_grad_reduce == "sum"
        self.embedding_grad_scale = 1.0 if sum_reduce else 1.0 / ctx.world_size
        self.scaler: torch.amp.GradScaler | None = None
        if cfg.precision == "fp16":
            self.scaler = torch.amp.GradScaler(ctx.device.type, init_scale=cfg.loss_scale_init)
        self.skipped_steps = 0
        self.steps = 0
        self.grad_norm_last: torch.Tensor | None = None
        self.grad_norm_max = torch.zeros((), device=ctx.device)
        # The root only: its parameters are the first the forward needs, and FSDP2 already
        # prefetches each further unit during forward; gathering every unit up front
        # would hold the whole unsharded model at once (--reshard-after-forward's memory).
        self._prefetch_root: FSDPModule | None = (
            module if cfg.prefetch_dense and isinstance(module, FSDPModule) else None)
        self.prefetching = self._prefetch_root is not None
        self._forward_seen = False
        self.prefetches = 0

    def prefetch(self) -> None:
        """Start the dense parameters' all-gather now (async) rather than at the dense
        forward (--prefetch-dense, fsdp/hsdp): the loop calls it at the top of a step, so
        the collective overlaps the staleness window, the batch and the embedding
        exchange (which run on another process group). FSDP2's pre-forward waits for it;
        a call while the parameters are gathered or in flight is a no-op. The root only
        (see __init__). Skipped until the first backward, i.e. until a forward has run
        FSDP2's lazy init (it picks the root there)."""
        if self._prefetch_root is None or not self._forward_seen:
            return
        self._prefetch_root.unshard(async_op=True)
        self.prefetches += 1

    def backward(self, loss: torch.Tensor) -> None:
        self._forward_seen = True
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def step(self, optimizer: torch.optim.Optimizer, embedding: ShardedEmbedding) -> Grads:
        self.steps += 1
        skip = False
        if self.scaler is None:
            grads = embedding.pop_grads(scale=self.embedding_grad_scale)
        else:
            scale = float(self.scaler.get_scale())  # the scale this backward ran with
            self.scaler.unscale_(optimizer)
            grads = embedding.pop_grads(scale=self.embedding_grad_scale / scale)
            skip = self._found_inf(optimizer, grads)
        if self.cfg.clip_grad_norm > 0 and not skip:
            norm = torch.nn.utils.clip_grad_norm_(list(self.module.parameters()),
                                                  self.cfg.clip_grad_norm)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
            self.grad_norm_last = norm.detach()
            self.grad_norm_max = torch.maximum(self.grad_norm_max, self.grad_norm_last)
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)  # skipped when _found_inf said so
            self.scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if skip:
            self.skipped_steps += 1
            grads = {name: (ids_U[:0], grads_UD[:0]) for name, (ids_U, grads_UD) in grads.items()}
        return grads

    def _found_inf(self, optimizer: torch.optim.Optimizer, grads: Grads) -> bool:
        """Any inf/NaN in the dense or embedding grads of any rank; the scaler is told too."""
        assert self.scaler is not None
        # Where GradScaler.unscale_ left its per-device inf flags (the same private state
        # torch's ShardedGradScaler reads and all-reduces).
        state = self.scaler._per_optimizer_states[id(optimizer)]
        per_device: dict[torch.device, torch.Tensor] = state["found_inf_per_device"]
        found = torch.zeros((), device=self.ctx.device)
        for flag in per_device.values():
            found = torch.maximum(found, flag.to(found.device).reshape(()))
        for _, grads_UD in grads.values():
            if grads_UD.numel():
                found = torch.maximum(found, (~torch.isfinite(grads_UD)).any().float())
        if self.ctx.world_size > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        for flag in per_device.values():
            flag.copy_(found.reshape(flag.shape))
        return bool(found.item())

    def describe(self) -> dict[str, Any]:
        cfg = self.cfg
        out: dict[str, Any] = {
            "parallel": self.kind, "asked": self.choice.requested,
            "because": self.choice.reason, "mesh": list(self.mesh_shape), "compile": cfg.compile,
            "wrapped": self.wrapped,
            "precision": cfg.precision, "embedding_grad_scale": self.embedding_grad_scale,
            "clip_grad_norm": cfg.clip_grad_norm,
            "grad_norm_last": (None if self.grad_norm_last is None
                               else float(self.grad_norm_last)),
            "grad_norm_max": float(self.grad_norm_max) if cfg.clip_grad_norm > 0 else None,
        }
        if self.kind == "ddp":
            out.update(bucket_mb=cfg.ddp_bucket_mb, static_graph=cfg.ddp_static_graph,
                       find_unused_parameters=cfg.ddp_find_unused_parameters,
                       grad_reduce=cfg.ddp_grad_reduce)
        else:
            out.update(reshard_after_forward=cfg.reshard_after_forward,
                       prefetch=self.prefetching, prefetches=self.prefetches,
                       cpu_offload=cfg.dense_cpu_offload, reduce_dtype=cfg.reduce_dtype or (
                           "fp32" if cfg.precision != "fp32" else "param"))
        if self.scaler is not None:
            out.update(loss_scale=float(self.scaler.get_scale()),
                       skipped_steps=self.skipped_steps)
        return out


def wrapper_needed(cfg: DenseConfig, world_size: int) -> bool:
    """Whether the dense wrapper does anything a plain module would not.

    At world size 1 FSDP/HSDP have nothing to shard or gather and DDP nothing to average,
    yet their hooks, flat buffers and (FSDP2) DTensor bookkeeping cost every step, which
    a plain `nn.EmbeddingBag` + SparseAdam loop does not pay. What one rank still needs a
    wrapper for: mixed precision and a reduce dtype (FSDP2's policy casts), CPU offload
    and --prefetch-dense (FSDP2 features)."""
    return (world_size > 1 or cfg.precision != "fp32" or bool(cfg.reduce_dtype)
            or cfg.dense_cpu_offload or cfg.prefetch_dense)


def dense_facts(dense: nn.Module, ctx: DistContext, *, dense_optimizer: str = "adam",
                device_memory_gb: float = 0.0, host_memory_gb: float = 0.0) -> DenseFacts:
    """What --dense-parallel auto decides on, of this module in this world: its parameter
    bytes, the state `dense_optimizer` (the --dense-optimizer kind) keeps a parameter, the
    rank's memory (--device-memory-gb / --host-memory-gb, else detected)."""
    return DenseFacts(
        param_bytes=sum(p.numel() * p.element_size() for p in dense.parameters()),
        state_copies=state_copies(dense_optimizer), world_size=ctx.world_size,
        backend=ctx.backend,
        memory_per_rank=rank_memory_bytes(ctx.device, ctx.local_world_size,
                                          device_memory_gb=device_memory_gb,
                                          host_memory_gb=host_memory_gb))


def build_dense_parallel(cfg: DenseConfig, ctx: DistContext, dense: nn.Module,
                         units: list[nn.Module] | None = None, *,
                         plain_at_one_rank: bool = False,
                         facts: DenseFacts | None = None) -> DenseParallel:
    """Compile (--compile) and wrap `dense` (already on ctx.device) per --dense-parallel.

    auto is decided here (worker/dense/policy.py) on `facts`, by default `dense_facts` of
    `dense` with Adam; the DenseParallel's config says the kind chosen.
    `plain_at_one_rank` (the training loop): at world size 1 leave the module unwrapped
    when the wrapper would change nothing (`wrapper_needed`); the results are bitwise
    those of the wrapped module (tests/worker/dense/test_one_rank.py)."""
    check_dense_parallel(cfg, ctx.world_size, ctx.local_world_size, ctx.device)
    choice = choose_dense_parallel(cfg, facts or dense_facts(dense, ctx))
    cfg = dataclasses.replace(cfg, dense_parallel=choice.kind)
    if cfg.compile:
        compile_dense(dense, units)
    if plain_at_one_rank and not wrapper_needed(cfg, ctx.world_size):
        return DenseParallel(cfg, ctx, dense, (1,), wrapped=False, choice=choice)
    wrapped: nn.Module
    if cfg.dense_parallel == "ddp":
        wrapped = apply_ddp(dense, ctx.device, ctx.mesh.get_group(),
                            bucket_mb=cfg.ddp_bucket_mb, static_graph=cfg.ddp_static_graph,
                            find_unused_parameters=cfg.ddp_find_unused_parameters,
                            grad_reduce=cfg.ddp_grad_reduce)
        return DenseParallel(cfg, ctx, wrapped, (ctx.world_size,), choice=choice)
    fsdp_kwargs: dict[str, Any] = {
        "reshard_after_forward": cfg.reshard_after_forward,
        "mp_policy": mixed_precision_policy(cfg.precision, cfg.reduce_dtype),
        "offload_policy": (CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda")
                           if cfg.dense_cpu_offload else None)}
    if cfg.dense_parallel == "hsdp":
        wrapped, mesh = apply_hsdp(dense, ctx.device, ctx.world_size, ctx.local_world_size,
                                   units, shard_size=cfg.hsdp_shard_size, **fsdp_kwargs)
        return DenseParallel(cfg, ctx, wrapped, tuple(mesh.shape), choice=choice)
    wrapped = apply_fsdp(dense, ctx.mesh, units, **fsdp_kwargs)
    return DenseParallel(cfg, ctx, wrapped, tuple(ctx.mesh.shape), choice=choice)
