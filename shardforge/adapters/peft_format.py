"""LoRA adapters in PEFT's folder format, and LoRA merged into the base for a plain HF folder.

PEFT names an adapter tensor by the HF module it belongs to: `base_model.model.<hf module>.lora_A.weight`,
`.lora_B.weight` and, for DoRA, `.lora_magnitude_vector`; `adapter_config.json` says peft_type LORA,
task_type CAUSAL_LM, r, lora_alpha, target_modules, use_dora, use_rslora and the base model.
`peft.PeftModel.from_pretrained` loads such a folder over the HF base and computes what our model computes.

Adapters on fused experts weights (expert_lora.py) are peft's `target_parameters`: named after the experts
module, with one `.base_layer` per wrapper peft nests outside theirs (the weights it registers later), e.g.
`...mlp.experts.base_layer.lora_A.weight` (gate_up_proj) and `...mlp.experts.lora_A.weight` (down_proj) when
both are adapted. Ours are `<experts>.<param>_lora.lora_A`.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from shardforge.adapters.expert_lora import EXPERT_PARAMS, ParamLoRA, expert_delta
from shardforge.adapters.lora import LoRALinear, is_adapter_key, merge_weight
from shardforge.adapters.oft import OFTLinear
from shardforge.config.method_schema import LoraSection, OFTSection
from shardforge.errors import ModelError
from shardforge.models.quantize import dequantized
from shardforge.models.spec import spec_for

ADAPTER_FILE, CONFIG_FILE = "adapter_model.safetensors", "adapter_config.json"
_OURS_TO_PEFT = {
    "lora_A": "lora_A.weight",
    "lora_B": "lora_B.weight",
    "lora_magnitude": "lora_magnitude_vector",
    "oft_R": "oft_R.weight",
}


def _split(key: str) -> tuple[str, str]:
    """`layers.0.attn.q_proj.lora_A` -> (`layers.0.attn.q_proj`, `lora_A`)."""
    module, _, name = key.rpartition(".")
    return module, name


def _expert_param(module: str) -> tuple[str, str] | None:
    """`layers.1.mlp.experts.gate_up_proj_lora` -> (`layers.1.mlp.experts`, `gate_up_proj`); None for a
    linear's adapter."""
    owner, _, leaf = module.rpartition(".")
    for param in EXPERT_PARAMS:
        if leaf == f"{param}_lora":
            return owner, param
    return None


def adapted_leaves(keys: Iterable[str]) -> list[str]:
    """What adapter tensors (our names) adapt, as `method.lora.targets` names it: a linear's short name
    (`layers.0.attn.q_proj.lora_A` -> `q_proj`, PEFT's target_modules) or a fused experts weight
    (`experts.gate_up_proj`)."""
    leaves = set()
    for key in keys:
        module = _split(key)[0]
        expert = _expert_param(module)
        leaves.add(f"experts.{expert[1]}" if expert else module.rpartition(".")[2])
    return sorted(leaves)


def peft_keys(family: str, keys: Iterable[str]) -> dict[str, str]:
    """Our adapter keys -> PEFT's (module docstring)."""
    keys = list(keys)
    adapted: dict[str, set[str]] = defaultdict(set)
    for key in keys:
        expert = _expert_param(_split(key)[0])
        if expert:
            adapted[expert[0]].add(expert[1])
    spec = spec_for(family)
    to_hf = spec.key_to_hf
    out = {}
    for key in keys:
        module, name = _split(key)
        expert = _expert_param(module)
        if expert is None:
            hf_module = to_hf(f"{module}.weight").removesuffix(".weight")
        else:
            owner, param = expert
            nested = [p for p in EXPERT_PARAMS if p in adapted[owner]]
            hf_owner = to_hf(f"{owner}.{param}").removesuffix(f".{param}")
            hf_module = hf_owner + ".base_layer" * (len(nested) - 1 - nested.index(param))
        out[key] = f"base_model.model.{spec.peft_module(hf_module)}.{_OURS_TO_PEFT[name]}"
    return out


