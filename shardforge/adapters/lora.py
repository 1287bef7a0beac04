"""A linear layer with a LoRA (or DoRA) adapter, as PEFT defines them.

`LoRALinear` is an `nn.Linear` (so tensor-parallel styles and FSDP2 take it as one) that keeps the base
`weight` and `bias` under their own names, frozen, and adds `lora_A` [rank, in], `lora_B` [out, rank] and,
for DoRA, `lora_magnitude` [out]:

    LoRA:  y = W x + b + s B A drop(x),                 s = alpha / rank  (alpha / sqrt(rank): rsLoRA)
    DoRA:  y = W x + b + (m / n - 1) W drop(x) + (m / n) s B A drop(x),   n = ||W + s B A|| per row, detached

DoRA's row norm is a constant for the gradient, as its paper (section 4.3) and PEFT do; m starts at ||W|| per
row, so a fresh adapter changes nothing. Under tensor parallel the same expressions run on DTensors whose
placements follow the base (see `parallel/tensor_parallel.py`), so the norm of a row split over ranks is
reduced by DTensor itself.

PiSSA (`init="pissa"`, peft's `init_lora_weights="pissa"` / `"pissa_niter_N"`) starts A and B from W's r
principal singular directions, s B0 A0 = U_r S_r V_r^T. peft subtracts that start from the base weight; here
the base stays W and the layer keeps the start (buffers `pissa_A`, `pissa_B`) to subtract it in the adapter:
W x - s B0 A0 x + s B A drop(x) is peft's W_res x + s B A drop(x), with the same gradients. So the base with
adapters off is the model the run started from (a preference run's reference), and the adapter written out
is a plain LoRA of rank 2r, [A; A0] and [B, -B0], as peft's `path_initial_model_for_weight_conversion`
converts it.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from shardforge.models.quantize import dequantized


class AdapterLayer:
    """What every adapter layer has: a switch back to its base alone (the reference model of preference
    training)."""

    adapter_enabled = True


class LoRALinear(AdapterLayer, nn.Linear):
    """Over an `nn.Linear`, or over transformers' `Conv1D` (GPT-2's layers: the weight stored [in, out], x W +
    b), which it keeps as it is stored (`fan_in_fan_out`, as peft calls it), computing the same map."""

    def __init__(
        self,
        base: nn.Linear | Conv1D,
        rank: int,
        alpha: float,
        dropout: float,
        dora: bool,
        rslora: bool,
        pissa_iter: int | None = None,
    ):
        nn.Module.__init__(self)
        self.fan_in_fan_out = isinstance(base, Conv1D)
        if self.fan_in_fan_out:
            self.in_features, self.out_features = base.weight.shape
        else:
            self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias  # the same Parameters: loaded weights stay
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.rank, self.alpha, self.rslora = rank, alpha, rslora
        self.scale = alpha / math.sqrt(rank) if rslora else alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        factory = {"device": base.weight.device, "dtype": torch.float32}  # adapters train in fp32
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **factory))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, **factory))
        self.lora_magnitude = nn.Parameter(torch.empty(self.out_features, **factory)) if dora else None
        self.pissa_iter = (
            pissa_iter  # None: the default init; -1: PiSSA by full SVD, else fast SVD's iterations
        )
        if pissa_iter is not None:  # the start, saved with checkpoints (a resumed run converts it too)
            self.register_buffer("pissa_A", torch.zeros(rank, self.in_features, **factory))
            self.register_buffer("pissa_B", torch.zeros(self.out_features, rank, **factory))

    def reset_adapter(self, name: str, seed: int) -> None:
        """A from kaiming-uniform (as nn.Linear and PEFT), B zero, m = ||W|| per row. Seeded by the module's
        name, so every layout (and every pipeline rank, which builds only its own layers) draws the same A."""
        if self.pissa_iter is not None:
            self._reset_pissa(seed + zlib.crc32(name.encode()))
            return
        generator = torch.Generator(device="cpu").manual_seed(seed + zlib.crc32(name.encode()))
        bound = 1 / math.sqrt(self.in_features)  # kaiming_uniform_(a=sqrt(5)) on a [rank, in] matrix
        values = torch.rand(self.lora_A.shape, generator=generator) * 2 * bound - bound
        with torch.no_grad():
            self.lora_A.copy_(values)
            self.lora_B.zero_()
            if self.lora_magnitude is not None:
                self.lora_magnitude.copy_(self.base_weight().float().norm(dim=1))

    def _reset_pissa(self, seed: int) -> None:
        """peft's `pissa_init`: B = U_r sqrt(S_r / s), A = sqrt(S_r / s) V_r^T, by full SVD or by fast SVD
        (its random start seeded by the module's name, so every rank and layout draws the same)."""
        weight = self.base_weight().float()
        if self.pissa_iter == -1:
            u, singular, vh = torch.linalg.svd(weight, full_matrices=False)
            u, singular, vh = u[:, : self.rank], singular[: self.rank], vh[: self.rank]
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                u, singular, v = torch.svd_lowrank(weight, self.rank, niter=self.pissa_iter)
            vh = v.T
        root = torch.sqrt(singular / self.scale)
        a, b = root[:, None] * vh, u * root[None, :]
        with torch.no_grad():
            self.lora_A.copy_(a)
            self.pissa_A.copy_(a)
            self.lora_B.copy_(b)
            self.pissa_B.copy_(b)

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) of the update this layer adds, s B A: PiSSA's with its start subtracted, rank 2r."""
        if self.pissa_iter is None:
            return self.lora_A, self.lora_B
        return torch.cat([self.lora_A, self.pissa_A]), torch.cat([self.lora_B, -self.pissa_B], dim=1)

    def base_weight(self) -> torch.Tensor:
        """W as a linear's [out, in] (a Conv1D's stored weight transposed; QLoRA's dequantized)."""
        weight = dequantized(self.weight)
        return weight.T if self.fan_in_fan_out else weight

    def delta_weight(self) -> torch.Tensor:
        """s B A, in fp32: what LoRA adds to W."""
        a, b = self.factors()
        return self.scale * (b @ a)

    def merged_weight(self) -> torch.Tensor:
        """The plain linear weight this layer computes (fp32)."""
        return merge_weight(self.base_weight(), *self.factors(), self.lora_magnitude, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.T if self.fan_in_fan_out else self.weight
        out = F.linear(x, weight, self.bias)
        if not self.adapter_enabled:
            return out
        dropped = self.dropout(x)
        a, b = self.lora_A, self.lora_B
        low = F.linear(F.linear(dropped.to(a.dtype), a), b) * self.scale
        if (
            self.pissa_iter is not None
        ):  # the start comes off W itself (peft's W_res): dropout never reaches it
            low = low - F.linear(F.linear(x.to(a.dtype), self.pissa_A), self.pissa_B) * self.scale
        if self.lora_magnitude is None:
            return out + low.to(out.dtype)
        with torch.no_grad():
            norm = (self.base_weight().float() + self.delta_weight()).norm(dim=1)
        factor = self.lora_magnitude / norm
        if isinstance(self.dropout, nn.Identity):  # W x without the bias, from the base output
            plain = (out if self.bias is None else out - self.bias).float()
        else:
            plain = F.linear(dropped, weight).float()
        return out + ((factor - 1) * plain + factor * low).to(out.dtype)

    def extra_repr(self) -> str:
        kind = (
            "DoRA" if self.lora_magnitude is not None else "PiSSA" if self.pissa_iter is not None else "LoRA"
        )
        return f"{super().extra_repr()}, {kind} rank={self.rank}, scale={self.scale:g}"


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model, for as long as the block runs: every adapter layer computes its frozen base alone.
    This is the reference model of a LoRA preference run, with no second copy of the weights."""
    layers = adapter_layers(model)
    for layer in layers:
        layer.adapter_enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.adapter_enabled = True


def adapter_layers(model: nn.Module) -> list[AdapterLayer]:
    return [m for m in model.modules() if isinstance(m, AdapterLayer)]


def merge_weight(
    weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, magnitude: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """W + s B A, and for DoRA scaled per row to the magnitude (fp32)."""
    merged = dequantized(weight).float() + scale * (b.float() @ a.float())
    if magnitude is None:
        return merged
    return (magnitude.float() / merged.norm(dim=1)).unsqueeze(1) * merged


def pissa_converted(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full state (our names) with each PiSSA layer's adapter as the plain LoRA it amounts to: [A; A0] and
    [B, -B0] (rank 2r, the same scale), its start dropped (peft's `subtract_mutated_init`)."""
    out = {k: v for k, v in state.items() if ".pissa_" not in k}
    for key in state:
        if key.endswith(".pissa_A"):
            layer = key.removesuffix(".pissa_A")
            out[f"{layer}.lora_A"] = torch.cat([state[f"{layer}.lora_A"], state[key]])
            out[f"{layer}.lora_B"] = torch.cat([state[f"{layer}.lora_B"], -state[f"{layer}.pissa_B"]], dim=1)
    return out


def is_adapter_key(key: str) -> bool:
    """Is this state-dict key (our names) an adapter's tensor (LoRA's, or OFT's rotations)?"""
    return ".lora_" in key or key.endswith(".oft_R")
