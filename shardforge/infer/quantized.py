"""Weight-only int8 and int4 linears for the engine (`--quantize int8|int4`, `--group-size N`): decoding reads
every weight once a step, so fewer bytes a weight is a faster step, not only a smaller model.

The numbers are torchao's (0.18): int8 is its `Int8WeightOnlyConfig` scheme (symmetric, one scale per output
row, `Int8Tensor.from_hp`); int4 its tinygemm scheme (asymmetric groups of `group_size` inputs, w = (q - 8) x
scale + zero, `_choose_qparams_affine_tinygemm`). The matmuls are torch's own weight-only kernels,
`_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu` (CPU only for now: CUDA's tinygemm takes another
layout, and nothing has run it here), which run the activations in bf16 (fp16 for an fp16 model): on this
CPU their fp32 paths are scalar loops, 5-11x slower than the fp32 oneDNN matmul, while their bf16 paths beat
it. torchao's own int8 linear casts the whole int8 weight to the activations' dtype every call (slower than
fp32 here; benchmarks/README.md), and its CPU int4 tensor (`Int4OpaqueTensor`) calls the same kernel.
The output comes back in the model's dtype.

A quantized linear is no `nn.Linear`, so infer/packed.py leaves it alone; the q/k/v and gate/up linears a
module declares fusable (`FusedProjections`) are quantized as one (their rows stacked: the same numbers as
quantized apart, as rows and groups never mix) and put in the module's slot, as packing does. Only the
engine's load quantizes (infer/load.py); training and RL rollouts never see these modules."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardforge.errors import ConfigError
from shardforge.log import get_logger
from shardforge.models.common.protocol import CausalModel, FusedProjections

log = get_logger(__name__)

SCHEMES = ("int8", "int4")
GROUP_SIZES = (32, 64, 128, 256)  # what the int4 kernels take


@dataclass(frozen=True)
class Quantization:
    """What `--quantize` / `--group-size` ask for."""

    scheme: str
    group_size: int = 128

    def check(self) -> Quantization:
        if self.scheme not in SCHEMES:
            raise ConfigError(f"--quantize {self.scheme!r} is not one of {', '.join(SCHEMES)}")
        if self.scheme == "int4" and self.group_size not in GROUP_SIZES:
            raise ConfigError(
                f"--group-size {self.group_size}: int4 groups are one of {', '.join(map(str, GROUP_SIZES))}"
            )
        return self


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The activations' dtype in the quantized matmuls: fp16 for an fp16 model, else bf16 (see above)."""
    return torch.float16 if dtype == torch.float16 else torch.bfloat16


@dataclass
class Int8Weight:
    """q [N, K] int8 and one scale per row [N]: w = q x scale."""

    q: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def of(weight: torch.Tensor) -> Int8Weight:
        from torchao.quantization.granularity import PerRow
        from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor

        t = Int8Tensor.from_hp(weight.detach(), granularity=PerRow())
        return Int8Weight(t.qdata.contiguous(), t.scale.reshape(-1).float())

    def dequantized(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]


@dataclass
class Int4Weight:
    """q [N, K] in 0..15 (int32), groups of `group` inputs along K with scale and zero [N, K / group]
    (w = (q - 8) x scale + zero), and `perm`: the order of the input columns q is in (GPTQ's act-order), or
    None."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group: int
    perm: torch.Tensor | None = None

    @staticmethod
    def of(weight: torch.Tensor, group: int) -> Int4Weight:
        from torchao.quantization.quant_primitives import (
            MappingType,
            _choose_qparams_affine_tinygemm,
            _quantize_affine_tinygemm,
        )

        w = weight.detach().float()
        block = [1, group]
        scale, zero = _choose_qparams_affine_tinygemm(
            w, MappingType.ASYMMETRIC, block, torch.int32, 0, 15, 1e-6, None, w.dtype
        )
        q = _quantize_affine_tinygemm(w, block, scale, zero, torch.int32, 0, 15)
        rows = w.shape[0]
        return Int4Weight(q, scale.reshape(rows, -1), zero.reshape(rows, -1), group)

    def dequantized(self) -> torch.Tensor:
        """The weight in fp32, columns in the model's order."""
        scale = self.scale.float().repeat_interleave(self.group, 1)
        zero = self.zero.float().repeat_interleave(self.group, 1)
        w = (self.q.float() - 8) * scale + zero
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    def regrouped(self, group: int) -> Int4Weight:
        """The same numbers in smaller groups (each group's scale and zero repeated): a checkpoint's groups
        of 1024, or one group a row (GPTQ's group_size -1), as groups the kernels take."""
        if self.group == group:
            return self
        times = self.group // group
        return Int4Weight(
            self.q,
            self.scale.repeat_interleave(times, 1),
            self.zero.repeat_interleave(times, 1),
            group,
            self.perm,
        )


