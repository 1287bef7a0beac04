"""Activation checkpointing, applied over a built model (never inside model code)."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def apply_activation_checkpointing(model: nn.Module, mode: str) -> nn.Module:
    """`full`: recompute each decoder block in backward. The wrapper keeps state_dict keys unchanged."""
    if mode == "none":
        return model
    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)
    return model
