"""LoRA adapters in PEFT's folder format, and LoRA merged into the base for a plain HF folder.

PEFT names an adapter tensor by the HF module it belongs to: `base_model.model.<hf module>.lora_A.weight`,
`.lora_B.weight` and, for DoRA, `.lora_magnitude_vector`; `adapter_config.json` says peft_type LORA,
task_type CAUSAL_LM, r, lora_alpha, target_modules, use_dora, use_rslora and the base model.
`peft.PeftModel.from_pretrained` loads such a folder over the HF base and computes what our model computes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from shardforge.adapters.lora import LoRALinear, is_adapter_key, merge_weight
from shardforge.config.schema import LoraSection
from shardforge.errors import ModelError
from shardforge.models.quantize import dequantized
from shardforge.models.spec import spec_for

ADAPTER_FILE, CONFIG_FILE = "adapter_model.safetensors", "adapter_config.json"
_OURS_TO_PEFT = {
    "lora_A": "lora_A.weight",
    "lora_B": "lora_B.weight",
    "lora_magnitude": "lora_magnitude_vector",
}


def _split(key: str) -> tuple[str, str]:
    """`layers.0.attn.q_proj.lora_A` -> (`layers.0.attn.q_proj`, `lora_A`)."""
    module, _, name = key.rpartition(".")
    return module, name


def adapted_leaves(keys: Iterable[str]) -> list[str]:
    """The short names of the modules adapter tensors (our names) belong to: `layers.0.attn.q_proj.lora_A`
    -> `q_proj` (PEFT's target_modules)."""
    return sorted({_split(key)[0].rpartition(".")[2] for key in keys})


def peft_key(family: str, key: str) -> str:
    module, name = _split(key)
    hf_module = spec_for(family).key_to_hf(f"{module}.weight").removesuffix(".weight")
    return f"base_model.model.{hf_module}.{_OURS_TO_PEFT[name]}"


def our_key(family: str, key: str) -> str:
    for ours, peft in _OURS_TO_PEFT.items():
        suffix = f".{peft}"
        if key.startswith("base_model.model.") and key.endswith(suffix):
            hf_module = key.removeprefix("base_model.model.").removesuffix(suffix)
            return spec_for(family).key_from_hf(f"{hf_module}.weight").removesuffix(".weight") + f".{ours}"
    raise ModelError(f"adapter weight {key!r} is not a LoRA weight of this model family (unexpected key)")


def save_adapter(
    folder: Path,
    family: str,
    adapters: dict[str, torch.Tensor],
    lora: LoraSection,
    base: str | None,
    tokenizer: Any = None,
    fan_in_fan_out: bool = False,
) -> Path:
    """Write `adapters` (our names: `<module>.lora_A` ...) as a PEFT adapter folder. `fan_in_fan_out`: the
    adapted layers are transformers' Conv1D (GPT-2), as peft records them."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {peft_key(family, k): v.detach().float().contiguous().cpu() for k, v in adapters.items()}
    save_file(tensors, str(folder / ADAPTER_FILE), metadata={"format": "pt"})
    targets = adapted_leaves(adapters)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": targets,
        "use_dora": lora.dora,
        "use_rslora": lora.rslora,
        "bias": "none",
        "fan_in_fan_out": fan_in_fan_out,
        "init_lora_weights": True,
        "inference_mode": True,
        "base_model_name_or_path": base,
        "modules_to_save": None,
    }
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


def read_adapter(folder: Path, family: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """A PEFT LoRA folder's config and tensors (our names)."""
    config_path = folder / CONFIG_FILE
    if not config_path.is_file() or not (folder / ADAPTER_FILE).is_file():
        raise ModelError(
            f"model.adapter: {folder} is not a PEFT adapter folder (needs {CONFIG_FILE} and {ADAPTER_FILE})"
        )
    config = json.loads(config_path.read_text())
    if config.get("peft_type") != "LORA":
        raise ModelError(f"model.adapter: {folder}: peft_type {config.get('peft_type')!r}; only LORA is read")
    tensors = {our_key(family, k): v for k, v in load_file(str(folder / ADAPTER_FILE)).items()}
    return config, tensors


def merged_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A plain model's full state (our names, no adapter tensors): every LoRA layer's weight merged
    (W + s B A, DoRA-scaled per row) in the base weight's dtype."""
    out = {k: dequantized(v) for k, v in state.items() if not is_adapter_key(k)}  # QLoRA: never the 4 bits
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            weight = state[f"{name}.weight"]
            parts = (state[f"{name}.lora_A"], state[f"{name}.lora_B"], state.get(f"{name}.lora_magnitude"))
            flip = module.fan_in_fan_out  # a Conv1D's weight is stored [in, out]
            plain = dequantized(weight).T if flip else dequantized(weight)
            merged = merge_weight(plain, *parts, module.scale)
            out[f"{name}.weight"] = (merged.T if flip else merged).to(weight.dtype)
    return out


def load_adapter(model: torch.nn.Module, folder: Path, lora: LoraSection) -> None:
    """Put a PEFT LoRA folder's tensors into a model that `add_lora` prepared with the same settings (the
    layers this model holds: a pipeline rank holds some). Settings, targets or a base that differ are
    errors naming what differs."""
    config, tensors = read_adapter(folder, model.config.family)
    wanted = {"r": lora.rank, "lora_alpha": lora.alpha, "use_dora": lora.dora, "use_rslora": lora.rslora}
    differ = [
        f"{key}={config.get(key)!r} in the adapter but {value!r} in method.lora"
        for key, value in wanted.items()
        if config.get(key, False if key.startswith("use_") else None) != value
    ]
    if differ:
        raise ModelError(
            f"model.adapter {folder}: {'; '.join(differ)} (set method.lora to match the adapter)"
        )
    ours = {k: v for k, v in model.state_dict().items() if is_adapter_key(k)}
    held = {k.split(".")[1] for k in ours}
    theirs = {k: v for k, v in tensors.items() if k.split(".")[1] in held}
    missing, unexpected = sorted(ours.keys() - theirs.keys()), sorted(theirs.keys() - ours.keys())
    if missing or unexpected:
        shown = ", ".join(
            [*(f"missing {k}" for k in missing[:3]), *(f"unexpected {k}" for k in unexpected[:3])]
        )
        raise ModelError(
            f"model.adapter {folder}: its target modules ({', '.join(config.get('target_modules') or [])}) "
            f"differ from method.lora.targets ({shown})"
        )
    for key, tensor in theirs.items():
        if tensor.shape != ours[key].shape:
            raise ModelError(
                f"model.adapter {folder}: {key} is {tuple(tensor.shape)} but this model's is "
                f"{tuple(ours[key].shape)}: the adapter was trained over another base "
                f"({config.get('base_model_name_or_path')}, not this model.path)"
            )
    model.load_state_dict(theirs, strict=False)
