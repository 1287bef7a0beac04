"""Adapters folded into their base: a PEFT LoRA or OFT folder merged into a loaded model, and adapted
linears turned back into plain ones. For what only runs forward (inference, a reference model)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from shardforge.adapters.apply import add_lora, add_oft
from shardforge.adapters.expert_lora import ParamLoRA
from shardforge.adapters.lora import LoRALinear
from shardforge.adapters.oft import OFTLinear
from shardforge.adapters.peft_format import adapted_leaves, load_adapter, read_adapter
from shardforge.config.method_schema import EXPERT_TARGETS, LINEAR_TARGETS, LoraSection, OFTSection
from shardforge.errors import ModelError


def merge_adapter(model: nn.Module, folder: Path) -> None:
    """The PEFT adapter in `folder` applied to `model` and merged into its weights, in place."""
    config, tensors = read_adapter(folder, model.config.family)
    if config["peft_type"] == "OFT":
        merge_oft(model, folder, config, tensors)
        return
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


def merge_oft(model: nn.Module, folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """A PEFT OFT folder (peft's defaults besides the block size and the Neumann switch, as LLaMA-Factory's
    runs and ours write them) merged into `model`."""
    defaults = {"r": 0, "coft": False, "block_share": False, "num_cayley_neumann_terms": 5}  # module_dropout:
    # training's alone, nothing to merge
    unread = {k: config[k] for k, off in defaults.items() if config.get(k, off) != off}
    if unread:
        raise ModelError(f"{folder}: OFT with {unread}; shardforge reads OFT with oft_block_size alone set")
    section = OFTSection(
        block_size=config["oft_block_size"],
        targets=adapted_leaves(tensors) if model.native_names else "all",
        cayley_neumann=bool(config.get("use_cayley_neumann", True)),
    )
    add_oft(model, section)
    state = model.state_dict()
    missing = sorted(k for k in state if k.endswith(".oft_R") and k not in tensors)
    unexpected = sorted(set(tensors) - set(state))
    if missing or unexpected:
        raise ModelError(f"{folder}: OFT weights that do not fit this model: {(missing + unexpected)[:3]}")
    model.load_state_dict(tensors, strict=False)
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
        elif isinstance(module, LoRALinear | OFTLinear):
            merged = module.merged_weight().detach()
            plain: nn.Module
            if isinstance(module, LoRALinear) and module.fan_in_fan_out:  # transformers' Conv1D, [in, out]
                plain, merged = Conv1D(module.out_features, module.in_features), merged.T.contiguous()
            else:
                plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            with torch.no_grad():
                plain.weight = nn.Parameter(merged, requires_grad=False)
                if module.bias is not None:
                    plain.bias = nn.Parameter(module.bias.detach(), requires_grad=False)
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, plain)
