"""Hugging Face <-> shardforge for Qwen2-VL, Qwen2.5-VL and Qwen3-VL: the decoder's config and keys are
Qwen2's (Qwen3's for Qwen3-VL; models/llama's adapter, on config.json's text_config); the tower's keys are
transformers' own under `visual.`. Qwen2-VL checkpoints spell the decoder `model.layers...` (as published,
and as transformers writes them) or `model.language_model.layers...` (some re-saved ones), and the tower
`visual...` or `model.visual...`; Qwen3-VL's are published in the latter spelling, and written back so."""

from __future__ import annotations

from transformers import PretrainedConfig

from shardforge.models.llama import hf_adapter
from shardforge.models.qwen2_vl.model import VisionLanguageConfig

TOWER = "visual."


def key_to_hf(key: str) -> str:
    return key if key.startswith(TOWER) else hf_adapter.key_to_hf(key)


def runtime_key_to_hf(key: str) -> str:
    """Qwen3-VL's spelling: transformers' model's own names (model.language_model.*, model.visual.*)."""
    hf = key_to_hf(key)
    if hf.startswith(TOWER):
        return "model." + hf
    return "model.language_model." + hf.removeprefix("model.") if hf.startswith("model.") else hf


def key_from_hf(key: str) -> str:
    key = key.replace("model.language_model.", "model.", 1).replace("model.visual.", TOWER, 1)
    return key if key.startswith(TOWER) else hf_adapter.key_from_hf(key)


def runtime_module(hf_module: str) -> str:
    """Where transformers' Qwen2VLForConditionalGeneration holds a checkpoint's module (peft's names);
    Qwen3-VL's are spelled so already."""
    if hf_module.startswith(("model.language_model.", "model.visual.")):
        return hf_module
    if hf_module.startswith("model."):
        return "model.language_model." + hf_module.removeprefix("model.")
    return "model." + hf_module if hf_module.startswith(TOWER) else hf_module


def config_from_hf(hf: PretrainedConfig, text: str = "qwen2") -> VisionLanguageConfig:
    """`text` qwen3: Qwen3-VL's, a Qwen3 decoder (q/k norms), interleaved M-RoPE sections and the tower's
    deepstack features."""
    qwen3 = text == "qwen3"
    default = [24, 20, 20] if qwen3 else [16, 24, 24]
    sections = (hf.text_config.rope_parameters or {}).get("mrope_section", default)
    return VisionLanguageConfig(
        **hf_adapter.decoder_fields(hf, text),
        image_token_id=hf.image_token_id,
        vision_start_token_id=hf.vision_start_token_id,
        vision_end_token_id=hf.vision_end_token_id,
        mrope_section=tuple(sections),
        mrope_interleaved=qwen3,
        deepstack=len(hf.vision_config.deepstack_visual_indexes) if qwen3 else 0,
        vision=hf.vision_config.to_dict(),
    )


def hf_config_from(cfg: VisionLanguageConfig, model_type: str, architecture: str) -> PretrainedConfig:
    """The checkpoint's config with the decoder's shape (and M-RoPE's sections) in its text_config."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta, "mrope_section": list(cfg.mrope_section)}
    if cfg.mrope_interleaved:
        rope["mrope_interleaved"] = True
    text = "qwen3" if cfg.qk_norm else "qwen2"
    return hf_adapter.with_text_config(cfg, model_type, architecture, text, {"rope_parameters": rope})
