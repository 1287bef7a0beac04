"""`method.finetuning` applied to a built model, in place, before any parallel layout: which parameters train.

full: all of them. freeze: the last N decoder layers (negative N: the first N) and the named extra modules.
lora: every targeted linear of the decoder blocks becomes a `LoRALinear`, and each named fused experts weight
gets a `ParamLoRA` (expert_lora.py); only the adapters train. Names are
the model's own (`layers.<i>....`), so a pipeline rank, which holds some layers only, transforms exactly its
part of what the whole model would get. The generic backend's names are read as ours (`canonical_name`).
"""

from __future__ import annotations

from pathlib import Path

from torch import nn
from transformers.pytorch_utils import Conv1D

from shardforge.adapters.expert_lora import EXPERT_PARAMS, ParamLoRA, is_transposed
from shardforge.adapters.lora import LoRALinear
from shardforge.adapters.oft import OFTLinear
from shardforge.adapters.peft_names import not_for_peft
from shardforge.config.method_schema import (
    EXPERT_TARGETS,
    LINEAR_TARGETS,
    FreezeSection,
    LoraSection,
    MethodSection,
    OFTSection,
)
from shardforge.errors import ConfigError
from shardforge.models.common.protocol import CausalModel
from shardforge.models.generic.config import model_type_of
from shardforge.models.generic.verified import refuse_measured

# transformers' nn.Linear subclasses whose forward is nn.Linear's map, x W^T + b, written out (peft wraps any
# nn.Linear; a subclass that returns something else, as the routers of Llama 4 and PhiMoE do, is left alone).
# tests/unit/test_lora.py checks each against F.linear.
AFFINE_LINEARS = frozenset({"FalconLinear"})


def apply_finetuning(model: nn.Module, method: MethodSection, seed: int, adapter: str | None = None) -> None:
    """`adapter`: a PEFT LoRA folder whose tensors replace the fresh adapters (to continue training it)."""
    if method.finetuning == "freeze":
        freeze(model, method.freeze)
    elif method.finetuning == "lora":
        add_lora(model, method.lora, seed, tower=not method.vision.freeze_tower)
        if adapter is not None:
            from shardforge.adapters.peft_format import load_adapter

            load_adapter(model, Path(adapter), method.lora)
    elif method.finetuning == "oft":
        add_oft(model, method.oft)
    freeze_parts(model, method)


def add_oft(model: CausalModel, section: OFTSection) -> list[str]:
    """Wrap the targeted linears of the decoder blocks in OFT adapters (`all`: as LoRA's `all` takes them);
    everything else is frozen. Returns the wrapped names."""
    for param in model.parameters():
        param.requires_grad_(False)
    model_type = model_type_of(model.config.family)
    refuse_measured(model_type, "lora")  # the generic families whose adapted forward was measured wrong
    every, left_out = section.targets == "all", not_for_peft(model_type)
    targets = _without(LINEAR_TARGETS, every, model.config.family, left_out) if left_out else LINEAR_TARGETS
    targets = targets if every else tuple(section.targets)
    wrapped = []
    for name, module in list(model.named_modules()):
        if (
            not (model.canonical_name(name).startswith("layers.") and adaptable(module))
            or type(module) is Conv1D
        ):
            continue  # as LoRA's `all` takes them (a router returning a tuple is no plain linear); no Conv1D
        parent_name, _, leaf = name.rpartition(".")
        if leaf in targets or (every and not model.native_names and leaf not in left_out):
            terms = 5 if section.cayley_neumann else None
            setattr(model.get_submodule(parent_name), leaf, OFTLinear(module, section.block_size, terms))
            wrapped.append(name)
    if not wrapped:
        raise ConfigError(f"method.oft.targets {section.targets}: no linear of the decoder blocks matches")
    return wrapped