def our_keys(family: str, keys: Iterable[str], target_parameters: list[str]) -> dict[str, str]:
    """PEFT's adapter keys -> ours, the fused experts' read by the config's `target_parameters` as peft
    matches them (the full name, or a suffix after a dot)."""
    from_hf = spec_for(family).key_from_hf
    out = {}
    for key in keys:
        found = [(o, p) for o, p in _OURS_TO_PEFT.items() if key.startswith("base_model.model.") and
                 key.endswith(f".{p}")]  # fmt: skip
        if not found:
            raise ModelError(
                f"adapter weight {key!r} is not an adapter weight of this model family (unexpected)"
            )
        ours, suffix = found[0]
        hf_module = key.removeprefix("base_model.model.").removesuffix(f".{suffix}")
        hf_owner = re.sub(r"(\.base_layer)+$", "", hf_module)
        depth = (len(hf_module) - len(hf_owner)) // len(".base_layer")
        nested = [
            p for p in EXPERT_PARAMS
            if any(f"{hf_owner}.{p}" == t or f"{hf_owner}.{p}".endswith(f".{t}") for t in target_parameters)
        ]  # fmt: skip
        if not nested:
            out[key] = from_hf(f"{hf_module}.weight").removesuffix(".weight") + f".{ours}"
            continue
        if depth >= len(nested):
            raise ModelError(f"adapter weight {key!r}: more wrappers than its target_parameters adapt")
        out[key] = from_hf(f"{hf_owner}.{nested[len(nested) - 1 - depth]}") + f"_lora.{ours}"
    return out


def _target_modules(adapters: Iterable[str], names: dict[str, str], others: set[str]) -> list[str]:
    """peft's target_modules: the adapted linears' short names, except where peft, which matches names as
    suffixes, would take more: a numbered one (a child of an nn.Sequential, as Zamba2's adapters: `0` would
    take `layers.0`, a whole layer) or one that also ends a module without an adapter (`others`); those are
    named whole."""
    leaves: dict[str, set[str]] = defaultdict(set)
    for key in adapters:
        module = _split(key)[0]
        if not _expert_param(module):
            whole = names[key].removeprefix("base_model.model.").rpartition(f".{_split(key)[1]}")[0]
            leaves[module.rpartition(".")[2]].add(whole)
    targets = set()
    for leaf, wholes in leaves.items():
        clash = leaf.isdigit() or any(o == leaf or o.endswith(f".{leaf}") for o in others)
        targets |= wholes if clash else {leaf}
    return sorted(targets)


def _target_parameters(family: str, adapters: Iterable[str]) -> list[str]:
    """peft's target_parameters for our fused experts adapters: each weight's HF path after the layer
    index (`mlp.experts.gate_up_proj`), which peft matches in every layer."""
    to_hf = spec_for(family).key_to_hf
    names = set()
    for key in adapters:
        expert = _expert_param(_split(key)[0])
        if expert:
            names.add(re.split(r"\.\d+\.", to_hf(f"{expert[0]}.{expert[1]}"), maxsplit=1)[-1])
    return sorted(names)


