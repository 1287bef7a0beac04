"""ZeRO-Offload style optimizer: fp32 master shards and AdamW states live in host memory, the step runs on the
CPU, and only the updated shard is copied back. Parameters stay on the device for forward and backward."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from shardforge.parallel.memory import local_tensor


class OffloadedAdamW(torch.optim.AdamW):
    """AdamW over host copies of the (local shards of the) device parameters."""

    def __init__(self, groups: Iterable[dict], pin_memory: bool, **defaults) -> None:
        self.device_params: list[torch.Tensor] = []
        host_groups = []
        for group in groups:
            masters = []
            for p in group["params"]:
                master = local_tensor(p).detach().to("cpu", torch.float32, copy=True)
                masters.append(master.pin_memory() if pin_memory else master)
                self.device_params.append(p)
            host_groups.append({**group, "params": masters})
        super().__init__(host_groups, fused=True, **defaults)
        self.masters = [m for g in self.param_groups for m in g["params"]]

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> float | None:
        for p, master in zip(self.device_params, self.masters, strict=True):
            grad = p.grad
            master.grad = (
                None if grad is None else local_tensor(grad).to("cpu", torch.float32, non_blocking=True)
            )
        if any(p.device.type == "cuda" for p in self.device_params):
            torch.cuda.synchronize()
        loss = super().step(closure)
        for p, master in zip(self.device_params, self.masters, strict=True):
            local_tensor(p).copy_(master, non_blocking=True)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.device_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_tensors(self) -> list[torch.Tensor]:
        """Host-side master weights and AdamW states (for the memory report)."""
        return [*self.masters, *(v for s in self.state.values() for v in s.values() if torch.is_tensor(v))]
