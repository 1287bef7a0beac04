"""QLoRA's frozen base: the decoder blocks' linear weights in 4-bit NormalFloat (NF4, torchao), quantized one
tensor at a time as they are read, so the whole model is never held in full precision.

An NF4 weight keeps 4 bits per value plus one 8-bit scale per block of 64 values and one fp32 factor per
block of scales (double quantization, as QLoRA): about a quarter of bf16. `F.linear` on it dequantizes on the
fly (torchao's `linear_nf4`, which also gives the input's gradient), and FSDP2 shards and gathers it.
"""

from __future__ import annotations

import ctypes
import re

import torch
from torch import nn

from shardforge.errors import ModelError
from shardforge.models.common.protocol import CausalModel

QUANTIZED = re.compile(r"^layers\.\d+\.(attn|mlp)\.\w+_proj\.weight$")  # what NF4 holds: the block linears
BLOCK = 64  # values per scale (QLoRA's)
_CHUNK = 1 << 20  # values quantized at a time
# the 16 NormalFloat levels of the QLoRA paper (quantiles of N(0, 1) scaled to [-1, 1]), as torchao keeps them
NF4_LEVELS = torch.tensor(
    [
        *(-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0),
        *(0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0),
    ]
)


def is_nf4(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "quantized_data") and hasattr(tensor, "quantized_scalers")


def nf4(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in NF4 (its dtype stays the one it computes in), in torchao's layout and with its scales, but
    quantized a chunk of blocks at a time by a search over the level midpoints: torchao's `to_nf4` holds
    scaled copies and a 16-wide distance matrix of the whole weight, ~20x the weight's size at its peak.
    Scales are grouped in blocks of up to 256 (QLoRA's), smaller where a weight has few, so that FSDP2 can
    split them over up to 8 ranks."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, SubclassTensorArgs

    if tensor.numel() % BLOCK or tensor.dim() > 2:
        raise ModelError(
            f"model.quantize=nf4: a weight of shape {tuple(tensor.shape)} is not a matrix whose size is a "
            f"multiple of {BLOCK}"
        )
    tensor = tensor.detach().contiguous()
    blocks = tensor.view(-1, BLOCK)
    absmax = blocks.abs().amax(dim=1)  # one scale per block, in the weight's dtype (as torchao)
    scaler_block = _scaler_block(absmax.numel())
    scalers, factor, mean = _double_quantized(absmax, scaler_block)
    levels = NF4_LEVELS.to(device=tensor.device, dtype=tensor.dtype)  # the levels it dequantizes with
    midpoints = ((levels[1:].float() + levels[:-1].float()) / 2).contiguous()
    divisor = absmax.float().clamp_min(torch.finfo(torch.float32).tiny)  # an all-zero block stays zeros
    codes = torch.empty(tensor.numel() // 2, dtype=torch.uint8, device=tensor.device)
    step = _CHUNK // BLOCK
    for start in range(0, blocks.shape[0], step):
        part = blocks[start : start + step].float() / divisor[start : start + step, None]
        # the nearest level; a value on a midpoint takes the lower one, as torchao's first-minimum does
        index = torch.bucketize(part.flatten(), midpoints).to(torch.uint8)
        codes[start * BLOCK // 2 : (start + part.shape[0]) * BLOCK // 2] = index[::2] << 4 | index[1::2]
    meta = SubclassTensorArgs(
        tensor.size(), tensor.stride(), tensor.storage_offset(), tensor.dtype, tensor.device, False
    )
    return NF4Tensor(meta, BLOCK, blocks.shape[0], scaler_block, scalers, factor, mean, codes, nf4=levels)


def _scaler_block(scales: int) -> int:
    """The largest of QLoRA's 256 and smaller powers of 2 that divides `scales` and leaves a multiple of 8
    scale blocks (FSDP2 splits every inner tensor over the ranks), else the largest that divides."""
    sizes = [s for s in (256, 128, 64, 32, 16, 8, 4, 2, 1) if scales % s == 0]
    return next((s for s in sizes if (scales // s) % 8 == 0), sizes[0])


def _double_quantized(absmax: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """QLoRA's double quantization of the block scales, as torchao lays it out: int8 codes of the scales
    less their mean, one factor per `size` scales, and the mean."""
    mean = absmax.mean()
    centred = (absmax - mean).view(-1, size)
    factor = 256 / (2 * centred.abs().amax(dim=1))
    codes = (centred * factor[:, None]).round().clamp(-128, 127).to(torch.int8).flatten()
    return codes, factor.contiguous(), mean


def set_nf4(model: nn.Module, key: str, tensor: torch.Tensor) -> None:
    """Replace the parameter `key` by `tensor` in NF4, frozen (the full-precision tensor can go)."""
    module_name, _, name = key.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, name, nn.Parameter(nf4(tensor), requires_grad=False))
    _release_freed_host_memory()


def _release_freed_host_memory() -> None:
    """Hand the heap's free pages back to the system (glibc): the full-precision weights read and freed one
    by one leave holes between the 4-bit ones that glibc would keep, ~0.7x the NF4 model's size by the end
    of a load. Measured on a 220M model: peak growth 381 -> 243 MiB for 201 MiB of parameters."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc (macOS, musl): nothing to trim
        return None


_LIBC = _glibc()


def quantized_names(model: CausalModel) -> set[str]:
    """The parameters NF4 holds: the block linears' weights (our names; on the generic backend, the weight of
    every nn.Linear inside the decoder blocks, whatever the family calls it)."""
    if model.native_names:
        return {key for key, _ in model.named_parameters() if QUANTIZED.match(key)}
    return {
        f"{name}.weight"
        for name, module in model.named_modules()
        if type(module) is nn.Linear and model.canonical_name(name).startswith("layers.")
    }


def quantize_model(model: CausalModel) -> None:
    """Quantize a built model's block linears in place, one weight at a time."""
    names = quantized_names(model)
    for key, param in list(model.named_parameters()):
        if key in names:
            set_nf4(model, key, param.detach())


def nf4_storage_bytes(numel: int, itemsize: int) -> int:
    """What `nf4` makes of a weight of `numel` elements computing in a dtype of `itemsize` bytes: 4-bit codes,
    an int8 scale per block, a factor per scale block and the 16 levels (as `nf4_bytes` counts them)."""
    scales = numel // BLOCK
    return numel // 2 + scales + scales // _scaler_block(scales) * itemsize + 16 * itemsize


def nf4_bytes(tensor: torch.Tensor) -> int:
    """The storage an NF4 weight takes: codes, scales, factors."""
    parts = (tensor.quantized_data, tensor.quantized_scalers, tensor.quantization_factor, tensor.nf4)
    return sum(t.numel() * t.element_size() for t in parts)


def dequantized(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor in the dtype an NF4 weight computes in (others as they are)."""
    return tensor.get_original_weight() if is_nf4(tensor) else tensor
