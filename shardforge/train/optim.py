"""AdamW and the learning-rate schedule (warmup, then constant / linear / cosine decay to a floor)."""

from __future__ import annotations

import math

import torch
from torch import nn

from shardforge.config.schema import TrainSection


def build_optimizer(model: nn.Module, train: TrainSection) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms and biases (1-D tensors). Fused kernels on CUDA, foreach elsewhere."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": train.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    on_cuda = all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=train.lr,
        betas=train.betas,
        eps=train.eps,
        fused=True if on_cuda else None,
        foreach=None if on_cuda else True,
    )


def lr_factor(step: int, total: int, train: TrainSection) -> float:
    """Multiplier of train.lr at optimizer step `step` (0-based)."""
    if train.warmup and step < train.warmup:
        return (step + 1) / (train.warmup + 1)
    if train.schedule == "constant":
        return 1.0
    span = max(1, total - train.warmup)
    progress = min(1.0, (step - train.warmup) / span)
    floor = train.min_lr_ratio
    if train.schedule == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, total: int, train: TrainSection
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total, train))
