"""LoRA adapters folded into their base: a PEFT adapter folder merged into a loaded model, and LoRA linears
turned back into plain ones. For what only runs forward (inference, a reference model)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from shardforge.adapters.apply import add_lora
from shardforge.adapters.expert_lora import ParamLoRA
from shardforge.adapters.lora import LoRALinear
from shardforge.adapters.peft_format import adapted_leaves, load_adapter, read_adapter
from shardforge.config.schema import EXPERT_TARGETS, LINEAR_TARGETS, LoraSection


def merge_adapter(model: nn.Module, folder: Path) -> None:
    """The PEFT adapter in `folder` applied to `model` and merged into its weights, in place."""
    config, tensors = read_adapter(folder, model.config.family)
    # a vision-language model's tower modules it adapts, named whole (their names are not targets')
    tower = frozenset(
        k.rpartition(".")[0]
        for k in tensors
        if model.config.part_of(model.canonical_name(k.rpartition(".")[0])) == "tower"
    )
    # the adapted modules' names from its tensors (another tool's target_modules may be a regex)
    adapted = adapted_leaves(k for k in tensors if k.rpartition(".")[0] not in tower)
    experts = [t for t in adapted if t in EXPERT_TARGETS]
    linears: list[str] | str = [t for t in adapted if t not in EXPERT_TARGETS]
    if not model.native_names and not set(linears) <= set(LINEAR_TARGETS):
        # the generic backend's `all` (every linear of the blocks, e.g. Falcon's query_key_value): what its
        # runs write; load_adapter names any of them the adapter lacks
        linears = "all"
    settings = {
        "rank": config["r"],
        "alpha": config["lora_alpha"],
        "dora": bool(config.get("use_dora", False)),
        "rslora": bool(config.get("use_rslora", False)),
    }
    section = LoraSection(targets=linears if linears == "all" else linears + experts, **settings)
    if linears == "all" and experts:  # `all` is the linears only; the experts' adapters come on top
        add_lora(model, LoraSection(targets=experts, **settings), seed=0)
    add_lora(model, section, seed=0, tower=tower or False)
    load_adapter(model, folder, section)
    merge_lora_modules(model)


def merge_lora_modules(model: nn.Module) -> None:
    """Each LoRA linear becomes a plain one holding W + s B A (DoRA-scaled), each fused experts weight
    holds W_e + s B_e A_e."""
    for name, module in list(model.named_modules()):
        if isinstance(module, ParamLoRA):
            owner = model.get_submodule(name.rpartition(".")[0])
            weight = owner.get_parameter(module.param_name)
            with torch.no_grad():
                weight.copy_((weight.float() + module.delta()).to(weight.dtype))
            module.detach_from(owner)
        elif isinstance(module, LoRALinear):
            merged = module.merged_weight().detach()
            plain: nn.Module
            if module.fan_in_fan_out:  # transformers' Conv1D again, its weight [in, out]
                plain, merged = Conv1D(module.out_features, module.in_features), merged.T.contiguous()
            else:
                plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            with torch.no_grad():
                plain.weight = nn.Parameter(merged, requires_grad=False)
                if module.bias is not None:
                    plain.bias = nn.Parameter(module.bias.detach(), requires_grad=False)
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, plain)
