"""NEFTune (Jain et al. 2023; transformers' and LLaMA-Factory's `neftune_noise_alpha`): uniform noise in
[-a, a], a = alpha / sqrt(L d), added to the token embeddings while training, for a row of L tokens of width
d. L is the row's own length, padding excluded, as the paper's code has it (padding gets no noise);
transformers' hook takes the batch's padded width instead, which is the same for a row batched alone.

The noise of a row is drawn from a generator seeded by the run's seed, the optimizer step and the row's
tokens, not from the process's random state: a row gets the same noise however the global batch is split
over ranks and micro-steps and however wide its micro-batch is padded, and a resumed run draws what the
uninterrupted one drew. The row's length is where its trailing run of padding ids begins (a row whose own
text ends in the padding id counts those tokens as padding, the same in every layout)."""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch
from torch import nn


class NEFTune:
    """The forward hook on a model's input embedding, and the optimizer step whose noise it draws."""

    def __init__(self, alpha: float, seed: int, pad_id: int) -> None:
        self.alpha, self.seed, self.pad_id, self.step = alpha, seed, pad_id, 0
        self.drawn: list[torch.Tensor] | None = None  # the noise of each forward, when a test asks

    @classmethod
    def attach(cls, trainer: Any) -> NEFTune | None:
        """Noise on a set-up Trainer's embedding (`train.neftune_alpha`, if set), drawn per optimizer step."""
        train = trainer.config.train
        if train.neftune_alpha is None:
            return None
        noise = cls(train.neftune_alpha, train.seed, trainer.run.tokenizer.pad_token_id)
        noise.step = trainer.start_step + 1
        trainer.engine.inner.embed_tokens.register_forward_hook(noise.hook)
        trainer.add_hook("step_end", noise.on_step_end)
        return noise

    def on_step_end(self, trainer: Any, step: int, payload: object) -> None:
        self.step = step + 1

    def noise(self, ids: torch.Tensor, width: int) -> torch.Tensor:
        """[rows, W, d] fp32 noise for the rows `ids` [rows, W] (zero on each row's padding)."""
        noise = torch.zeros(*ids.shape, width)
        for row, tokens in zip(noise, ids.cpu(), strict=True):
            real = (tokens != self.pad_id).nonzero()
            length = int(real[-1]) + 1 if len(real) else 0
            if not length:
                continue
            key = zlib.crc32(
                tokens[:length].numpy().tobytes(), zlib.crc32(f"{self.seed}:{self.step}".encode())
            )
            bound = self.alpha / math.sqrt(length * width)
            drawn = torch.rand(length, width, generator=torch.Generator().manual_seed(key))
            row[:length] = drawn * (2 * bound) - bound
        return noise

    def hook(self, module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return output
        noise = self.noise(inputs[0], output.shape[-1])
        if self.drawn is not None:
            self.drawn.append(noise)
        return output + noise.to(output.device, output.dtype)
