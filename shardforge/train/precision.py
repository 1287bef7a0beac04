"""Mixed precision: fp32, bf16 autocast, or fp16 autocast with dynamic loss scaling.

The fp16 scaler is ours rather than torch.amp.GradScaler because gradients may be DTensor shards (FSDP2): the
overflow check runs on local shards and is all-reduced, so every rank skips (or takes) the same steps.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator

import torch
import torch.distributed as dist

from shardforge.dtypes import PRECISION_DTYPES
from shardforge.errors import TrainingError
from shardforge.parallel.memory import local_tensor

MIN_LOSS_SCALE = 2.0**-10  # below this, fp16 overflow is not a transient: the run halts with advice


class Precision:
    """Autocast for forward passes, plus a dynamic loss scale that only acts in fp16."""

    def __init__(
        self, mode: str, device: torch.device, init_scale: float = 2.0**16, growth_interval: int = 1000
    ):
        self.mode, self.device = mode, device
        self.dtype = PRECISION_DTYPES[mode]
        self.loss_scale: float | None = init_scale if mode == "fp16" else None
        self.growth_interval = growth_interval
        self._good_steps = 0
        self.skipped_steps = 0

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if self.mode == "fp32":
            yield
        else:
            with torch.autocast(self.device.type, dtype=self.dtype):
                yield

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.loss_scale is None else loss * self.loss_scale

    @torch.no_grad()
    def unscale(self, params: list[torch.Tensor]) -> bool:
        """Divide gradients by the loss scale; True if any rank saw inf/nan (then the step is skipped)."""
        if self.loss_scale is None:
            return False
        by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for p in params:
            if p.grad is not None:
                grad = local_tensor(p.grad)
                by_device[grad.device].append(grad)
        found = torch.zeros(1, device=self.device)
        for device, grads in by_device.items():
            found_here = torch.zeros(1, device=device)
            inv = torch.full((1,), 1.0 / self.loss_scale, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_here, inv)
            found += found_here.to(self.device)
        if dist.is_initialized():
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return bool(found.item())

    def step(self, optimizer: torch.optim.Optimizer, overflow: bool) -> None:
        """Optimizer step, or on fp16 overflow skip it and halve the scale; grow it after good steps."""
        if overflow:
            self.loss_scale /= 2
            self._good_steps = 0
            self.skipped_steps += 1
            if self.loss_scale < MIN_LOSS_SCALE:
                raise TrainingError(
                    f"fp16 gradients overflow at every loss scale down to {MIN_LOSS_SCALE} "
                    f"({self.skipped_steps} steps skipped): the values exceed fp16's range; use "
                    f"train.precision=bf16 (same speed on recent GPUs, fp32's range) or fp32"
                )
            return
        optimizer.step()
        if self.loss_scale is not None:
            self._good_steps += 1
            if self._good_steps % self.growth_interval == 0:
                self.loss_scale *= 2

    def state_dict(self) -> dict:
        return {
            "mode": self.mode,
            "loss_scale": self.loss_scale,
            "good_steps": self._good_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        self.loss_scale = state["loss_scale"]
        self._good_steps, self.skipped_steps = state["good_steps"], state["skipped_steps"]
