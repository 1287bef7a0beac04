"""The module names an adapter cannot carry to peft, per model_type, and why (adapters/apply.py leaves them
out of `targets: all` and refuses them by name):

- on the mixtures of experts whose experts transformers 5 fuses into 3-D parameters, peft (0.21) takes an
  adapter's target_modules `gate_proj`, `up_proj`, `down_proj` (Mixtral-like: `w1`, `w2`, `w3`) and
  `gate` as the fused experts and the router of every sparse layer, whatever layer or module they name:
  an adapter on a dense layer's, a shared expert's or a router's linear would load in peft as fresh expert
  adapters, not as trained (a copy of its `utils/transformers_weight_conversion.py` tables, restricted to
  the causal LMs; not Qwen2-MoE itself, which peft leaves as it is);
- on Mamba-based models peft refuses LoRA on `out_proj` and `conv1d` (its
  `_check_lora_target_modules_mamba`).

tests/unit/test_lora.py checks both against the installed peft."""

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


MAMBA = frozenset({"falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h"})
_MAMBA_REFUSED = ("out_proj", "conv1d")


def not_for_peft(model_type: str) -> dict[str, str]:
    """The module names peft would not read back as adapted on this model_type, each with why (none on
    most)."""
    why = {name: "peft reads it as the fused experts (or the router) of every sparse layer, so the adapter "
           "would not load in peft as trained" for name in REREAD.get(model_type, ())}  # fmt: skip
    if model_type in MAMBA:
        why.update(dict.fromkeys(_MAMBA_REFUSED, "peft refuses LoRA on it on Mamba-based models"))
    return why