def save_adapter(
    folder: Path,
    family: str,
    adapters: dict[str, torch.Tensor],
    lora: LoraSection | OFTSection,
    base: str | None,
    tokenizer: Any = None,
    fan_in_fan_out: bool = False,
    others: Iterable[str] = (),
) -> Path:
    """Write `adapters` (our names: `<module>.lora_A` ...) as a PEFT adapter folder. `fan_in_fan_out`: the
    adapted layers are transformers' Conv1D (GPT-2), as peft records them. `others`: the HF names of the
    model's modules with weights that carry no adapter (a short name that also ends one of them is written
    as full names, so that peft adapts exactly ours)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = peft_keys(family, adapters)
    tensors = {names[k]: v.detach().float().contiguous().cpu() for k, v in adapters.items()}
    save_file(tensors, str(folder / ADAPTER_FILE), metadata={"format": "pt"})
    targets = _target_modules(adapters, names, set(others))
    common = {"task_type": "CAUSAL_LM", "target_modules": targets, "bias": "none",
              "fan_in_fan_out": fan_in_fan_out, "inference_mode": True, "base_model_name_or_path": base,
              "modules_to_save": None}  # fmt: skip
    if isinstance(lora, OFTSection):  # peft's OFTConfig: the block size, r inferred from it
        config = {"peft_type": "OFT", "r": 0, "oft_block_size": lora.block_size, "module_dropout": 0.0,
                  "use_cayley_neumann": lora.cayley_neumann, "num_cayley_neumann_terms": 5, "coft": False,
                  "eps": 6e-5, "block_share": False, "init_weights": True, **common}  # fmt: skip
    else:
        config = {"peft_type": "LORA", "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
                  "target_parameters": _target_parameters(family, adapters) or None, "use_dora": lora.dora,
                  "use_rslora": lora.rslora, "init_lora_weights": True, **common}  # fmt: skip
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
    if config.get("peft_type") not in ("LORA", "OFT"):
        raise ModelError(
            f"model.adapter: {folder}: peft_type {config.get('peft_type')!r}; LORA and OFT are read"
        )
    stored = load_file(str(folder / ADAPTER_FILE))
    names = our_keys(family, stored, config.get("target_parameters") or [])
    tensors = {names[k]: v for k, v in stored.items()}
    return config, tensors


def merged_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A plain model's full state (our names, no adapter tensors): every LoRA layer's weight merged
    (W + s B A, DoRA-scaled per row) and every fused experts weight (W_e + s B_e A_e), in the base weight's
    dtype."""
    out = {k: dequantized(v) for k, v in state.items() if not is_adapter_key(k)}  # QLoRA: never the 4 bits
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            weight = state[f"{name}.weight"]
            parts = (state[f"{name}.lora_A"], state[f"{name}.lora_B"], state.get(f"{name}.lora_magnitude"))
            flip = module.fan_in_fan_out  # a Conv1D's weight is stored [in, out]
            plain = dequantized(weight).T if flip else dequantized(weight)
            merged = merge_weight(plain, *parts, module.scale)
            out[f"{name}.weight"] = (merged.T if flip else merged).to(weight.dtype)
        elif isinstance(module, OFTLinear):
            weight = state[f"{name}.weight"]
            rotations = module.rotations_of(state[f"{name}.oft_R"])
            out[f"{name}.weight"] = (dequantized(weight).float() @ rotations.T).to(weight.dtype)
        elif isinstance(module, ParamLoRA):
            owner = name.rpartition(".")[0]
            weight = state[f"{owner}.{module.param_name}"]
            delta = expert_delta(state[f"{name}.lora_A"], state[f"{name}.lora_B"], module.experts,
                                 module.scale, module.transposed)  # fmt: skip
            out[f"{owner}.{module.param_name}"] = (weight.float() + delta).to(weight.dtype)
    return out


def _owner(key: str) -> str:
    """What holds an adapter tensor, as a pipeline rank holds it or not: its decoder layer (`layers.3`), or
    the module it is in (a vision-language model's tower: `visual`)."""
    parts = key.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def load_adapter(model: torch.nn.Module, folder: Path, lora: LoraSection) -> None:
    """Put a PEFT LoRA folder's tensors into a model that `add_lora` prepared with the same settings (the
    layers this model holds: a pipeline rank holds some). Settings, targets or a base that differ are
    errors naming what differs."""
    config, tensors = read_adapter(folder, model.config.family)
    if config["peft_type"] != "LORA":
        raise ModelError(
            f"model.adapter {folder}: a {config['peft_type']} adapter; training continues LoRA ones"
        )
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
    state = model.state_dict()
    ours = {k: v for k, v in state.items() if is_adapter_key(k)}
    held = {_owner(k) for k in state}  # what this rank holds, adapted or not
    theirs = {k: v for k, v in tensors.items() if _owner(k) in held}
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
