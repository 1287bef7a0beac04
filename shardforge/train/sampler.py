"""Completions sampled with the training weights in place: the inference engine (continuous batching over a
paged KV cache, infer/engine.py) running the training model itself, whatever its layout. RL's rollout source
(objectives/rollout.py) asks for them through the `Sampler` interface (objectives/base.py), so objectives/
stays below the inference layer.

- FSDP2: the caller keeps every unit gathered around the sampling and scoring (`kept_unsharded`).
- Tensor parallel and pipelines: the ranks that hold parts of one model copy generate together, led by the
  first (it schedules and samples; the others run its steps: infer/pp.py), and all get the completions.
- DDP and one process: the module itself. LoRA: the adapters apply in the forward; nothing is merged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import cached_property
from typing import Any

from shardforge.config.schema import Config
from shardforge.infer.engine_types import EngineConfig
from shardforge.infer.packed import packed_while
from shardforge.infer.pp import generate_in_place
from shardforge.infer.sampling import GenerationDefaults, SamplingParams
from shardforge.models.common.images import ImageInputs
from shardforge.parallel.engine import Engine
from shardforge.planner.memory import ROLLOUT_BLOCK  # the planner counts the cache in these blocks


class TrainingSampler:
    """`Sampler` over the training engine: `group_size` completions of each prompt, each prompt seeded
    alone (the run's seed and the prompt's global position: completions do not depend on the layout)."""

    def __init__(
        self, cfg: Config, engine: Engine, tokenizer: Any, autocast: Callable[[], AbstractContextManager]
    ) -> None:
        self.rl, self.seed, self.folder = cfg.method.rl, cfg.train.seed, cfg.model.path
        self.engine, self.tokenizer, self.autocast = engine, tokenizer, autocast

    @cached_property
    def defaults(self) -> GenerationDefaults:
        """The model folder's generation defaults (its end-of-sequence ids), read on first use."""
        return GenerationDefaults.from_folder(self.folder, self.tokenizer.eos_token_id)

    def sample(
        self, prompts: list[list[int]], positions: list[int], images: list[ImageInputs | None]
    ) -> list[list[Any]]:
        rl, n = self.rl, self.rl.group_size
        model = self.engine.inner
        need = sum(n * math.ceil((len(ids) + rl.max_new_tokens) / ROLLOUT_BLOCK) for ids in prompts)
        sequences = n * len(prompts)
        config = EngineConfig(
            ROLLOUT_BLOCK, need + 1, max_step_tokens=max(1024, 2 * sequences), max_running=sequences
        )
        params = [
            SamplingParams(
                max_tokens=rl.max_new_tokens,
                temperature=rl.temperature,
                top_p=rl.top_p,
                top_k=0,
                min_p=0.0,
                repetition_penalty=1.0,
                seed=(self.seed * 1_000_003 + position) % 2**31,
                n=n,
                logprobs=0,
            )
            for position in positions
        ]
        was_training = model.training
        try:
            # No tokenizer: the engine streams no text token by token; the rollout decodes each once.
            # The weights change every step: laid out for the CPU's GEMM library for this rollout only.
            with self.autocast(), packed_while(model):
                return generate_in_place(self.engine, model, config, self.defaults, prompts, params, images)
        finally:
            model.train(was_training)
