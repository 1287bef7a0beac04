"""The engine over a training model in place, whatever its layout (RL rollouts: train/sampler.py).

Under tensor parallel or a pipeline, the ranks that hold parts of one model copy (the training engine's
`rollout_group`) generate together, led by the group's first rank: it alone schedules and samples, and
every step's input reaches the others through the executor (infer/executor.py). Under a pipeline every rank
holds some stages (each some decoder layers; the first also the embedding, the last the final norm and head:
one stage per rank, or several interleaved or V-shaped): each step goes through the stages in model order
(the pipeline engine's own stage loop, `through_stages`), each stage runs its layers and hands the residual
stream to the next stage's rank (point to point), each rank keeps the keys and values of its own layers in
its own paged pool (keyed by layer), and the last stage's rank broadcasts the logits of the positions to
sample over the pipeline group. When the leader is done, every rank of the group gets the completions."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardforge.infer.engine import Engine
from shardforge.infer.engine_types import Completion, EngineConfig
from shardforge.infer.executor import (
    Executor,
    ModelRunner,
    StepInput,
    sampled_positions,
    whole_vocabulary,
)
from shardforge.infer.kv_pool import local_runner, paged_pool
from shardforge.infer.paged import PagedKV, PagedStep
from shardforge.infer.sampling import GenerationDefaults, SamplingParams
from shardforge.models.common.images import ImageInputs
from shardforge.models.common.protocol import CausalModel


class StageRunner:
    """The rank's pipeline stages over its paged pool; every rank of the pipeline group ends with the
    logits."""

    def __init__(self, model: CausalModel, kv: PagedKV, pipeline: Any) -> None:
        """`model`: the rank's part of the model (all its stages' layers); `pipeline`: the training
        pipeline engine (parallel/pipeline.py), whose stages, plan and group the steps go through."""
        self.model, self.kv, self.pipeline = model, kv, pipeline
        self.device = pipeline.device
        self.final = pipeline.plan.num_stages - 1
        self.source = pipeline.plan.rank_of(self.final)  # the rank of the stage with the head, in the group

    def run(self, step: StepInput) -> torch.Tensor:
        paged = PagedStep(self.kv, step.chunks, self.device)
        mask = sampled_positions(len(step.ids), step.last, self.device)
        stages = self.pipeline.stages

        def run(index: int, h: torch.Tensor) -> torch.Tensor:
            return stages[index].part(h, paged.positions, output_mask=mask, cache=paged)

        out = self.pipeline.through_stages(torch.tensor(step.ids, device=self.device)[None], run)
        vocab = self.model.config.vocab_size
        if self.final in stages:
            out = whole_vocabulary(out, vocab).float().contiguous()
        else:
            out = torch.empty(len(step.last), vocab, dtype=torch.float32, device=self.device)
        dist.broadcast(out, group=self.pipeline.group, group_src=self.source)
        return out


def generate_in_place(
    engine: Any,
    model: CausalModel,
    config: EngineConfig,
    defaults: GenerationDefaults,
    prompts: list[list[int]],
    params: list[SamplingParams],
    images: list[ImageInputs | None] | None = None,
) -> list[list[Completion]]:
    """Completions of `prompts` (with `images`, each prompt's if any) from a training engine's model as it is
    laid out, on every rank of its rollout group (the leader generates; the others run its steps)."""
    runner: ModelRunner = (
        StageRunner(model, paged_pool(model, config), engine)
        if engine.is_pipeline
        else local_runner(model, config)
    )
    executor = Executor(runner, engine.rollout_group())
    if not executor.leads:
        executor.follow()
        done = executor.share(None)
        if done is None:
            raise RuntimeError("the rollout's leading rank failed (its error is in its log)")
        return done
    try:
        done = Engine(model, None, config, defaults, executor).generate(prompts, params, images=images)
    except BaseException:
        executor.close()
        executor.share(None)  # the followers stop waiting and fail too
        raise
    executor.close()
    return executor.share(done)
