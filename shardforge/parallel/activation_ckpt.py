"""Activation checkpointing, applied over a built model (never inside model code).

- `full`: each decoder block keeps only its inputs; everything inside is recomputed in backward.
- `selective`: each block keeps the outputs of its matrix multiplies (and of TP collectives, so backward
  never repeats communication) and recomputes the rest: the attention core and the cheap element-wise ops
  (norms, RoPE, SiLU, residual adds), which hold much of the memory but little of the compute.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_KEEP = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.all_to_all_single.default,  # expert parallel's dispatch and combine
}


def _keep_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _KEEP else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: nn.Module, mode: str) -> nn.Module:
    """Wrap each decoder block (after TP, before compile and FSDP). The wrapper keeps state_dict keys."""
    if mode == "none":
        return model
    extra = {}
    if mode == "selective":
        extra["context_fn"] = partial(create_selective_checkpoint_contexts, _keep_matmuls)
    blocks = {id(b) for b in model.blocks()}
    for parent in list(model.modules()):  # each block replaced in its container (ModuleList or ModuleDict)
        for name, child in list(parent.named_children()):
            if id(child) in blocks:
                setattr(parent, name, checkpoint_wrapper(child, preserve_rng_state=False, **extra))
    return model
