"""The optimizer (AdamW plain, ZeRO-1 sharded or CPU-offloaded, or one of train/optimizers/' menu) and the
learning-rate schedule (global-norm clipping is the engine's: it knows the layout)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from shardforge.config.method_schema import MethodSection
from shardforge.config.optimizers import layout_refusal
from shardforge.config.parallel_schema import ParallelSection
from shardforge.config.schema import CheckpointSection, TrainSection
from shardforge.errors import ConfigError
from shardforge.log import get_logger
from shardforge.parallel.offload import OffloadedAdamW
from shardforge.train.optimizers import menu
from shardforge.train.optimizers.groups import lora_plus_groups

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
    method: MethodSection | None = None,
    model_config: Any = None,
    checkpoint: CheckpointSection | None = None,
) -> torch.optim.Optimizer:
    """The optimizer `train.optimizer.name` picks over the (possibly sharded) trained parameters. AdamW:
    ZeRO-1 shards its states over the data-parallel group; offload=optimizer keeps fp32 masters and states
    in host memory. The menu's others (train/optimizers/) are built as LLaMA-Factory builds them; the
    whole-tensor ones are refused on layouts that shard parameters. `method` carries LoRA+
    (method.lora.plus_lr_ratio: lora_B and 1-D tensors at lr x ratio, in every AdamW path); `model_config`
    gives Adam-mini its heads; `checkpoint` says whether states must survive a resume."""
    choice = train.optimizer
    ratio = method.lora.plus_lr_ratio if method is not None and method.finetuning == "lora" else None
    every = checkpoint.every if checkpoint is not None else None
    _refuse(model, train, parallel, dp_mesh, method, ratio is not None, every)
    menu.require(choice.name)
    hyper = {"lr": train.lr, "betas": train.betas, "eps": train.eps}
    groups = (
        lora_plus_groups(model, train.lr, ratio, train.weight_decay)
        if ratio is not None
        else param_groups(model, train.weight_decay)
    )
    zero1 = parallel is not None and parallel.zero_stage == 1 and dp_mesh is not None
    # whole-model builders (refused under ZeRO-1 by the rule)
    if choice.name == "adam_mini":
        return menu.adam_mini(model, train, model_config)
    if choice.name == "badam":
        return menu.badam(model, choice, train)
    if choice.name == "adamw_8bit":
        menu.keep_embeddings_32bit(model)
        cls, defaults = menu.adamw_8bit_class(), hyper
    elif choice.name == "muon":
        cls, groups, defaults = menu.muon(model, choice, train)
    elif choice.name in ("galore", "apollo"):
        cls, groups, defaults = menu.projected(model, choice, train)
    elif parallel is not None and parallel.offload == "optimizer":
        on_cuda = all(p.device.type == "cuda" for g in groups for p in g["params"])
        return OffloadedAdamW(groups, pin_memory=on_cuda, **hyper)
    else:
        # The fused kernel (CPU and CUDA) is several times faster than foreach: one pass over all parameters.
        cls, defaults = torch.optim.AdamW, {**hyper, "fused": True}
    if zero1:
        return ZeroRedundancyOptimizer(
            groups, optimizer_class=cls, process_group=dp_mesh.get_group(), **defaults
        )
    return cls(groups, **defaults)


def _refuse(
    model: nn.Module,
    train: TrainSection,
    parallel: ParallelSection | None,
    dp_mesh: DeviceMesh | None,
    method: MethodSection | None,
    lora_plus: bool,
    every: int | None,
) -> None:
    """The layout rule (config/optimizers.py), asked again with what the built run shows: the planner's
    preflight refuses these before any process starts; this catches a layout built without it."""
    parallel = parallel or ParallelSection()
    refused = layout_refusal(
        train.optimizer, world=dp_mesh.size() if dp_mesh is not None else 1, zero_stage=parallel.zero_stage,
        tp=parallel.tp, pp=parallel.pp, offload=parallel.offload, grad_accum=train.grad_accum,
        clip=train.clip, finetuning=method.finetuning if method else "full", lora_plus=lora_plus,
        checkpoint_every=every,
    )  # fmt: skip
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    if refused is None and train.optimizer.name != "adamw" and sharded:
        refused = (
            f"train.optimizer.name={train.optimizer.name} needs whole parameters; this layout shards them"
        )
    if refused is not None:
        raise ConfigError(refused)


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
