"""Data parallel and ZeRO, applied over a built model: DDP (stage 0), DDP + sharded optimizer (stage 1),
FSDP2 without / with resharding after forward (stages 2 / 3), HSDP on a 2-D mesh, CPU offload, DDP
gradient compression hooks, and the mixed-precision policy for sharded parameters."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.nn.parallel import DistributedDataParallel

from shardforge.config.parallel_schema import ParallelSection
from shardforge.dtypes import PRECISION_DTYPES
from shardforge.models.moe import moe_layers
from shardforge.parallel.dims import ParallelDims


def apply_data_parallel(
    model: nn.Module,
    dims: ParallelDims,
    mesh: DeviceMesh | None,
    parallel: ParallelSection,
    precision: str,
    device: torch.device,
    roots: list[nn.Module] | None = None,
    experts_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Wrap or shard `model` for data parallelism; returns the module to call in the training loop.
    `roots` are the modules that run forward (pipeline stages; default: the model itself): FSDP2 shards
    each one's blocks, then the root with what remains (embedding, norm, head). Under expert parallel
    (`experts_mesh`, parallel/expert_parallel.py) each MoE layer's experts are a unit of their own, sharded
    over the ranks that hold the same experts (edp)."""
    dp_mesh = dims.dp_mesh(mesh)
    if dp_mesh is None:
        return model
    if dims.sharded:
        if model.critic is not None:  # PPO's separate critic: units of its own, not part of the policy's root
            _fully_shard(model.critic, dp_mesh, dims.zero_stage, parallel, precision, device)
        for root in roots or [model]:
            if experts_mesh is not None:
                _fully_shard_experts(root, experts_mesh["edp"], dims, parallel, precision, device)
            _fully_shard(root, dp_mesh, dims.zero_stage, parallel, precision, device)
        return model
    ddp = DistributedDataParallel(
        model,
        process_group=dp_mesh.get_group(),
        device_ids=[device.index] if device.type == "cuda" else None,
        broadcast_buffers=False,  # RoPE frequencies and MoE expert biases: identical everywhere by design
    )
    _register_compression(ddp, parallel, dp_mesh)
    return ddp


def _policies(parallel: ParallelSection, precision: str, device: torch.device):
    param_dtype = None if precision == "fp32" else PRECISION_DTYPES[precision]
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=PRECISION_DTYPES[parallel.reduce_dtype])
    # Pinned host memory needs an accelerator; on a CPU-only machine plain memory is the only choice.
    offload = (
        CPUOffloadPolicy(pin_memory=device.type == "cuda")
        if parallel.offload == "params"
        else OffloadPolicy()
    )
    return mp, offload


def _fully_shard_experts(
    model: nn.Module,
    mesh: DeviceMesh,
    dims: ParallelDims,
    parallel: ParallelSection,
    precision: str,
    device: torch.device,
) -> None:
    """Each MoE layer's experts as an FSDP2 unit over `mesh` (edp), averaging their gradients over it (the
    experts' own 1 / ep scale makes that the average over all data-parallel ranks; a divide factor would
    need a pre-multiplied reduction, which gloo lacks)."""
    mp, offload = _policies(parallel, precision, device)
    for layer in moe_layers(model):
        fully_shard(layer.experts, mesh=mesh, reshard_after_forward=dims.zero_stage == 3, mp_policy=mp,
                    offload_policy=offload)  # fmt: skip


def _fully_shard(
    model: nn.Module,
    mesh: DeviceMesh,
    stage: int,
    parallel: ParallelSection,
    precision: str,
    device: torch.device,
) -> None:
    mp, offload = _policies(parallel, precision, device)
    reshard = stage == 3  # ZeRO-3 frees gathered params after forward; ZeRO-2 keeps them until backward
    for block in model.blocks():
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload)
    # The root (embedding, final norm, head) is needed again right at the start of backward: keep it gathered.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp, offload_policy=offload)


