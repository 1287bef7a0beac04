"""LoftQ (Li et al. 2023; peft's `init_lora_weights="loftq"`, LLaMA-Factory's scripts/loftq_init.py): a
4-bit base and a LoRA adapter that start together close to the full-precision model.

For each adapted linear W, alternately: Q = NF4(W - B A) (bitsandbytes' NF4, blocks of 64, as peft
quantizes), then B A = the rank-r SVD of W - Q; after `iters` rounds the base holds Q (dequantized, so
`model.quantize: nf4` quantizes it again to the same grid) and the adapter B and A (peft's: B = U sqrt(S),
A = sqrt(S) V^T, not divided by the LoRA scale). The result is an HF folder (the base) and, inside it,
`loftq_init/` (a PEFT adapter over it): train it as QLoRA with `model.adapter` set to that adapter."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shardforge.errors import ConfigError, ModelError
from shardforge.extras import install_hint
from shardforge.models.io import INDEX_FILE, read_config_json, weight_files, write_weights

ADAPTER = "loftq_init"


def nf4_round_trip(weight: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' NF4 of `weight` (blocks of 64, scales unquantized), dequantized, fp32."""
    import bitsandbytes as bnb

    packed = bnb.nn.Params4bit(weight.cpu(), requires_grad=False, compress_statistics=False, quant_type="nf4")
    packed = packed.to("cpu")
    return bnb.functional.dequantize_4bit(packed.data, packed.quant_state).float()


def loftq_factors(
    weight: torch.Tensor, rank: int, iters: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Q, A, B) of one weight [out, in]: peft's `loftq_init` for 4 bits."""
    weight = weight.float()
    residual = weight.clone()
    for i in range(iters):
        quantized = nf4_round_trip(residual)
        u, s, vh = torch.linalg.svd(weight - quantized, full_matrices=False)
        root = torch.sqrt(s[:rank])
        b, a = u[:, :rank] * root, root[:, None] * vh[:rank]
        if i + 1 < iters:
            residual = weight - b @ a
    return quantized, a, b


def loftq_folder(
    source: str | Path,
    target: str | Path,
    rank: int = 16,
    alpha: float | None = None,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    iters: int = 4,
) -> Path:
    """LLaMA-Factory's `quantize_loftq` on an HF folder: `target` holds the base (the targeted linears'
    weights replaced by Q, the rest as they were) and `target/loftq_init` the adapter."""
    source, target = Path(source), Path(target)
    if rank < 1 or iters < 1:
        raise ConfigError(f"--rank {rank} / --iter {iters}: both must be at least 1")
    if target.resolve() == source.resolve():
        raise ModelError(f"{target}: LoftQ's base needs a folder of its own, not the source")
    config = read_config_json(source)
    try:
        import bitsandbytes  # noqa: F401  (the NF4 peft's LoftQ quantizes with)
    except ImportError:
        raise ConfigError(f"LoftQ quantizes with bitsandbytes: {install_hint('optimizers')}") from None
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(source):
        with safe_open(str(file), "pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118 (not a dict)
    pattern = re.compile(rf"^(.*\blayers\.\d+\..*\.({'|'.join(map(re.escape, targets))}))\.weight$")
    adapters: dict[str, torch.Tensor] = {}
    for key in list(tensors):
        match = pattern.match(key)
        if match is None or tensors[key].ndim != 2:
            continue
        quantized, a, b = loftq_factors(tensors[key], rank, iters)
        tensors[key] = quantized.to(tensors[key].dtype)
        adapters[f"base_model.model.{match[1]}.lora_A.weight"] = a.contiguous()
        adapters[f"base_model.model.{match[1]}.lora_B.weight"] = b.contiguous()
    if not adapters:
        raise ModelError(f"{source}: no linear of its decoder layers is named {', '.join(targets)}")
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and item.name != INDEX_FILE:
            shutil.copyfile(item, target / item.name)
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_weights(tensors, target, 5 * 1024**3)
    folder = target / ADAPTER
    folder.mkdir(exist_ok=True)
    save_file(adapters, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha or 2 * rank,
        "lora_dropout": 0.0, "target_modules": sorted(targets), "use_dora": False, "use_rslora": False,
        "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
        "base_model_name_or_path": str(target.resolve()), "modules_to_save": None,
    }  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    return target
