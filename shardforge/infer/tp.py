"""Tensor-parallel inference: the training TP plan over N ranks, led by rank 0.

Rank 0 runs the whole engine (requests, scheduling, sampling, the faces); its executor (infer/executor.py)
hands every step's tokens and block tables to the other ranks, and all ranks run the same forward over their
shards: their own heads' keys and values in their own paged pools, the reductions of the TP plan, and the
vocabulary shards gathered into whole logits. The other ranks only follow, until rank 0 says stop."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from shardforge.config.parallel_schema import ParallelSection
from shardforge.infer.engine_types import EngineConfig
from shardforge.infer.executor import Executor
from shardforge.infer.kv_pool import local_runner
from shardforge.parallel.dims import ParallelDims
from shardforge.parallel.tensor_parallel import apply_tensor_parallel


def shard_for_inference(model: nn.Module, tp: int) -> None:
    """Split `model` in place over all the ranks of the process group (tp = world size), as training does
    (no sequence parallel: a step's single row is rarely a multiple of tp)."""
    section = ParallelSection(tp=tp, sequence_parallel=False)
    dims = ParallelDims.from_config(section, dist.get_world_size())
    device = next(model.parameters()).device
    apply_tensor_parallel(model, dims, dims.build_mesh(device.type), section)


def tp_executor(model: nn.Module, config: EngineConfig) -> Executor:
    """The sharded model's forward on every rank of the job, led by rank 0."""
    return Executor(local_runner(model, config), dist.group.WORLD)