Weight = Int8Weight | Int4Weight


def stacked(weights: list[Weight]) -> Weight:
    """Several linears' weights as one (rows stacked in order): what a fused q/k/v or gate/up slot holds."""
    first = weights[0]
    if isinstance(first, Int8Weight):
        return Int8Weight(torch.cat([w.q for w in weights]), torch.cat([w.scale for w in weights]))
    assert all(isinstance(w, Int4Weight) and w.group == first.group for w in weights)
    return Int4Weight(
        torch.cat([w.q for w in weights]),
        torch.cat([w.scale for w in weights]),  # type: ignore[union-attr]
        torch.cat([w.zero for w in weights]),  # type: ignore[union-attr]
        first.group,
        first.perm,
    )


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W in int8 or int4 (`Int8Weight` / `Int4Weight`), laid out once for the device's
    kernel; `sizes`: the outputs of several stacked linears, returned as a tuple (a fused slot)."""

    def __init__(
        self,
        weight: Weight,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        device: torch.device,
        sizes: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.q.shape
        self.dtype, self.compute = dtype, compute_dtype(dtype)
        self.sizes = sizes
        self.scheme = "int8" if isinstance(weight, Int8Weight) else "int4"
        self.group = weight.group if isinstance(weight, Int4Weight) else 0
        perm = weight.perm if isinstance(weight, Int4Weight) else None
        self.register_buffer("perm", None if perm is None else perm.to(device), persistent=False)
        self.register_buffer(
            "bias", None if bias is None else bias.detach().to(device, dtype), persistent=False
        )
        if isinstance(weight, Int8Weight):
            self.register_buffer("qweight", weight.q.to(device), persistent=False)
            self.register_buffer("scales", weight.scale.to(device, self.compute), persistent=False)
        else:
            self.register_buffer("qweight", _int4_packed(weight.q.to(device)), persistent=False)
            scale_zero = torch.stack([weight.scale, weight.zero], -1).transpose(0, 1)  # [K / g, N, 2]
            self.register_buffer("scales", scale_zero.to(device, self.compute).contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        flat = x.reshape(-1, self.in_features).to(self.compute)
        if self.perm is not None:
            flat = flat.index_select(1, self.perm)
        if self.scheme == "int8":
            out = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.qweight, self.group, self.scales)
        return shaped(out, x, self.bias, self.sizes)

    def extra_repr(self) -> str:
        group = f", group_size={self.group}" if self.group else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme}{group}, "
            f"activations in {str(self.compute).removeprefix('torch.')}"
        )


def shaped(
    out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, sizes: list[int] | None
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """A quantized matmul's rows [M, N] as the linear's output: x's dtype and leading dims, plus the bias,
    split into the stacked linears' outputs where several share the layer (a fused slot)."""
    out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    out = out.view(*x.shape[:-1], out.shape[-1])
    return out.split(sizes, -1) if sizes else out


def _int4_packed(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] (0..15) in the CPU int4 kernel's layout."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)


