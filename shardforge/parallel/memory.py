"""Measured per-rank memory of model states: the truth the planner's formulas are checked against."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardforge.models.quantize import is_nf4, nf4_bytes


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(tensors: list[torch.Tensor]) -> int:
    """Storage bytes of the local parts, each storage counted once (tied weights are one tensor)."""
    seen, total = set(), 0
    for t in tensors:
        local = local_tensor(t)
        if is_nf4(local):  # a 4-bit weight: its codes and scales
            total += nf4_bytes(local)
            continue
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), local.numel())
        if key in seen:
            continue
        seen.add(key)
        total += local.numel() * local.element_size()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Tensors this rank holds for the optimizer (ZeroRedundancyOptimizer keeps its shard in `.optim`)."""
    if hasattr(optimizer, "state_tensors"):
        return optimizer.state_tensors()
    inner = getattr(optimizer, "optim", optimizer)
    return [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def memory_report(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """This rank's bytes of parameters (and, when some are frozen, of the frozen and the trained ones),
    gradients and optimizer states (sum of local tensor storage)."""
    params = list(model.parameters())
    report = {
        "param_bytes": _bytes(params),
        "grad_bytes": _bytes([p.grad for p in params if p.grad is not None]),
    }
    frozen = [p for p in params if not p.requires_grad]
    if frozen:  # LoRA / freeze: the base apart from what trains (adapters, unfrozen layers)
        report["frozen_param_bytes"] = _bytes(frozen)
        report["trained_param_bytes"] = report["param_bytes"] - report["frozen_param_bytes"]
    if optimizer is not None:
        report["optim_bytes"] = _bytes(optimizer_state_tensors(optimizer))
    return report
