"""Mixed precision: fp32, bf16 autocast, or fp16 autocast with dynamic loss scaling."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """Autocast context for forward passes and a grad scaler that is a no-op unless fp16."""

    def __init__(self, mode: str, device: torch.device) -> None:
        self.mode, self.device = mode, device
        self.dtype = DTYPES[mode]
        self.scaler = torch.amp.GradScaler(device.type, enabled=mode == "fp16")

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if self.mode == "fp32":
            yield
        else:
            with torch.autocast(self.device.type, dtype=self.dtype):
                yield

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler.is_enabled():
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Optimizer step; with fp16 it is skipped on overflow and the loss scale is lowered."""
        self.scaler.step(optimizer)
        self.scaler.update()

    @property
    def loss_scale(self) -> float | None:
        return self.scaler.get_scale() if self.scaler.is_enabled() else None
