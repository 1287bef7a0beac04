"""The engine over a pipeline: every rank of a pipeline group holds one stage (some decoder layers; the first
also the embedding, the last the final norm and head) and runs this engine with the same requests and seeds.

Each step, the first stage embeds the step's tokens and runs its layers, every stage hands the residual stream
to the next (point-to-point), each keeps the keys and values of its own layers in its own paged pool, and the
last stage computes the logits of the positions to sample and broadcasts them over the group. Every rank then
samples the same tokens from the same generators, so their schedulers stay in lockstep with no other message.
RL rollouts use it to generate with a pipeline-parallel training model in place (train/rollout.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardforge.infer.engine import Engine, EngineConfig, sampled_positions, whole_vocabulary
from shardforge.infer.paged import Chunk, PagedStep
from shardforge.infer.sampling import GenerationDefaults


class PipelineStageEngine(Engine):
    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        config: EngineConfig,
        defaults: GenerationDefaults,
        group: dist.ProcessGroup,
        stream_dtype: torch.dtype,
    ) -> None:
        super().__init__(model, tokenizer, config, defaults)
        self.group, self.stream_dtype = group, stream_dtype
        rank, size = dist.get_group_rank(group, dist.get_rank()), dist.get_world_size(group)
        self.first, self.last = rank == 0, rank == size - 1
        self.prev = None if self.first else dist.get_global_rank(group, rank - 1)
        self.next = None if self.last else dist.get_global_rank(group, rank + 1)
        self.source = dist.get_global_rank(group, size - 1)  # the stage with the head

    def forward(self, ids: list[int], chunks: list[Chunk], last: list[int]) -> torch.Tensor:
        paged = PagedStep(self.kv, chunks, self.device)
        cfg = self.model.config
        if self.first:
            x = torch.tensor(ids, device=self.device)[None]
        else:
            x = torch.empty(1, len(ids), cfg.hidden_size, dtype=self.stream_dtype, device=self.device)
            dist.recv(x, src=self.prev, group=self.group)
        mask = sampled_positions(len(ids), last, self.device)
        out = self.model(x, paged.positions, output_mask=mask, cache=paged)
        if not self.last:
            dist.send(out.to(self.stream_dtype).contiguous(), dst=self.next, group=self.group)
            out = torch.empty(len(last), cfg.vocab_size, dtype=torch.float32, device=self.device)
        else:
            out = whole_vocabulary(out, cfg.vocab_size).float().contiguous()
        dist.broadcast(out, src=self.source, group=self.group)
        return out
