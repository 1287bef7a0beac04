"""Parallel layouts and memory-saving transforms, applied as functions over a built model."""

from shardforge.parallel.activation_ckpt import apply_activation_checkpointing
from shardforge.parallel.activations import ActivationReport, activation_report
from shardforge.parallel.data_parallel import apply_data_parallel
from shardforge.parallel.dims import ParallelDims
from shardforge.parallel.memory import memory_report

__all__ = [
    "ActivationReport",
    "ParallelDims",
    "activation_report",
    "apply_activation_checkpointing",
    "apply_data_parallel",
    "memory_report",
]
