"""QLoRA's frozen base: the decoder blocks' linear weights in 4-bit NormalFloat (NF4, torchao), quantized one
tensor at a time as they are read, so the whole model is never held in full precision.

An NF4 weight keeps 4 bits per value plus one 8-bit scale per block of 64 values and one fp32 factor per
block of scales (double quantization, as QLoRA): about a quarter of bf16. `F.linear` on it dequantizes on the
fly (torchao's `linear_nf4`, which also gives the input's gradient), and FSDP2 shards and gathers it.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from shardforge.errors import ModelError

QUANTIZED = re.compile(r"^layers\.\d+\.(attn|mlp)\.\w+_proj\.weight$")  # what NF4 holds: the block linears
BLOCK = 64  # values per scale (QLoRA's)


def is_nf4(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "quantized_data") and hasattr(tensor, "quantized_scalers")


def nf4(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in NF4 (its dtype stays the one it computes in). Scales are grouped in blocks of up to 256
    (QLoRA's), smaller where a weight has few, so that FSDP2 can split them over up to 8 ranks."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    if tensor.numel() % BLOCK:
        raise ModelError(
            f"model.quantize=nf4: a weight of shape {tuple(tensor.shape)} is not a multiple of {BLOCK}"
        )
    scales = tensor.numel() // BLOCK
    sizes = [s for s in (256, 128, 64, 32, 16, 8, 4, 2, 1) if scales % s == 0]
    # FSDP2 splits every inner tensor over the ranks: keep a multiple of 8 scale blocks where there is room
    scaler_block = next((s for s in sizes if (scales // s) % 8 == 0), sizes[0])
    return to_nf4(tensor, block_size=BLOCK, scaler_block_size=scaler_block)


def set_nf4(model: nn.Module, key: str, tensor: torch.Tensor) -> None:
    """Replace the parameter `key` by `tensor` in NF4, frozen (the full-precision tensor can go)."""
    module_name, _, name = key.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, name, nn.Parameter(nf4(tensor), requires_grad=False))


def quantize_model(model: nn.Module) -> None:
    """Quantize a built model's block linears in place, one weight at a time."""
    for key, param in list(model.named_parameters()):
        if QUANTIZED.match(key):
            set_nf4(model, key, param.detach())


def nf4_bytes(tensor: torch.Tensor) -> int:
    """The storage an NF4 weight takes: codes, scales, factors."""
    parts = (tensor.quantized_data, tensor.quantized_scalers, tensor.quantization_factor, tensor.nf4)
    return sum(t.numel() * t.element_size() for t in parts)


def dequantized(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor in the dtype an NF4 weight computes in (others as they are)."""
    return tensor.get_original_weight() if is_nf4(tensor) else tensor
