"""Parallel layouts and memory-saving transforms, applied as functions over a built model."""

from shardforge.parallel.activation_ckpt import apply_activation_checkpointing

__all__ = ["apply_activation_checkpointing"]
