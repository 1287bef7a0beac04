"""Which parameters go where, by LLaMA-Factory 0.9.5's rules (llamafactory/train/trainer_utils.py), so a run
converted from an LF config groups its parameters as LF does: the decay set, the linears GaLore / APOLLO
project, and LoRA+'s learning rates."""

from __future__ import annotations

import torch
from torch import nn

from shardforge.errors import ConfigError


def lf_decay_names(model: nn.Module) -> set[str]:
    """LF's `_get_decay_parameter_names`: every parameter not inside an `nn.LayerNorm` and without "bias" in
    its name. RMSNorm is not an nn.LayerNorm, so LF decays the norms of Llama-like models in the GaLore,
    APOLLO, BAdam and LoRA+ builders (unlike transformers' Trainer for plain AdamW); we follow LF."""
    skip = {
        f"{mod_name}.{p_name}" if mod_name else p_name
        for mod_name, module in model.named_modules()
        if isinstance(module, nn.LayerNorm)
        for p_name, _ in module.named_parameters(recurse=False)
    }
    return {n for n, _ in model.named_parameters() if n not in skip and "bias" not in n}


def lf_linear_targets(model: nn.Module) -> list[str]:
    """LF's `find_all_linear_modules` ("all"): the last name part of every linear module, not the LM head."""
    names = {
        name.split(".")[-1]
        for name, module in model.named_modules()
        if "lm_head" not in name
        and "Linear" in type(module).__name__
        and "Embedding" not in type(module).__name__
    }
    return sorted(names)


def projected_params(model: nn.Module, targets: str | list[str], key: str) -> list[nn.Parameter]:
    """The trainable 2-D weights of the `nn.Linear` modules whose name holds a target, in module order (LF's
    GaLore / APOLLO selection); `key` names the config key in the error when none matches."""
    wanted = lf_linear_targets(model) if targets == "all" else list(targets)
    found = [
        p
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and any(t in name for t in wanted)
        for p in module.parameters()
        if p.requires_grad and p.ndim > 1
    ]
    if not found:
        raise ConfigError(
            f"{key}={targets}: no trainable linear weight of the model matches; give module names such as "
            f"{', '.join(lf_linear_targets(model)) or 'q_proj, v_proj'}, or all"
        )
    return found


def split_by_decay(model: nn.Module, exclude: set[int]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(decayed, not decayed) trainable parameters by LF's rule, leaving out those in `exclude` (ids)."""
    decay_names = lf_decay_names(model)
    decay, nodecay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in exclude:
            (decay if name in decay_names else nodecay).append(p)
    return decay, nodecay


def lora_plus_groups(model: nn.Module, lr: float, ratio: float, weight_decay: float) -> list[dict]:
    """LF's `_create_loraplus_optimizer` (and peft's `create_loraplus_optimizer`): lora_B weights and every
    1-D trained tensor (DoRA's magnitudes) at lr x ratio, the rest (lora_A) at lr; decay by LF's rule. Each
    group carries its own lr, so the schedule (a LambdaLR) scales each group's own base rate."""
    decay_names = lf_decay_names(model)
    a, b, b_nodecay = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if "lora_B" in name or p.ndim == 1:
            (b if name in decay_names else b_nodecay).append(p)
        else:
            a.append(p)
    groups = [
        {"params": a, "lr": lr, "weight_decay": weight_decay},
        {"params": b, "lr": lr * ratio, "weight_decay": weight_decay},
        {"params": b_nodecay, "lr": lr * ratio, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def state_tensors_of(states: dict) -> list[torch.Tensor]:
    """Every tensor an optimizer's per-parameter states hold, projectors' matrices included (what
    `parallel.memory_report` sums through an optimizer's `state_tensors`)."""
    out: list[torch.Tensor] = []
    for state in states.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                out.append(value)
            elif hasattr(value, "ortho_matrix"):  # GaLore's / APOLLO's projector
                matrix = value.ortho_matrix
                out.extend(
                    matrix if isinstance(matrix, list | tuple) else [m for m in [matrix] if m is not None]
                )
    return out
