"""NEFTune (Jain et al. 2023; transformers' and LLaMA-Factory's `neftune_noise_alpha`): uniform noise added
to the token embeddings while training, of magnitude alpha / sqrt(L d) for rows L tokens wide of width d, as
transformers' `neftune_post_forward_hook` draws it (L: the row's width in the batch, padding included).

The noise of a row is drawn from a generator seeded by the run's seed, the optimizer step and the row's token
ids, not from the process's random state: every layout that gives a row the same width (packed rows always
have one) adds the same noise to it, however the global batch is split over ranks and micro-steps, and a
resumed run draws what the uninterrupted one drew."""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch
from torch import nn


class NEFTune:
    """The forward hook on a model's input embedding, and the optimizer step whose noise it draws."""

    def __init__(self, alpha: float, seed: int) -> None:
        self.alpha, self.seed, self.step = alpha, seed, 0
        self.drawn: list[torch.Tensor] | None = None  # the noise of each forward, when a test asks

    @classmethod
    def attach(cls, trainer: Any) -> NEFTune | None:
        """Noise on a set-up Trainer's embedding (`train.neftune_alpha`, if set), drawn per optimizer step."""
        train = trainer.config.train
        if train.neftune_alpha is None:
            return None
        noise = cls(train.neftune_alpha, train.seed)
        noise.step = trainer.start_step + 1
        trainer.engine.inner.embed_tokens.register_forward_hook(noise.hook)
        trainer.add_hook("step_end", noise.on_step_end)
        return noise

    def on_step_end(self, trainer: Any, step: int, payload: object) -> None:
        self.step = step + 1

    def noise(self, ids: torch.Tensor, width: int) -> torch.Tensor:
        """[rows, L, d] fp32 noise for the rows `ids` [rows, L]."""
        bound = self.alpha / math.sqrt(ids.shape[1] * width)
        rows = []
        for row in ids.cpu():
            key = zlib.crc32(row.numpy().tobytes(), zlib.crc32(f"{self.seed}:{self.step}".encode()))
            generator = torch.Generator().manual_seed(key)
            rows.append(torch.rand(ids.shape[1], width, generator=generator) * (2 * bound) - bound)
        return torch.stack(rows)

    def hook(self, module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return output
        noise = self.noise(inputs[0], output.shape[-1])
        if self.drawn is not None:
            self.drawn.append(noise)
        return output + noise.to(output.device, output.dtype)
