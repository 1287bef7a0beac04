"""Hugging Face <-> shardforge for Qwen2-VL: the decoder's config and keys are Qwen2's (models/llama's
adapter, on config.json's text_config); the tower's keys are transformers' own under `visual.`. Checkpoints
spell the decoder `model.layers...` (as published, and as transformers writes them) or
`model.language_model.layers...` (some re-saved ones), and the tower `visual...` or `model.visual...`."""

from __future__ import annotations

import dataclasses

from transformers import AutoConfig, PretrainedConfig

from shardforge.models.common.config import DecoderConfig
from shardforge.models.llama import hf_adapter
from shardforge.models.qwen2_vl.model import VisionLanguageConfig

TOWER = "visual."


def key_to_hf(key: str) -> str:
    return key if key.startswith(TOWER) else hf_adapter.key_to_hf(key)


def key_from_hf(key: str) -> str:
    key = key.replace("model.language_model.", "model.", 1).replace("model.visual.", TOWER, 1)
    return key if key.startswith(TOWER) else hf_adapter.key_from_hf(key)


def runtime_module(hf_module: str) -> str:
    """Where transformers' Qwen2VLForConditionalGeneration holds a checkpoint's module (peft's names)."""
    if hf_module.startswith("model."):
        return "model.language_model." + hf_module.removeprefix("model.")
    return "model." + hf_module if hf_module.startswith(TOWER) else hf_module


def config_from_hf(hf: PretrainedConfig) -> VisionLanguageConfig:
    text = hf_adapter.config_from_hf(hf.text_config, family="qwen2")
    fields = {f.name: getattr(text, f.name) for f in dataclasses.fields(DecoderConfig)}
    fields.update(
        family=hf.model_type,
        tie_embeddings=bool(hf.tie_word_embeddings),
        hf_config=hf.to_dict(),
    )
    sections = (hf.text_config.rope_parameters or {}).get("mrope_section", [16, 24, 24])
    return VisionLanguageConfig(
        **fields,
        image_token_id=hf.image_token_id,
        vision_start_token_id=hf.vision_start_token_id,
        vision_end_token_id=hf.vision_end_token_id,
        mrope_section=tuple(sections),
        vision=hf.vision_config.to_dict(),
    )


def hf_config_from(cfg: VisionLanguageConfig, model_type: str, architecture: str) -> PretrainedConfig:
    """The checkpoint's config with the decoder's shape written back into its text_config."""
    text = hf_adapter.hf_config_from(dataclasses.replace(cfg, hf_config=cfg.hf_config.get("text_config", {})),
                                     model_type="qwen2", architecture="Qwen2ForCausalLM")  # fmt: skip
    text_dict = text.to_dict()
    for key in ("architectures", "model_type", "transformers_version", "tie_word_embeddings"):
        text_dict.pop(key, None)
    text_dict["rope_parameters"] = {**text_dict["rope_parameters"], "mrope_section": list(cfg.mrope_section)}
    base = dict(cfg.hf_config)
    for key in ("model_type", "transformers_version"):
        base.pop(key, None)
    base.update(text_config=text_dict, vision_config=cfg.vision, architectures=[architecture],
                tie_word_embeddings=cfg.tie_embeddings, image_token_id=cfg.image_token_id)  # fmt: skip
    return AutoConfig.for_model(model_type, **base)
