"""LoRA on the fused experts of a mixture of experts, as peft (0.21) defines it for a 3-D parameter
(`target_parameters`, its `ParamWrapper`): one adapter over all E experts of a `[E, out, in]` weight,

    lora_A [r E, in],  lora_B [out, r E],  delta_e = s B[:, :, e] A[e, :, :]

with A read as [E, r, in] and B as [out, r, E] (each expert its own rank-r pair, stored as peft stores them,
so the tensors map one to one). transformers' experts that store `[E, in, out]` say so (`is_transposed`), as
peft reads it; our own `models/moe.py: Experts` store `[E, out, in]`. peft allows no dropout and no DoRA here.

The adapter is a child module of the experts (`<param>_lora`) and puts W + delta in place of the parameter for
the experts' forward only (a pre- and a post-forward hook): the experts' own code, ours or transformers', runs
unchanged, and the gradient reaches A and B through the sum. Activation checkpointing recomputes it.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from shardforge.adapters.lora import AdapterLayer
from shardforge.config.method_schema import EXPERT_TARGETS

# the parameters `targets` may name, in the order transformers registers them (peft nests its wrappers so)
EXPERT_PARAMS = tuple(t.removeprefix("experts.") for t in EXPERT_TARGETS)


class ParamLoRA(AdapterLayer, nn.Module):
    """The adapter of one fused experts weight `param_name` of the module it is attached to."""

    def __init__(
        self, param: nn.Parameter, name: str, rank: int, alpha: float, rslora: bool, transposed: bool
    ):
        super().__init__()
        experts, d1, d2 = param.shape
        self.param_name, self.experts, self.rank, self.transposed = name, experts, rank, transposed
        self.in_features, self.out_features = (d1, d2) if transposed else (d2, d1)
        self.scale = alpha / math.sqrt(rank) if rslora else alpha / rank
        factory = {"device": param.device, "dtype": torch.float32}  # adapters train in fp32
        self.lora_A = nn.Parameter(torch.empty(rank * experts, self.in_features, **factory))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank * experts, **factory))
        self._held: list[nn.Parameter] = []  # the parameter while W + delta stands in (a list: unregistered)
        self._hooks: tuple = ()

    def reset_adapter(self, name: str, seed: int) -> None:
        """A kaiming-uniform over [r E, in] (peft's init), B zero; seeded by the name as LoRALinear is."""
        generator = torch.Generator(device="cpu").manual_seed(seed + zlib.crc32(name.encode()))
        bound = 1 / math.sqrt(self.in_features)
        with torch.no_grad():
            self.lora_A.copy_(torch.rand(self.lora_A.shape, generator=generator) * 2 * bound - bound)
            self.lora_B.zero_()

    def delta(self) -> torch.Tensor:
        """What the adapter adds to the parameter, in its layout (fp32)."""
        return expert_delta(self.lora_A, self.lora_B, self.experts, self.scale, self.transposed)

    def attach(self, owner: nn.Module) -> None:
        owner.add_module(f"{self.param_name}_lora", self)
        self._hooks = (
            owner.register_forward_pre_hook(self._swap_in),
            owner.register_forward_hook(self._swap_out, always_call=True),
        )

    def detach_from(self, owner: nn.Module) -> None:
        for hook in self._hooks:
            hook.remove()
        delattr(owner, f"{self.param_name}_lora")

    def _swap_in(self, owner: nn.Module, args: object) -> None:
        if not self.adapter_enabled:
            return
        param = owner._parameters.pop(self.param_name)
        self._held.append(param)
        owner.__dict__[self.param_name] = param + self.delta().to(param.dtype)

    def _swap_out(self, owner: nn.Module, args: object, output: object) -> None:
        if self._held:
            del owner.__dict__[self.param_name]
            owner._parameters[self.param_name] = self._held.pop()

    def extra_repr(self) -> str:
        return f"{self.param_name}: {self.experts} experts, LoRA rank={self.rank}, scale={self.scale:g}"


def expert_delta(
    a: torch.Tensor, b: torch.Tensor, experts: int, scale: float, transposed: bool
) -> torch.Tensor:
    """s B_e A_e for every expert e, [E, out, in] (transposed: [E, in, out]), in fp32."""
    a3 = a.float().reshape(experts, -1, a.shape[-1])  # [E, r, in]
    b3 = b.float().reshape(b.shape[0], -1, experts)  # [out, r, E]
    pattern = "ore,eri->eio" if transposed else "ore,eri->eoi"
    return scale * torch.einsum(pattern, b3, a3)


def is_transposed(experts: nn.Module) -> bool:
    """transformers' flag for experts stored [E, in, out] (peft reads the same); ours never are."""
    return bool(vars(experts).get("is_transposed", False))
