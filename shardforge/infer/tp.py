"""Tensor-parallel inference: the training TP plan over N ranks, with one engine.

Rank 0 runs the whole engine (requests, scheduling, sampling, the faces). Every step it hands the step's
tokens and block tables to the other ranks (a broadcast of a small object), and all ranks run the same
forward over their shards: their own heads' keys and values in their own paged pools, the reductions of
the TP plan, and the vocabulary shards gathered into whole logits. The other ranks only follow, until rank 0
says stop."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardforge.config.schema import ParallelSection
from shardforge.infer.engine import Engine, step_forward
from shardforge.infer.paged import Chunk
from shardforge.parallel.dims import ParallelDims
from shardforge.parallel.tensor_parallel import apply_tensor_parallel

_STOP = None


def shard_for_inference(model: nn.Module, tp: int) -> None:
    """Split `model` in place over all the ranks of the process group (tp = world size), as training does
    (no sequence parallel: a step's single row is rarely a multiple of tp)."""
    section = ParallelSection(tp=tp, sequence_parallel=False)
    dims = ParallelDims.from_config(section, dist.get_world_size())
    device = next(model.parameters()).device
    apply_tensor_parallel(model, dims, dims.build_mesh(device.type), section)


class TPEngine(Engine):
    """The engine on rank 0: each step's forward is first announced to the followers."""

    def forward(self, ids: list[int], chunks: list[Chunk], last: list[int]) -> torch.Tensor:
        dist.broadcast_object_list([(ids, chunks, last)], src=0)
        return super().forward(ids, chunks, last)

    def close(self) -> None:
        """Release the followers (they return from `follow`)."""
        dist.broadcast_object_list([_STOP], src=0)


def follow(engine: Engine) -> None:
    """A rank > 0: run every step rank 0 announces, until it says stop."""
    while True:
        message = [None]
        dist.broadcast_object_list(message, src=0)
        if message[0] is _STOP:
            return
        ids, chunks, last = message[0]
        with torch.no_grad():
            step_forward(engine.model, engine.kv, ids, chunks, last, engine.device)
