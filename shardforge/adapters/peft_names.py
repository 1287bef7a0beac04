"""The module names peft reads differently from what they name, per model_type: on the mixtures of experts
whose experts transformers 5 fuses into 3-D parameters, peft (0.21) takes an adapter's target_modules
`gate_proj`, `up_proj`, `down_proj` (Mixtral-like: `w1`, `w2`, `w3`) and `gate` as the fused experts and
the router of every sparse layer, whatever layer or module they name: an adapter on a dense layer's, a
shared expert's or a router's linear would load in peft as fresh expert adapters, not as trained. LoRA
leaves these names alone on these families (adapters/apply.py). A copy of peft's own tables (its
`utils/transformers_weight_conversion.py`), restricted to the causal LMs (not Qwen2-MoE itself, which
peft leaves as it is); tests/unit/test_lora.py checks it
against the installed peft."""

from __future__ import annotations

_QWEN2_MOE = ("gate", "gate_proj", "up_proj", "down_proj")
_MIXTRAL = ("gate", "w1", "w2", "w3")

REREAD: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("minimax", "minimax_m2", "mixtral"), _MIXTRAL),
    **dict.fromkeys(
        (
            "afmoe", "beam", "cohere2_moe", "deepseek_v2", "deepseek_v3", "deepseek_v32", "dots1",
            "ernie4_5_moe", "exaone_moe", "flex_olmo", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa",
            "hunyuan_v1_moe", "longcat_flash", "mellum", "olmoe", "qwen3_moe", "qwen3_next",
            "sarvam_mla", "solar_open",
        ),
        _QWEN2_MOE,
    ),
}  # fmt: skip


def reread_by_peft(model_type: str) -> tuple[str, ...]:
    """The linear names peft reinterprets on this model_type (none on most)."""
    return REREAD.get(model_type, ())
