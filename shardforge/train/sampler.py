"""Completions sampled with the training weights in place: the inference engine (continuous batching over a
paged KV cache, infer/engine.py) running the training model itself, whatever its layout. RL's rollout source
(objectives/rollout.py) asks for them through the `Sampler` interface (objectives/base.py), so objectives/
stays below the inference layer.

- FSDP2: the caller keeps every unit gathered around the sampling and scoring (`kept_unsharded`).
- Tensor parallel: the ranks of a TP group hold the same prompts and seeds, so their engines schedule the
  same steps and run the sharded forward together (the logits' vocabulary shards are gathered).
- Pipeline: each stage's rank runs the engine over its layers and passes the stream on (infer/pp.py).
- DDP and one process: the module itself. LoRA: the adapters apply in the forward; nothing is merged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import cached_property
from typing import Any

from shardforge.config.schema import Config
from shardforge.infer.engine import EngineConfig
from shardforge.infer.pp import generator_for
from shardforge.infer.sampling import GenerationDefaults, SamplingParams
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

    def sample(self, prompts: list[list[int]], positions: list[int]) -> list[list[Any]]:
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
            with self.autocast():
                # No tokenizer: the engine streams no text token by token; the rollout decodes each once.
                generator = generator_for(self.engine, model, None, config, self.defaults)
                return generator.generate(prompts, params)
        finally:
            model.train(was_training)
