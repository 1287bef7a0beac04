"""A linear layer with an OFT adapter, as peft defines it (LLaMA-Factory's `finetuning_type: oft`).

OFT rotates the layer's input by a block-diagonal orthogonal matrix before the frozen weight: y = W (M^T x)
+ b, i.e. the input row x M, with M = diag(R_1 ... R_r) of r blocks of size b (r b = in). Each block is the
Cayley transform of a skew-symmetric Q_i, (I + Q)(I - Q)^-1, which peft approximates by its Neumann series
I + 2 Q + 2 Q^2 + ... + Q^(terms-1) (`use_cayley_neumann`, 5 terms) or computes exactly. The trained parameter
`oft_R` [r, b (b - 1) / 2] holds each Q's upper triangle, zero at the start (M = I: a fresh adapter changes
nothing). Merged, the layer is W M^T."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardforge.adapters.lora import AdapterLayer
from shardforge.models.quantize import dequantized


def block_size_for(in_features: int, wanted: int) -> int:
    """The block size peft uses on a layer `in_features` wide: `wanted` if it divides the width, else the
    nearest divisor (peft's `adjust_oft_parameters`, lower on a tie)."""
    if in_features % wanted == 0 and wanted <= in_features:
        return wanted
    if wanted >= in_features:
        return in_features
    higher = wanted
    while higher <= in_features and in_features % higher:
        higher += 1
    lower = wanted
    while lower > 1 and in_features % lower:
        lower -= 1
    return lower if wanted - lower <= higher - wanted else higher


class OFTLinear(AdapterLayer, nn.Linear):
    """Over an `nn.Linear`, whose `weight` and `bias` it keeps (frozen) under their own names."""

    def __init__(self, base: nn.Linear, block_size: int, neumann_terms: int | None):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.block_size = block_size_for(self.in_features, block_size)
        self.blocks = self.in_features // self.block_size
        self.neumann_terms = neumann_terms  # None: the exact Cayley transform
        elements = self.block_size * (self.block_size - 1) // 2
        factory = {"device": base.weight.device, "dtype": torch.float32}  # adapters train in fp32
        self.oft_R = nn.Parameter(torch.zeros(self.blocks, elements, **factory))
        rows, cols = torch.triu_indices(self.block_size, self.block_size, 1)
        self.register_buffer("upper", torch.stack([rows, cols]).to(base.weight.device), persistent=False)

    def reset_adapter(self, name: str, seed: int) -> None:
        """Zero: the identity rotation (peft's init_weights True)."""
        with torch.no_grad():
            self.oft_R.zero_()

    def rotations(self) -> torch.Tensor:
        """The blocks R_i [r, b, b] (fp32)."""
        return self._cayley(self.oft_R)

    def rotations_of(self, oft_r: torch.Tensor) -> torch.Tensor:
        """M = diag(R_1 ... R_r) [in, in] of a saved `oft_R` (fp32)."""
        return torch.block_diag(*self._cayley(oft_r.float().to(self.upper.device)))

    def _cayley(self, oft_r: torch.Tensor) -> torch.Tensor:
        b = self.block_size
        q = oft_r.new_zeros(self.blocks, b, b)
        q[:, self.upper[0], self.upper[1]] = oft_r
        q = q - q.transpose(-2, -1)
        eye = torch.eye(b, device=q.device, dtype=q.dtype).expand(self.blocks, b, b)
        if self.neumann_terms is None:
            return torch.linalg.solve(eye + q, eye - q, left=False)
        terms, r = self.neumann_terms, eye.clone()
        if terms > 1:
            r = r + 2 * q
        if terms > 2:
            power = q @ q
            r = r + 2 * power
            for _ in range(3, terms - 1):
                power = power @ q
                r = r + 2 * power
            r = r + power @ q
        return r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.adapter_enabled:
            rotated = torch.einsum("...rk,rkc->...rc", x.to(torch.float32).unflatten(-1, (self.blocks, -1)),
                                   self.rotations())  # fmt: skip
            x = rotated.flatten(-2).to(x.dtype)
        return F.linear(x, self.weight, self.bias)

    def merged_weight(self) -> torch.Tensor:
        """W M^T (fp32): the plain linear weight this layer computes."""
        return dequantized(self.weight).float() @ self.rotations_of(self.oft_R).T

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, OFT blocks={self.blocks}x{self.block_size}"
