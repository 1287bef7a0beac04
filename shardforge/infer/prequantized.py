"""Quantized checkpoints as people download them: a folder whose config.json has a `quantization_config` of
AWQ (AutoAWQ's GEMM format), GPTQ (AutoGPTQ / GPTQModel, 4 bits, act-order included) or fp8
(`quant_method: fp8`, or compressed-tensors' float-quantized), loaded into the engine's quantized linears
without a detour through full precision.

The formats, as their reference code writes them (AutoGPTQ `qlinear_cuda_old.pack`, AutoAWQ `pack` /
`unpack_awq`): 4-bit values packed eight to an int32, lowest bits first. GPTQ packs `qweight` [K / 8, N]
along the inputs and `qzeros` [K / group, N / 8] along the outputs, and its `gptq` checkpoint format stores
each zero less one; w = scale x (q - zero) with the group of input k given by `g_idx[k]` (act-order:
groups are not contiguous; the columns are reordered so that they are, and the activations follow). AWQ
packs both `qweight` [K, N / 8] and `qzeros` along the outputs in the order 0 2 4 6 1 3 5 7; w = (q - zero)
x scale, groups contiguous. Both become `Int4Weight` (zero' = (8 - zero) x scale): the same weights, in
the kernel's form. fp8 runs `torch._scaled_mm` (the activations quantized per tensor as the checkpoint
says: its static input scale, else from each call's maximum, as vLLM's dynamic fp8 does) where the device
has it, and is refused by name where not."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from shardforge.errors import ModelError
from shardforge.infer.quantized import GROUP_SIZES, Int4Weight, QuantizedLinear, Weight, shaped, stacked
from shardforge.models.common.protocol import FusedProjections

AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # AWQ packs the columns 0 2 4 6 1 3 5 7 into one int32
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
FP8_MAX = 448.0  # float8_e4m3fn


@dataclass(frozen=True)
class Format:
    """A checkpoint's `quantization_config`, checked: `method` awq | gptq | fp8."""

    method: str
    group: int = 0  # awq / gptq: inputs per group (0: one group a row)
    zeros_less_one: bool = False  # gptq's `gptq` checkpoint format
    static_inputs: bool = False  # fp8: the activations' scale is in the checkpoint


def quantization_config(folder: Path) -> dict | None:
    """config.json's `quantization_config`, or None for a full-precision folder."""
    path = folder / "config.json"
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # the loader reports a bad config.json
    found = meta.get("quantization_config") if isinstance(meta, dict) else None
    return found if isinstance(found, dict) else None


def _refuse(folder: Path, key: str, value: Any, allowed: str) -> ModelError:
    return ModelError(
        f"{folder / 'config.json'}: quantization_config.{key} = {value!r} is not supported (loads: {allowed})"
    )


def read_format(folder: Path, config: dict) -> Format:
    """The checkpoint's format, or a ModelError naming the config key and value this loader cannot take."""
    method = str(config.get("quant_method", "")).lower()
    if method in ("awq", "gptq"):
        bits = config.get("bits", config.get("w_bit"))
        if bits != 4:
            raise _refuse(folder, "bits", bits, "4")
        group = config.get("group_size", config.get("q_group_size", 128))
        if not isinstance(group, int) or (group != -1 and (group < 32 or group % 32)):
            raise _refuse(folder, "group_size", group, "-1 or a multiple of 32")
        if method == "awq":
            version = str(config.get("version", "gemm")).lower()
            if version != "gemm":
                raise _refuse(folder, "version", config.get("version"), "gemm")
            if config.get("zero_point", True) is not True:
                raise _refuse(folder, "zero_point", config.get("zero_point"), "true")
            return Format("awq", max(group, 0))
        checkpoint = str(config.get("checkpoint_format", "gptq")).lower()
        if checkpoint not in ("gptq", "gptq_v2"):
            raise _refuse(folder, "checkpoint_format", config.get("checkpoint_format"), "gptq, gptq_v2")
        return Format("gptq", max(group, 0), zeros_less_one=checkpoint == "gptq")
    if method == "fp8":
        if config.get("weight_block_size"):
            raise _refuse(folder, "weight_block_size", config["weight_block_size"], "none: per-tensor scales")
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise _refuse(folder, "activation_scheme", scheme, "dynamic, static")
        return Format("fp8", static_inputs=scheme == "static")
    if method == "compressed-tensors":
        return _compressed_tensors(folder, config)
    raise _refuse(
        folder, "quant_method", config.get("quant_method"), "awq, gptq, fp8, compressed-tensors fp8"
    )