def fits(scheme: str, linear: nn.Linear, group: int) -> bool:
    """Whether the kernels take this linear's shape: int4 needs groups that divide its inputs and (the CPU
    layout) outputs in multiples of 16."""
    if scheme == "int8":
        return True
    return linear.in_features % group == 0 and linear.out_features % 16 == 0


def _quantized(linears: list[nn.Linear], spec: Quantization) -> QuantizedLinear:
    weights: list[Weight] = [
        Int8Weight.of(lin.weight) if spec.scheme == "int8" else Int4Weight.of(lin.weight, spec.group_size)
        for lin in linears
    ]
    bias = None
    if any(lin.bias is not None for lin in linears):
        bias = torch.cat([lin.bias if lin.bias is not None else lin.weight.new_zeros(lin.out_features)
                          for lin in linears])  # fmt: skip
    first = linears[0].weight
    sizes = [lin.out_features for lin in linears] if len(linears) > 1 else None
    return QuantizedLinear(stacked(weights), bias, first.dtype, first.device, sizes)


def _in_scope(model: CausalModel, name: str) -> bool:
    """The linears a quantized model holds in int8/int4: the decoder blocks' and the LM head (the largest
    matrix a decode step reads); not a vision tower's, a score head or PPO's value head."""
    canonical = model.canonical_name(name)
    return canonical.startswith("layers.") or canonical == "lm_head"


def quantize_for_inference(model: CausalModel, spec: Quantization) -> int:
    """Replace the model's block linears and LM head by `QuantizedLinear`s, one at a time (fusable groups as
    one, in their module's slot); returns how many linears were quantized. A linear whose shape the kernels
    do not take keeps full precision (logged); none at all is a ConfigError naming --group-size."""
    spec = spec.check()
    device = next(model.parameters()).device
    if device.type != "cpu":  # torch's CUDA kernels (tinygemm) take other layouts; nothing has run them here
        raise ConfigError(f"--quantize {spec.scheme} runs on the CPU; the model is on {device}")
    if model.config.num_labels:
        raise ConfigError("--quantize: a reward model's score head is not quantized; serve it unquantized")
    done = skipped = 0
    names = {module: name for name, module in model.named_modules()}
    for module in list(model.modules()):
        if not isinstance(module, FusedProjections) or not _in_scope(model, names[module]):
            continue
        for slot, members in module.FUSED.items():
            linears = [module.get_submodule(n) for n in members]
            if getattr(module, slot) is not None or not all(type(lin) is nn.Linear for lin in linears):
                continue
            if all(fits(spec.scheme, lin, spec.group_size) for lin in linears):
                setattr(module, slot, _quantized(linears, spec))
                for n in members:
                    setattr(module, n, None)
                done += len(linears)
    for name, child in list(model.named_modules()):
        if type(child) is not nn.Linear or not _in_scope(model, name):
            continue
        if not fits(spec.scheme, child, spec.group_size):
            skipped += 1
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, _quantized([child], spec))
        done += 1
    if not done:
        raise ConfigError(
            f"--quantize {spec.scheme} --group-size {spec.group_size}: no linear of this model has a shape "
            f"the int4 kernels take (inputs a multiple of the group size, outputs a multiple of 16); try "
            f"--group-size 32 or 64"
        )
    if skipped:
        log.warning(f"--quantize {spec.scheme}: {skipped} linear(s) kept in full precision (shape)")
    return done


def linear_reference(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What a QuantizedLinear computes, written plainly: the weight dequantized with the scales (and zeros)
    as the layer holds them, times the activations as the kernel sees them (both rounded to its dtype), in
    fp32."""
    compute = compute_dtype(x.dtype)
    if isinstance(weight, Int8Weight):
        held: Weight = Int8Weight(weight.q, weight.scale.to(compute).float())
    else:
        scale, zero = weight.scale.to(compute).float(), weight.zero.to(compute).float()
        held = Int4Weight(weight.q, scale, zero, weight.group, weight.perm)
    return F.linear(x.to(compute).float(), held.dequantized(), None if bias is None else bias.float())