def freeze_parts(model: CausalModel, method: MethodSection) -> None:
    """A vision-language model's parts that method.vision freezes, as LLaMA-Factory does: with full or
    freeze finetuning an unfrozen tower or projector trains whole; with LoRA an unfrozen tower takes
    adapters (`add_lora`) and its weights stay frozen, while the projector, which LoRA never reaches
    (LLaMA-Factory's `all` leaves it out), is refused unfrozen rather than silently kept frozen.
    freeze_language_model freezes the decoder's weights (and its adapters)."""
    vision = method.vision
    frozen = {"tower": vision.freeze_tower, "projector": vision.freeze_projector}
    frozen["language"] = vision.freeze_language_model
    frozen["unused"] = True  # what no output depends on (LLaVA's tower layers after its feature layer)
    frozen["newline"] = False  # LLaVA-NeXT's image_newline: as the method left it (no switch names it)
    parts = {model.config.part_of(model.canonical_name(n)) for n, _ in model.named_parameters()}
    if parts == {"language"}:
        return
    lora = method.adapters
    if lora and not vision.freeze_projector:
        raise ConfigError(
            "method.finetuning=lora with method.vision.freeze_projector=false: LoRA does not reach the "
            "projector (LLaMA-Factory's lora_target all leaves it out, so it would stay frozen there); "
            "keep freeze_projector true, or train it whole with finetuning full / freeze"
        )
    for name, param in model.named_parameters():
        part = model.config.part_of(model.canonical_name(name))
        if frozen[part]:
            param.requires_grad_(False)
        elif part in ("tower", "projector") and not lora:
            param.requires_grad_(True)
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(
            "method.vision freezes every part this method trains (the tower, the projector and the language "
            "model): set one of freeze_tower / freeze_projector / freeze_language_model false"
        )


def freeze(model: CausalModel, section: FreezeSection) -> None:
    trainable = trainable_layers(model.config.num_layers, section)
    for name, param in model.named_parameters():
        parts = model.canonical_name(name).split(".")  # the generic backend's names, as ours are spelled
        in_layer = parts[0] == "layers" and int(parts[1]) in trainable
        param.requires_grad_(in_layer or parts[0] in section.extra_modules)


def trainable_layers(total: int, section: FreezeSection) -> set[int]:
    """The last N layers (negative N: the first N); with llama_pro, as LLaMA-Factory picks a LLaMA Pro
    model's added blocks: the last of each run of total / N layers."""
    n = section.trainable_layers
    if not section.llama_pro:
        return set(range(total - n, total) if n >= 0 else range(-n))
    if total % n:
        raise ConfigError(
            f"method.freeze.llama_pro: the model's {total} layers are not a multiple of "
            f"trainable_layers={n}; give the number of blocks `shardforge expand` added to this model"
        )
    stride = total // n
    return set(range(stride - 1, total, stride))


def add_lora(
    model: CausalModel, section: LoraSection, seed: int, tower: bool | frozenset[str] = False
) -> list[str]:
    """Wrap the targeted linears; returns their names. Base weights (and everything else) are frozen.
    `tower`: a vision-language model's tower takes adapters too (LLaMA-Factory's LoRA with
    freeze_vision_tower false): every linear of it under `all` (its patch embedding is a convolution),
    else those whose names are targets (CLIP's q_proj, ...); or exactly the named ones (a saved
    adapter's)."""
    for param in model.parameters():
        param.requires_grad_(False)
    generic = not model.native_names  # the generic backend: transformers' module names
    every = section.targets == "all"
    targets = LINEAR_TARGETS if every else tuple(t for t in section.targets if t not in EXPERT_TARGETS)
    experts = () if every else tuple(t for t in section.targets if t in EXPERT_TARGETS)
    model_type = model_type_of(model.config.family)
    refuse_measured(model_type, "lora")
    left_out = not_for_peft(model_type)
    if left_out:
        targets = _without(targets, every, model.config.family, left_out)
    linears = [  # the blocks' linears LoRA can wrap
        (name, module)
        for name, module in model.named_modules()
        if model.canonical_name(name).startswith("layers.") and adaptable(module)
    ]
    named = tower if isinstance(tower, frozenset) else None
    in_tower = {
        name: module
        for name, module in model.named_modules()
        if tower and adaptable(module) and model.config.part_of(model.canonical_name(name)) == "tower"
        and (named is None or name in named)
    }  # fmt: skip
    wrapped = []
    for name, module in linears + list(in_tower.items()):
        parent_name, _, leaf = name.rpartition(".")
        # `all` on the generic backend: every linear of the blocks (PEFT's all-linear; e.g. Phi-3's qkv_proj)
        everything = every and (generic or name in in_tower)
        chosen = named is not None and name in in_tower
        if leaf not in targets and not (everything and leaf not in left_out) and not chosen:
            continue
        pissa = section.pissa_iter if section.init == "pissa" else None
        lora = LoRALinear(
            module, section.rank, section.alpha, section.dropout, section.dora, section.rslora, pissa
        )
        lora.reset_adapter(name, seed)
        setattr(model.get_submodule(parent_name), leaf, lora)
        wrapped.append(name)
    if experts:
        wrapped += _adapt_experts(model, section, seed, experts)
    if tower is True and in_tower and not in_tower.keys() & set(wrapped):
        held = sorted({name.rpartition(".")[2] for name in in_tower})
        raise ConfigError(
            f"method.vision.freeze_tower=false with method.lora.targets ({', '.join(targets)}): no linear of "
            f"the vision tower is a target, so it would not train; its linears are {', '.join(held)} "
            f"(targets: all takes them), or keep freeze_tower true"
        )
    if not wrapped:
        held = sorted({name.rpartition(".")[2] for name, _ in linears})
        asked = "all" if every else ", ".join(targets)
        raise ConfigError(
            f"method.lora.targets ({asked}) match no linear of the {model.config.family} layers this process "
            f"holds; their linears are: {', '.join(held) or 'none'}"
        )
    return wrapped


