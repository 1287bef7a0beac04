"""Inference weights laid out once for the CPU's GEMM library: every linear of a frozen model becomes a
`PackedLinear` whose weight oneDNN has reordered into its blocked layout (torch's own mkldnn linear ops), so
no step re-lays it out. Measured here on SmolLM2-135M's shapes at a decode step's 16 rows: the LM head
[576 -> 49152] 30 ms -> 8 ms, the MLP's projections 1.0 -> 0.6 ms each. Serving and generation pack once;
an RL job's weights change every step, so its rollouts pack for the rollout and put the linears back
(`packed_while`: 0.25 s for SmolLM2-135M, against a 5-8 s rollout that runs 1.4x faster packed). A
tensor-parallel model keeps its linears (their DTensor weights carry the sharding plan), and so does a
model running under autocast (the packed weights would not follow its casts). Linears of one input that a
module declares fusable (models/common/protocol.py: `FusedProjections`: attention's q, k and v, the MLP's gate
and up) are packed as one, as vLLM does: one matmul instead of three or two (measured here on SmolLM2-135M's
shapes: q, k and v 74 -> 44 us at 1 row, 392 -> 345 us at 64)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, TypeGuard

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardforge.infer.fused_ops import FROM_CLASS, fuse_elementwise
from shardforge.models.common.protocol import FusedProjections

Undo = tuple[nn.Module, str, Any]  # (module, attribute, what it held before)


class PackedLinear(nn.Module):
    """y = x W^T + b with W in oneDNN's blocked layout (an opaque mkldnn tensor, not a parameter); given
    several linears of one input, W and b are theirs stacked (`PackedLinears` splits the output again)."""

    def __init__(self, *linears: nn.Linear) -> None:
        super().__init__()
        self.in_features = linears[0].in_features
        self.out_features = sum(linear.out_features for linear in linears)
        weights = [linear.weight.detach() for linear in linears]
        weight = torch.cat(weights) if weights[1:] else weights[0]  # one linear: no copy before the reorder
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.bias = None
        if any(linear.bias is not None for linear in linears):
            self.bias = torch.cat([_bias(linear) for linear in linears])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for oneDNN"


class PackedLinears(PackedLinear):
    """Several linears of one input as one packed matmul; returns each one's output (views of one tensor)."""

    def __init__(self, *linears: nn.Linear) -> None:
        super().__init__(*linears)
        self.sizes = [linear.out_features for linear in linears]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return super().forward(x).split(self.sizes, -1)


def _bias(linear: nn.Linear) -> torch.Tensor:
    if linear.bias is not None:
        return linear.bias.detach()
    return linear.weight.new_zeros(linear.out_features)


def _plain(module: nn.Module | None) -> TypeGuard[nn.Linear]:
    """A linear this file may pack: plain nn.Linear, not a LoRA wrapper, not a tensor-parallel shard."""
    return type(module) is nn.Linear and not isinstance(module.weight, DTensor)


def can_pack(model: nn.Module) -> bool:
    """oneDNN packs CPU weights of fp32 and, on CPUs with AVX-512 (BW/VL/DQ), bf16: an AVX2-only CPU's
    oneDNN refuses a bf16 reorder, so there the model keeps torch's own linears."""
    param = next(model.parameters())
    bf16 = param.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return (
        param.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and (param.dtype == torch.float32 or bf16)
        and not isinstance(param, DTensor)
    )


def pack_linears(model: nn.Module) -> list[Undo]:
    """Replace every plain CPU nn.Linear of a frozen model by a PackedLinear (those a module declares fusable
    by one PackedLinears in its slot, their attributes None); returns what to set back to undo it."""
    if not can_pack(model) or torch.is_autocast_enabled("cpu"):
        return []
    undo: list[Undo] = []
    for module in list(model.modules()):
        if not isinstance(module, FusedProjections):
            continue
        for slot, names in module.FUSED.items():
            if getattr(module, slot) is not None:  # packed already
                continue
            members = [module.get_submodule(name) for name in names]
            linears = [linear for linear in members if _plain(linear)]
            if len(linears) == len(members):
                undo.append((module, slot, None))
                undo += [(module, name, linear) for name, linear in zip(names, linears, strict=True)]
                setattr(module, slot, PackedLinears(*linears))
                for name in names:
                    setattr(module, name, None)
    swaps: list[tuple[nn.Module, str, nn.Linear]] = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if _plain(child)
    ]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return undo + swaps


def inference_layout(model: nn.Module) -> list[Undo]:
    """What a frozen model is laid out as once for inference on the CPU: its linears packed, its element-wise
    work on the fused kernels (infer/fused_ops.py); returns what to set back to undo it."""
    return pack_linears(model) + fuse_elementwise(model)


@contextlib.contextmanager
def packed_while(model: nn.Module) -> Iterator[None]:
    """The model laid out for inference inside the block (`inference_layout`), as trained after it."""
    undo = inference_layout(model)
    try:
        yield
    finally:
        restore(undo)


def restore(undo: list[Undo]) -> None:
    """Set back what `inference_layout` (or `pack_linears`) changed, in reverse order."""
    for parent, name, before in reversed(undo):
        if before is FROM_CLASS:
            delattr(parent, name)
        else:
            setattr(parent, name, before)
