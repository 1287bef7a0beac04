"""Activation checkpointing, applied over a built model (never inside model code).

- `full`: each decoder block keeps only its inputs; everything inside is recomputed in backward.
- `selective`: each block keeps the outputs of its matrix multiplies (and of TP collectives, so backward
  never repeats communication) and recomputes the rest: the attention core and the cheap element-wise ops
  (norms, RoPE, SiLU, residual adds), which hold much of the memory but little of the compute.
  Under sequence parallel it keeps what is split over the ranks and recomputes what is whole, so it never
  keeps more than no checkpointing (which keeps the gathered inputs sharded, sharding/regather.py): the
  all-gathered inputs are gathered again (as Megatron's sequence parallel does in its backward), and the
  row-parallel projections' whole [s, h] partial sums (o_proj, down_proj; their reduce-scattered shards are
  kept) are recomputed.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor import DTensor
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


def _keep_sharded(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Sequence parallel: as `_keep_matmuls`, less the all-gathers and the row-parallel matmuls (the policy
    sees DTensors: their weight, transposed, is split over its rows, and their output is a whole partial
    sum that a reduce-scatter then splits)."""
    if op is torch.ops._c10d_functional.all_gather_into_tensor.default:
        return CheckpointPolicy.PREFER_RECOMPUTE
    weight = args[-1] if args else None
    matmul = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    if matmul and isinstance(weight, DTensor) and weight.placements[0].is_shard(0):
        return CheckpointPolicy.PREFER_RECOMPUTE
    return _keep_matmuls(ctx, op, *args, **kwargs)


def apply_activation_checkpointing(model: nn.Module, mode: str, sequence_parallel: bool = False) -> nn.Module:
    """Wrap each decoder block (after TP, before compile and FSDP). The wrapper keeps state_dict keys.
    `sequence_parallel`: the blocks run under TP with sequence parallel (what selective keeps differs)."""
    if mode == "none":
        return model
    extra = {}
    if mode == "selective":
        policy = _keep_sharded if sequence_parallel else _keep_matmuls
        extra["context_fn"] = partial(create_selective_checkpoint_contexts, policy)
    blocks = {id(b) for b in model.blocks()}
    for parent in list(model.modules()):  # each block replaced in its container (ModuleList or ModuleDict)
        for name, child in list(parent.named_children()):
            if id(child) in blocks:
                setattr(parent, name, checkpoint_wrapper(child, preserve_rng_state=False, **extra))
    return model