def _adapt_experts(
    model: CausalModel, section: LoraSection, seed: int, targets: tuple[str, ...]
) -> list[str]:
    """A ParamLoRA on each named 3-D weight of every `experts` module the blocks hold (the sparse layers)."""
    names = [t.removeprefix("experts.") for t in targets]
    owners = [
        (name, module)
        for name, module in model.named_modules()
        if model.canonical_name(name).startswith("layers.") and name.rpartition(".")[2] == "experts"
    ]
    adapted = []
    for owner_name, owner in owners:
        held = [p for p, param in owner.named_parameters(recurse=False) if p in names and param.ndim == 3]
        if held != [p for p in EXPERT_PARAMS if p in held]:
            raise ConfigError(
                f"method.lora.targets: {owner_name} registers {', '.join(held)} in an order peft would nest "
                "otherwise; adapt one of them"
            )
        for param_name in held:
            lora = ParamLoRA(owner.get_parameter(param_name), param_name, section.rank, section.alpha,
                             section.rslora, is_transposed(owner))  # fmt: skip
            lora.reset_adapter(f"{owner_name}.{param_name}", seed)
            lora.attach(owner)
            adapted.append(f"{owner_name}.{param_name}")
    held_layers = {model.canonical_name(n).split(".")[1] for n, _ in model.named_modules()
                   if model.canonical_name(n).startswith("layers.")}  # fmt: skip
    if not adapted and len(held_layers) == model.config.num_layers:  # (a pipeline stage may hold dense ones)
        raise ConfigError(
            f"method.lora.targets ({', '.join(targets)}): the {model.config.family} layers have no fused "
            "experts (a 3-D gate_up_proj / down_proj under an experts module)"
        )
    return adapted


def _without(targets: tuple[str, ...], every: bool, family: str, left_out: dict[str, str]) -> tuple[str, ...]:
    """`targets` less the names peft would not read back as adapted (peft_names.py): `all` adapts the other
    linears (attention's), and naming one of them is refused, saying why."""
    named = [t for t in targets if t in left_out]
    if named and not every:
        reasons = "; ".join(f"{t}: {left_out[t]}" for t in named)
        raise ConfigError(
            f"method.lora.targets on {family}: {reasons}; adapt the other linears (what targets: all adapts "
            "on this family)"
        )
    return tuple(t for t in targets if t not in left_out)


def adaptable(module: nn.Module) -> bool:
    """A linear LoRA can wrap: an nn.Linear computing x W^T + b (its own class, or a subclass that only
    writes that map out again: AFFINE_LINEARS) or transformers' Conv1D (GPT-2's x W + b, which peft wraps
    too), not an adapted one already."""
    if type(module) is Conv1D:
        return True
    if not isinstance(module, nn.Linear) or isinstance(module, LoRALinear):
        return False
    return type(module).forward is nn.Linear.forward or type(module).__name__ in AFFINE_LINEARS
