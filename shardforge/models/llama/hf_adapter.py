"""Hugging Face <-> shardforge for the Llama family: config translation and safetensors key names.

transformers' own config classes resolve each family's defaults (head_dim, layer_types, rope parameters), so
we read config.json through them and translate the result; on export we write a config of the same class back.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import replace
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from shardforge.errors import ModelError
from shardforge.models.common.config import DecoderConfig
from shardforge.models.llama.rope import SUPPORTED_ROPE_TYPES

# Our module names differ from HF's only in these path segments; everything but lm_head lives under "model.".
_SEGMENTS = [
    (".input_norm.", ".input_layernorm."),
    (".post_attn_norm.", ".post_attention_layernorm."),
    (".attn.", ".self_attn."),
]
_OUR_KEY = re.compile(
    r"^(embed_tokens\.weight|norm\.weight|lm_head\.weight|layers\.\d+\.(input_norm|post_attn_norm)\.weight"
    r"|layers\.\d+\.attn\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)\.(weight|bias)"
    r"|layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)\.(weight|bias))$"
)


def key_to_hf(key: str) -> str:
    if not _OUR_KEY.match(key):
        raise ModelError(f"no HF name for weight {key!r}")
    if key == "lm_head.weight":
        return key
    for ours, hf in _SEGMENTS:
        key = key.replace(ours, hf)
    return "model." + key


def key_from_hf(key: str) -> str:
    if key == "score.weight":  # a sequence-classification (reward) model's head
        return "lm_head.weight"
    ours = key.removeprefix("model.") if key != "lm_head.weight" else key
    for mine, hf in _SEGMENTS:
        ours = ours.replace(hf, mine)
    if not _OUR_KEY.match(ours) or (ours != "lm_head.weight" and not key.startswith("model.")):
        raise ModelError(f"checkpoint weight {key!r} is not part of this model family (unexpected key)")
    return ours


def _rope(hf: PretrainedConfig) -> tuple[float, dict | None]:
    params = dict(getattr(hf, "rope_parameters", None) or {})
    theta = float(params.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ModelError(
            f"rope type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    return theta, (params if kind != "default" else None)


# The dense family whose attention and config rules a mixture-of-experts family shares.
ATTENTION_OF = {"mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3"}


def config_from_hf(hf: PretrainedConfig, family: str) -> DecoderConfig:
    """Translate a transformers config of a supported family into our DecoderConfig (the MoE fields are
    the MoE adapter's, models/llama/moe_adapter.py)."""
    flavour = ATTENTION_OF.get(family, family)
    act = getattr(hf, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ModelError(f"hidden_act {act!r} is not supported (supported: silu)")
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    theta, scaling = _rope(hf)
    attention_bias = bool(getattr(hf, "attention_bias", False))
    sliding = getattr(hf, "sliding_window", None)
    if flavour in ("qwen2", "qwen3") and not getattr(hf, "use_sliding_window", False):
        sliding = None
    scores = any(a.endswith("ForSequenceClassification") for a in getattr(hf, "architectures", None) or [])
    return DecoderConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        rms_eps=hf.rms_norm_eps,
        rope_theta=theta,
        rope_scaling=scaling,
        max_position=hf.max_position_embeddings,
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)) and not scores,
        qkv_bias=bool(getattr(hf, "qkv_bias", flavour == "qwen2")) or attention_bias,
        o_bias=flavour in ("llama", "qwen3") and attention_bias,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        qk_norm=flavour == "qwen3",
        sliding_window=sliding,
        layer_types=list(hf.layer_types)
        if sliding is not None and getattr(hf, "layer_types", None)
        else None,
        family=family,
        num_labels=hf.num_labels if scores else 0,
        hf_config=hf.to_dict(),
    )


def hf_config_from(cfg: DecoderConfig, model_type: str, architecture: str) -> PretrainedConfig:
    """A transformers config for our model; starts from the loaded checkpoint's config when there is one."""
    flavour = ATTENTION_OF.get(model_type, model_type)
    base = dict(cfg.hf_config)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {})}
    base.update(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_eps,
        rope_parameters=rope,
        max_position_embeddings=cfg.max_position,
        tie_word_embeddings=cfg.tie_embeddings,
        architectures=[architecture],
    )
    if flavour in ("llama", "qwen3"):
        base["attention_bias"] = cfg.o_bias or (cfg.qkv_bias and flavour == "qwen3")
    if model_type == "llama":
        base["mlp_bias"] = cfg.mlp_bias
    if flavour == "mistral":
        base["sliding_window"] = cfg.sliding_window
    if model_type == "qwen2_moe":
        base["qkv_bias"] = cfg.qkv_bias
    if flavour in ("qwen2", "qwen3"):
        base["use_sliding_window"] = cfg.sliding_window is not None
        base["sliding_window"] = cfg.sliding_window
        base["layer_types"] = [
            "sliding_attention" if cfg.is_sliding(i) else "full_attention" for i in range(cfg.num_layers)
        ]
    for key in ("model_type", "transformers_version", "rope_theta", "rope_scaling", "id2label", "label2id"):
        base.pop(key, None)
    if cfg.num_labels:  # a score head: transformers' sequence-classification class of the family
        base.update(
            num_labels=cfg.num_labels,
            architectures=[architecture.replace("CausalLM", "SequenceClassification")],
        )
    return AutoConfig.for_model(model_type, **base)


TEXT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def with_text_config(
    cfg: DecoderConfig, model_type: str, architecture: str, text_type: str, text: dict[str, Any]
) -> PretrainedConfig:
    """A vision-language checkpoint's config (the loaded one, `cfg.hf_config`) with the decoder's shape
    written back into its text_config (a `text_type` config, with `text`'s entries on top)."""
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}[text_type]  # fmt: skip
    original = cfg.hf_config.get("text_config", {})
    text_dict = hf_config_from(
        replace(cfg, hf_config=original), model_type=text_type, architecture=arch
    ).to_dict()
    for key in ("architectures", "transformers_version", "tie_word_embeddings"):
        text_dict.pop(key, None)
    text_dict.pop("model_type", None)
    if "model_type" in original:  # the checkpoint's own text model type (e.g. qwen3_vl_text)
        text_dict["model_type"] = original["model_type"]
    base = {k: v for k, v in cfg.hf_config.items() if k not in ("model_type", "transformers_version")}
    base.update(
        text_config={**text_dict, **text},
        architectures=[architecture],
        tie_word_embeddings=cfg.tie_embeddings,
    )
    return AutoConfig.for_model(model_type, **base)


def decoder_fields(hf: PretrainedConfig, text_family: str) -> dict[str, Any]:
    """A vision-language checkpoint's decoder as our DecoderConfig's fields (its text_config read as
    `text_family`'s), under the checkpoint's own family and config."""
    text = config_from_hf(hf.text_config, family=text_family)
    fields = {f.name: getattr(text, f.name) for f in dataclasses.fields(DecoderConfig)}
    fields.update(family=hf.model_type, tie_embeddings=bool(hf.tie_word_embeddings), hf_config=hf.to_dict())
    return fields