def fully_shard_frozen(
    model: nn.Module,
    dims: ParallelDims,
    mesh: DeviceMesh,
    parallel: ParallelSection,
    precision: str,
    device: torch.device,
    experts_mesh: DeviceMesh | None = None,
) -> None:
    """FSDP2 over a model that never trains (a reference model): ZeRO-3's sharding (experts over edp under
    expert parallel), every unit resharded after its forward, since no backward will want it gathered."""
    if experts_mesh is not None:
        _fully_shard_experts(model, experts_mesh["edp"], dims, parallel, precision, device)
    _fully_shard(model, mesh, 3, parallel, precision, device)
    model.set_reshard_after_forward(True)  # the root too (the trained model keeps its root gathered)


def _register_compression(ddp: DistributedDataParallel, parallel: ParallelSection, mesh: DeviceMesh) -> None:
    """Lossy gradient compression for DDP all-reduce (fp16 works on gloo and nccl; bf16 needs nccl)."""
    if parallel.grad_compression == "fp16":
        ddp.register_comm_hook(mesh.get_group(), default_hooks.fp16_compress_hook)
    elif parallel.grad_compression == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=mesh.get_group(),
            matrix_approximation_rank=parallel.powersgd_rank,
            start_powerSGD_iter=2,  # plain all-reduce for two iterations (warm-up), compressed after
            min_compression_rate=1,
        )
        ddp.register_comm_hook(state, _one_bucket_at_a_time(powerSGD_hook.powerSGD_hook))
        ddp.powersgd_state = state  # compression statistics, for logs and tests


def _one_bucket_at_a_time(hook: Callable) -> Callable:
    """PowerSGD issues its all-reduces from future callbacks; with several buckets, ranks can then interleave
    them in different orders, which gloo rejects ("collective mismatch"). Waiting for the previous bucket's
    chain before starting the next keeps every rank's collectives in one order (at the cost of overlap)."""
    previous: list[torch.futures.Future] = []

    # No annotations: DDP inspects the hook's signature and rejects string (postponed) annotations.
    def serialized(state, bucket):
        if previous:
            previous.pop().wait()
        future = hook(state, bucket)
        previous.append(future)
        return future

    return serialized


@contextlib.contextmanager
def gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """Skip the gradient collective on non-final micro-steps of an accumulation (DDP no_sync / FSDP2 flag)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
        yield
    elif isinstance(model, DistributedDataParallel) and not sync:
        with model.no_sync():
            yield
    else:
        yield


def unwrap(model: nn.Module) -> nn.Module:
    """The model itself, without a DDP wrapper (FSDP2 shards in place and needs no unwrapping)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def _param_groups(state) -> list:
    """An FSDP2 state's parameter groups: a list from torch 2.13 (`_fsdp_param_groups`), one or none before
    (`_fsdp_param_group`, torch 2.11/2.12): the feature, looked up, not the version."""
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


@contextlib.contextmanager
def kept_unsharded(roots: Sequence[nn.Module], skip: Sequence[nn.Module] = ()) -> Iterator[float]:
    """The FSDP2 units under `roots` (a model, or a pipeline rank's stage modules: each an FSDP root)
    all-gathered once and kept whole until the block ends (their forward neither gathers nor frees); yields
    the seconds the gather took. A no-op (0 s) without FSDP2. The units under `skip` are left as they are
    (PPO's separate critic: it never generates).

    The one place that reaches into FSDP2's internals (`_get_fsdp_state()._lazy_init()`, the state's param
    groups, `post_forward_mesh_info`), checked by tests/unit/test_data_parallel_internals.py so that a torch
    that changes them fails loudly."""
    skip_ids = {id(m) for c in skip for m in c.modules()}
    units = list(
        {
            id(m): m
            for r in roots
            for m in r.modules()
            if isinstance(m, FSDPModule) and id(m) not in skip_ids
        }.values()
    )
    if not units:
        yield 0.0
        return
    start = time.perf_counter()
    for root in roots:  # the roots' own settings first, as their first forward would
        if isinstance(root, FSDPModule):
            root._get_fsdp_state()._lazy_init()
    groups = [g for m in units for g in _param_groups(m._get_fsdp_state())]
    saved = [g.post_forward_mesh_info for g in groups]
    for g in groups:
        g.post_forward_mesh_info = None  # no reshard after forward (set_reshard_after_forward(False))
    for m in units:
        m.unshard()
    try:
        yield time.perf_counter() - start
    finally:
        for g, info in zip(groups, saved, strict=True):
            g.post_forward_mesh_info = info
        for m in units:
            m.reshard()