def _compressed_tensors(folder: Path, config: dict) -> Format:
    """compressed-tensors: its float-quantized (fp8) format, weights per tensor or per output channel."""
    fmt = config.get("format")
    if fmt != "float-quantized":
        raise _refuse(folder, "format", fmt, "float-quantized (fp8)")
    groups = config.get("config_groups") or {}
    static = False
    for name, group in groups.items():
        weights = (group or {}).get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise _refuse(folder, f"config_groups.{name}.weights", weights, "8-bit float weights")
        if weights.get("strategy") not in ("tensor", "channel"):
            raise _refuse(folder, f"config_groups.{name}.weights.strategy", weights.get("strategy"),
                          "tensor, channel")  # fmt: skip
        inputs = (group or {}).get("input_activations") or {}
        static = static or (bool(inputs) and not inputs.get("dynamic", True))
    return Format("fp8", static_inputs=static)


def fp8_supported(device: torch.device) -> bool:
    """Whether this device runs fp8 matmuls (torch._scaled_mm): CUDA from compute capability 8.9, and the
    CPU where torch's oneDNN build has it (checked by running one)."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    try:
        a = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


class Fp8Linear(nn.Module):
    """y = x W^T + b with W in float8_e4m3fn and its scale (one, or one per output row); the activations
    are quantized to fp8 per tensor (a static scale, or each call's maximum) for `torch._scaled_mm`."""

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        input_scale: torch.Tensor | None,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        device: torch.device,
        sizes: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype, self.sizes = dtype, sizes
        self.register_buffer("weight", weight.to(device), persistent=False)
        scale = weight_scale.float().reshape(-1).to(device)
        self.register_buffer("row_scale", scale if scale.numel() > 1 else None, persistent=False)
        self.register_buffer("tensor_scale", scale[0] if scale.numel() == 1 else scale.new_ones(()),
                             persistent=False)  # fmt: skip
        static = None if input_scale is None else input_scale.float().reshape(()).to(device)
        self.register_buffer("input_scale", static, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.to(device, dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        flat = x.reshape(-1, self.in_features).float()
        scale = self.input_scale
        if scale is None:
            scale = (flat.abs().amax() / FP8_MAX).clamp_min(1e-12)
        x8 = (flat / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out = torch._scaled_mm(
            x8, self.weight.t(), scale_a=scale, scale_b=self.tensor_scale, out_dtype=torch.float32
        )
        if self.row_scale is not None:
            out = out * self.row_scale
        return shaped(out, x, self.bias, self.sizes)

    def extra_repr(self) -> str:
        kind = "per-row" if self.row_scale is not None else "per-tensor"
        inputs = "static" if self.input_scale is not None else "dynamic"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, fp8 {kind}, {inputs} inputs"
        )


def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] holding eight 4-bit values each, lowest first, packed along R: [R * 8, C]."""
    values = (packed[:, None, :] >> _SHIFTS[None, :, None]) & 15
    return values.reshape(-1, packed.shape[1])


def _unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] holding eight 4-bit values each, lowest first, packed along C: [R, C * 8]."""
    values = (packed[:, :, None] >> _SHIFTS[None, None, :]) & 15
    return values.reshape(packed.shape[0], -1)


def _kernel_group(group: int) -> int:
    """The largest group the kernels take that divides the checkpoint's."""
    return next(g for g in sorted(GROUP_SIZES, reverse=True) if group % g == 0)


def gptq_weight(tensors: dict[str, torch.Tensor], fmt: Format, where: str) -> Int4Weight:
    """A GPTQ linear's qweight / qzeros / scales / g_idx as an `Int4Weight` (see the module's docstring)."""
    q = _unpack_rows(tensors["qweight"]).t()  # [N, K]
    n, k = q.shape
    zeros = _unpack_columns(tensors["qzeros"])[:, :n]  # [G, N]
    if fmt.zeros_less_one:
        zeros = zeros + 1
    scales = tensors["scales"].float()  # [G, N]
    group = fmt.group or k
    expected = torch.arange(k, dtype=torch.int32) // group
    g_idx = tensors.get("g_idx")
    perm = None
    if g_idx is not None and not torch.equal(g_idx.to(torch.int32), expected):
        perm = torch.argsort(g_idx.to(torch.int64), stable=True)
        if not torch.equal(g_idx.to(torch.int32)[perm], expected):
            raise ModelError(
                f"{where}.g_idx: groups of unequal sizes (desc_act with group_size {fmt.group}); only "
                f"groups of group_size inputs each, in any order, are supported"
            )
        q = q[:, perm]
    scale = scales.t().contiguous()  # [N, G]
    zero = (8 - zeros.t().float()) * scale
    weight = Int4Weight(q.contiguous().to(torch.int32), scale, zero, group, perm)
    return weight.regrouped(_kernel_group(group))


def awq_weight(tensors: dict[str, torch.Tensor], fmt: Format) -> Int4Weight:
    """An AWQ (GEMM) linear's qweight / qzeros / scales as an `Int4Weight`."""
    order = torch.arange(tensors["qweight"].shape[1] * 8).view(-1, 8)[:, list(AWQ_REVERSE_ORDER)].reshape(-1)
    q = _unpack_columns(tensors["qweight"])[:, order].t()  # [N, K]
    zeros = _unpack_columns(tensors["qzeros"])[:, order]  # [G, N]
    k = q.shape[1]
    scale = tensors["scales"].float().t().contiguous()  # [N, G]
    zero = (8 - zeros.t().float()) * scale
    group = fmt.group or k
    return Int4Weight(q.contiguous().to(torch.int32), scale, zero, group).regrouped(_kernel_group(group))


_INT4_KEYS = ("qweight", "qzeros", "scales", "g_idx", "bias")
_FP8_KEYS = ("weight", "weight_scale", "input_scale", "bias")


def _read_quantized(files: list[Path], fmt: Format) -> dict[str, dict[str, torch.Tensor]]:
    """The packed linears' tensors by HF module name: those with a qweight (awq / gptq) or an fp8 weight."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            keys = list(f.keys())
            if fmt.method == "fp8":
                modules = {k.rpartition(".")[0] for k in keys if k.endswith(".weight_scale")}
                names = _FP8_KEYS
            else:
                modules = {k.rpartition(".")[0] for k in keys if k.endswith(".qweight")}
                names = _INT4_KEYS
            for key in keys:
                module, _, leaf = key.rpartition(".")
                if module in modules and leaf in names:
                    found.setdefault(module, {})[leaf] = f.get_tensor(key)
    return found


def _layer(
    tensors: dict[str, torch.Tensor], fmt: Format, dtype: torch.dtype, device: torch.device, where: str
) -> tuple[Weight | None, nn.Module | None]:
    """One packed linear: its Int4Weight (to be fused or built), or its built Fp8Linear."""
    if fmt.method == "fp8":
        scale_inv = tensors.get("weight_scale")
        if tensors["weight"].dtype != torch.float8_e4m3fn or scale_inv is None:
            raise ModelError(f"{where}.weight: expected float8_e4m3fn with a weight_scale")
        inputs = tensors.get("input_scale") if fmt.static_inputs else None
        return None, Fp8Linear(tensors["weight"], scale_inv, inputs, tensors.get("bias"), dtype, device)
    missing = [k for k in ("qweight", "qzeros", "scales") if k not in tensors]
    if missing:
        raise ModelError(f"{where}: the packed linear has no {', '.join(missing)}")
    weight = gptq_weight(tensors, fmt, where) if fmt.method == "gptq" else awq_weight(tensors, fmt)
    return weight, None


def load_prequantized(
    folder: Path, config: dict, dtype: torch.dtype, device: torch.device, backend: str = "auto"
) -> nn.Module:
    """Our model of a quantized HF folder: its packed linears as the engine's quantized ones, the rest
    (embedding, norms, an unquantized head) read as any folder's weights, in `dtype`."""
    from transformers import AutoConfig

    from shardforge.models.io import build_empty, load_hf_weights, read_config_json, weight_files
    from shardforge.models.spec import Slot, spec_for

    fmt = read_format(folder, config)
    if fmt.method == "fp8" and not fp8_supported(device):
        raise ModelError(
            f"{folder}: fp8 weights (quantization_config.quant_method={config.get('quant_method')!r}) need "
            f"fp8 matmul (torch._scaled_mm), which {device} does not run: use a CUDA GPU of compute "
            f"capability 8.9 or newer, or a full-precision copy of the model"
        )
    meta = read_config_json(folder)
    spec = spec_for(meta.get("model_type"), meta.get("architectures"), backend)
    if spec.load_folder is not None:
        raise ModelError(
            f"{folder}: a {config.get('quant_method')} checkpoint of a family on the generic backend "
            f"({meta.get('model_type')}); quantized checkpoints load on the native families only"
        )
    hf = AutoConfig.from_pretrained(folder)
    if hasattr(hf, "quantization_config"):
        del hf.quantization_config
    model = build_empty(spec, spec.config_from_hf(hf), device, None, dtype)
    files = weight_files(folder)
    packed = _read_quantized(files, fmt)
    claimed = frozenset(f"{m}.{leaf}" for m, parts in packed.items() for leaf in parts)
    layers: dict[str, tuple[Weight, torch.Tensor | None]] = {}
    for hf_name, tensors in packed.items():
        ours = spec.key_from_hf(f"{hf_name}.weight")
        if isinstance(ours, Slot):
            raise ModelError(
                f"{folder}: {hf_name} is a quantized expert; quantized MoE experts are not loaded"
            )
        name = ours.removesuffix(".weight")
        if not isinstance(_get(model, name), nn.Linear):
            raise ModelError(f"{folder}: quantized weight {hf_name!r} is no linear of this model")
        weight, built = _layer(tensors, fmt, dtype, device, f"{folder.name}: {hf_name}")
        if built is not None:
            _set(model, name, built)
        else:
            assert weight is not None
            layers[name] = (weight, tensors.get("bias"))
            _set(model, name, nn.Identity())  # its parameters are gone; built below
    load_hf_weights(model, spec, files, dtype, device=device, claimed=claimed)
    _build_int4(model, layers, dtype, device)
    return model


def _build_int4(
    model: nn.Module,
    layers: dict[str, tuple[Weight, torch.Tensor | None]],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """The int4 linears into the model: fusable groups (q/k/v, gate/up) as one where their columns are in
    the same order, the rest one by one."""
    names = {module: name for name, module in model.named_modules()}
    for module in list(model.modules()):
        if not isinstance(module, FusedProjections) or module not in names:
            continue
        prefix = names[module] + "." if names[module] else ""
        for slot, members in module.FUSED.items():
            keys = [prefix + m for m in members]
            if not all(k in layers for k in keys):
                continue
            weights = [layers[k][0] for k in keys]
            first = weights[0]
            same = all(
                isinstance(w, Int4Weight) and isinstance(first, Int4Weight) and w.group == first.group
                and _same_perm(w.perm, first.perm) for w in weights
            )  # fmt: skip
            if not same:
                continue
            biases = [layers[k][1] for k in keys]
            sizes = [w.q.shape[0] for w in weights]
            bias = None
            if any(b is not None for b in biases):
                bias = torch.cat(
                    [b if b is not None else torch.zeros(s) for b, s in zip(biases, sizes, strict=True)]
                )
            setattr(module, slot, QuantizedLinear(stacked(weights), bias, dtype, device, sizes))
            for m, k in zip(members, keys, strict=True):
                setattr(module, m, None)
                del layers[k]
    for name, (weight, bias) in layers.items():
        _set(model, name, QuantizedLinear(weight, bias, dtype, device))


def _same_perm(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _get(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)
