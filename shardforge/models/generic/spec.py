"""The generic backend's ModelSpec: any causal LM transformers provides (`model.backend: hf`, or `auto` for a
model_type with no native family). Keys are transformers' own under the wrapper's `hf.` prefix; the cost
model counts the built model's parameters exactly and takes FLOPs and activation bytes from the Llama
family's formulas over the same shape (an approximation for families whose blocks differ)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from shardforge.models.common.costs import costs as llama_costs
from shardforge.models.generic.config import PREFIX, GenericConfig, config_from_hf, hf_config_from
from shardforge.models.generic.model import HFCausalLM
from shardforge.models.generic.plan import tensor_parallel_plan
from shardforge.models.generic.verified import MEASURED
from shardforge.models.generic.vision import generic_model
from shardforge.models.spec import CostModel, ModelSpec, ParamCounts, register_generic

log = logging.getLogger(__name__)
_KEY_PREFIX = "hf."
_COUNTS: dict[str, ParamCounts] = {}


def key_to_hf(key: str) -> str:
    return key.removeprefix(_KEY_PREFIX)


def key_from_hf(key: str) -> str:
    return _KEY_PREFIX + key


def generic_families() -> int:
    """How many model_types transformers has a causal LM for (the generic backend can run them)."""
    return len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def provides(model_type: str | None) -> bool:
    """Whether transformers has a causal LM class for this model_type."""
    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def costs(cfg: GenericConfig) -> CostModel:
    """The Llama formulas over this shape, with the parameter counts of the model itself; a
    vision-language family's tower and projector as native families count theirs
    (models/llama/vision.py): two FLOPs per weight for every patch through the tower and per image token
    through the projector, and what each tower layer keeps for backward per patch."""
    counts = _counts(cfg)
    out = dataclasses.replace(llama_costs(cfg), params=counts)
    if not cfg.takes_images:
        return out
    vision = cfg.hf.vision_config
    patches_per_token = cfg.planned_patches(0) / cfg.tokens_per_image
    projector = counts.vision - counts.tower
    kept = vision.num_hidden_layers * (12 * vision.hidden_size + 3 * vision.intermediate_size)
    return dataclasses.replace(
        out,
        patch_flops=2.0 * counts.tower + 2.0 * projector / patches_per_token,
        patch_activations=kept + 3 * vision.hidden_size + 2 * cfg.hidden_size / patches_per_token,
    )


def _counts(cfg: GenericConfig) -> ParamCounts:
    """Parameters by group of the model built on the meta device: the embedding, each decoder layer's
    attention / MLP / the rest (norms), what lies between the last layer and the head (the final norm) and an
    untied head."""
    key = cfg.hf.to_json_string()  # built once per shape (the planner asks many times)
    cached = _COUNTS.get(key)
    if cached is not None:
        return cached
    with torch.device("meta"):
        model = generic_model(cfg)
    blocks = model.blocks()
    attention, mlp, norms = [], [], []
    in_blocks = set()
    for block in blocks:
        a = m = n = 0
        for name, p in block.named_parameters():
            in_blocks.add(id(p))
            if "attn" in name or "attention" in name:
                a += p.numel()
            elif "mlp" in name or "feed_forward" in name or "ffn" in name:
                m += p.numel()
            else:
                n += p.numel()
        attention.append(a)
        mlp.append(m)
        norms.append(n)
    embed = model.embed_tokens.weight
    head = model.lm_head.weight
    parts = {name: cfg.part_of(model.canonical_name(name)) for name, _ in model.named_parameters()}
    tower = sum(p.numel() for name, p in model.named_parameters() if parts[name] in ("tower", "unused"))
    vision = tower + sum(p.numel() for name, p in model.named_parameters() if parts[name] == "projector")
    rest = sum(
        p.numel()
        for name, p in model.named_parameters()
        if id(p) not in in_blocks and p is not embed and p is not head and parts[name] == "language"
    )
    counts = ParamCounts(
        embedding=embed.numel(),
        attention=tuple(attention),
        mlp=tuple(mlp),
        norms=tuple(norms),
        final_norm=rest,
        head=0 if head is embed else head.numel(),
        vision=vision,
        tower=tower,
    )
    _COUNTS[key] = counts
    return counts


def load_folder(folder: Path, cfg: GenericConfig, dtype: torch.dtype, device: Any) -> HFCausalLM:
    """The folder's weights read by transformers, in `dtype` on `device`."""
    if cfg.model_type not in MEASURED:
        log.warning(
            "model_type %r was not measured by benchmarks/family_sweep.py (docs/families.md): its logits and "
            "training are transformers' own, but nothing here checked them; packing is off and the engine "
            "recomputes",
            cfg.model_type,
        )
    return generic_model(cfg, pretrained=folder).to(dtype=dtype, device=device)


def save_folder(model: HFCausalLM, folder: Path, tensors: dict[str, torch.Tensor], max_bytes: int) -> None:
    """Weights written by transformers (its reverse conversions: fused experts back to per-expert keys);
    `tensors` are the whole model's under transformers' in-memory names."""
    inner = model.hf if isinstance(model, HFCausalLM) else model.module.hf
    inner.save_pretrained(folder, state_dict=tensors, max_shard_size=max_bytes, safe_serialization=True)


GENERIC = ModelSpec(
    name="hf",
    model_type=PREFIX.rstrip(":"),
    architecture="AutoModelForCausalLM",
    model_cls=generic_model,
    config_from_hf=config_from_hf,
    hf_config_from=hf_config_from,
    key_to_hf=key_to_hf,
    key_from_hf=key_from_hf,
    costs=costs,
    tp_plan=tensor_parallel_plan,
    load_folder=load_folder,
    save_folder=save_folder,
)
register_generic(GENERIC, provides)
