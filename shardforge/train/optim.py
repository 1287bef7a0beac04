"""AdamW (plain, ZeRO-1 sharded, or CPU-offloaded) and the learning-rate schedule (global-norm clipping is the
engine's: it knows the layout)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.optim import ZeroRedundancyOptimizer

from shardforge.config.schema import ParallelSection, TrainSection
from shardforge.log import get_logger
from shardforge.parallel.offload import OffloadedAdamW

log = get_logger(__name__)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on norms and biases (1-D tensors)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(
    model: nn.Module,
    train: TrainSection,
    parallel: ParallelSection | None = None,
    dp_mesh: DeviceMesh | None = None,
) -> torch.optim.Optimizer:
    """AdamW over the (possibly sharded) parameters. ZeRO-1 shards its states over the data-parallel group;
    offload=optimizer keeps fp32 masters and states in host memory."""
    groups = param_groups(model, train.weight_decay)
    hyper = {"lr": train.lr, "betas": train.betas, "eps": train.eps}
    on_cuda = all(p.device.type == "cuda" for g in groups for p in g["params"])
    if parallel is not None and parallel.offload == "optimizer":
        return OffloadedAdamW(groups, pin_memory=on_cuda, **hyper)
    # The fused kernel (CPU and CUDA) is several times faster than foreach: one pass over all parameters.
    kernel = {"fused": True}
    if parallel is not None and parallel.zero_stage == 1 and dp_mesh is not None:
        return ZeroRedundancyOptimizer(
            groups, optimizer_class=torch.optim.AdamW, process_group=dp_mesh.get_group(), **hyper, **kernel
        )
    return torch.optim.AdamW(groups, **hyper, **kernel)


def warmup_steps(total: int, train: TrainSection) -> int:
    """transformers' rounding: a ratio of the steps rounded up."""
    return math.ceil(train.warmup_ratio * total) if train.warmup_ratio is not None else train.warmup


def lr_factor(step: int, total: int, train: TrainSection) -> float:
    """Multiplier of train.lr at optimizer step `step` (0-based): warmup, then the decay to `min_lr_ratio`
    that transformers' schedules compute (`get_cosine_schedule_with_warmup` ...; tests/lf/ checks them step
    by step). Warmup step k runs at (k+1)/(warmup+1), or, with `warmup_from_zero`, at transformers' k/warmup
    (the first step at rate 0)."""
    warmup = warmup_steps(total, train)
    if warmup and step < warmup:
        return step / warmup if train.warmup_from_zero else (step + 1) / (warmup + 1)
    if train.schedule == "constant":
        return 1.0
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    floor = train.min_lr_ratio
    if train.schedule == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, total: int, train: TrainSection
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total, train))


def count_steps(train: TrainSection, groups: float, global_batch: int) -> int:
    """Optimizer steps: `train.epochs` over `groups` (the training data's groups; math.inf for a stream),
    else `train.steps`. A global batch larger than the data is said (rows repeat within a step)."""
    if global_batch > groups:
        log.warning(
            f"the global batch ({global_batch} groups of rows) is larger than the training data ({groups}): "
            f"rows repeat within a step"
        )
    return math.ceil(train.epochs * groups / global_batch) if train.epochs else train.steps
