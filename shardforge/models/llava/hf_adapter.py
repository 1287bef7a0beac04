"""Hugging Face <-> shardforge for LLaVA: the decoder's config and keys are its text model's (models/llama's
adapter on config.json's text_config: Llama, Mistral or Qwen2); the tower's and projector's keys are
transformers' own. Checkpoints spell the decoder `language_model.model.layers...` and the head
`language_model.lm_head` (as published, and as transformers writes them), or `model.language_model...`,
`model.vision_tower...`, `lm_head` (some re-saved ones); transformers' model holds them at the latter."""

from __future__ import annotations

import dataclasses

from transformers import PretrainedConfig

from shardforge.errors import ModelError
from shardforge.models.llama import hf_adapter
from shardforge.models.llava.model import PROJECTOR, TOWER, LlavaConfig
from shardforge.models.llava.next import NEWLINE, LlavaNextConfig

TEXT_FAMILIES = tuple(
    hf_adapter.TEXT_ARCHITECTURES
)  # the language models LLaVA checkpoints use that are ours
_SAVED = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
          ("image_newline", NEWLINE))  # fmt: skip
_RUNTIME = (("model.language_model.", "model."), ("model.vision_tower.", TOWER),
            ("model.multi_modal_projector.", PROJECTOR), ("model.image_newline", NEWLINE))  # fmt: skip


def _vision_part(key: str) -> bool:
    return key.startswith((TOWER, PROJECTOR, NEWLINE))


def key_to_hf(key: str) -> str:
    if key == NEWLINE:
        return "image_newline"  # LLaVA-NeXT's, beside the tower (as published)
    if _vision_part(key):
        return key
    return "language_model." + hf_adapter.key_to_hf(key)  # language_model.model.* and language_model.lm_head


def key_from_hf(key: str) -> str:
    for spelled, ours in (*_SAVED, *_RUNTIME):
        if key.startswith(spelled):
            key = ours + key.removeprefix(spelled)
            break
    return key if _vision_part(key) else hf_adapter.key_from_hf(key)


def runtime_module(hf_module: str) -> str:
    """Where transformers' LlavaForConditionalGeneration holds a checkpoint's module (peft's names)."""
    if hf_module.startswith("language_model.model."):
        return "model.language_model." + hf_module.removeprefix("language_model.model.")
    if hf_module.startswith("language_model.lm_head"):
        return hf_module.removeprefix("language_model.")
    return "model." + hf_module if _vision_part(hf_module) else hf_module


def next_config_from_hf(hf: PretrainedConfig) -> LlavaNextConfig:
    """LLaVA-NeXT's: LLaVA's, and the resolutions its images are tiled at."""
    base = config_from_hf(hf)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    pinpoints = tuple(tuple(int(v) for v in p) for p in hf.image_grid_pinpoints)
    return LlavaNextConfig(**fields, grid_pinpoints=pinpoints)


def config_from_hf(hf: PretrainedConfig) -> LlavaConfig:
    family = hf.text_config.model_type
    if family not in TEXT_FAMILIES:
        raise ModelError(
            f"LLaVA with a {family!r} language model is not supported yet (its text model must be one of "
            f"{', '.join(TEXT_FAMILIES)})"
        )
    if not isinstance(hf.vision_feature_layer, int):
        raise ModelError("LLaVA with several vision_feature_layer values is not supported yet")
    return LlavaConfig(
        **hf_adapter.decoder_fields(hf, family),
        image_token_id=hf.image_token_id,
        feature_layer=hf.vision_feature_layer,
        select=hf.vision_feature_select_strategy,
        vision=hf.vision_config.to_dict(),
    )


def hf_config_from(cfg: LlavaConfig, model_type: str, architecture: str) -> PretrainedConfig:
    """The checkpoint's config with the decoder's shape written back into its text_config."""
    family = cfg.hf_config.get("text_config", {}).get("model_type", "llama")
    return hf_adapter.with_text_config(cfg, model_type, architecture, family, {})
