"""The engine over a pipeline: every rank of a pipeline group holds some stages (each some decoder layers; the
first also the embedding, the last the final norm and head: one stage per rank, or several interleaved or
V-shaped) and runs this engine with the same requests and seeds.

Each step goes through the stages in model order (the pipeline engine's own stage loop,
`PipelineEngine.through_stages`): the first embeds the step's tokens, each stage runs its layers and hands
the residual stream to the next stage's rank (point-to-point), each rank keeps the keys and values of its
own layers in its own paged pool (keyed by layer), and the last stage's rank computes the logits of the
positions to sample and broadcasts them over the group. Every rank then samples the same tokens from the same
generators, so their schedulers stay in lockstep with no other message. RL rollouts use it to generate with a
pipeline-parallel training model in place (train/sampler.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardforge.infer.engine import Engine, EngineConfig, sampled_positions, whole_vocabulary
from shardforge.infer.paged import Chunk, PagedStep
from shardforge.infer.sampling import GenerationDefaults


def generator_for(
    engine: Any, model: nn.Module, tokenizer: Any, config: EngineConfig, defaults: GenerationDefaults
) -> Engine:
    """The inference engine over a training engine's model (RL rollouts): the whole model, or under a
    pipeline the rank's stages, whose engine passes the stream on to the next stage's rank."""
    if engine.is_pipeline:
        return PipelineStageEngine(model, tokenizer, config, defaults, engine)
    return Engine(model, tokenizer, config, defaults)


class PipelineStageEngine(Engine):
    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        config: EngineConfig,
        defaults: GenerationDefaults,
        pipeline: Any,
    ) -> None:
        """`model`: the rank's part of the model (all its stages' layers); `pipeline`: the training
        pipeline engine (parallel/pipeline.py), whose stages, plan and group the steps go through."""
        super().__init__(model, tokenizer, config, defaults)
        self.pipeline = pipeline
        self.final = pipeline.plan.num_stages - 1
        self.source = pipeline.plan.rank_of(self.final)  # the rank of the stage with the head, in the group

    def forward(self, ids: list[int], chunks: list[Chunk], last: list[int]) -> torch.Tensor:
        paged = PagedStep(self.kv, chunks, self.device)
        mask = sampled_positions(len(ids), last, self.device)
        stages = self.pipeline.stages

        def run(index: int, h: torch.Tensor) -> torch.Tensor:
            return stages[index].part(h, paged.positions, output_mask=mask, cache=paged)

        out = self.pipeline.through_stages(torch.tensor(ids, device=self.device)[None], run)
        vocab = self.model.config.vocab_size
        if self.final in stages:
            out = whole_vocabulary(out, vocab).float().contiguous()
        else:
            out = torch.empty(len(last), vocab, dtype=torch.float32, device=self.device)
        dist.broadcast(out, group=self.pipeline.group, group_src=self.source)
        return out
