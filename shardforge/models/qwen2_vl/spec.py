"""Register Qwen2-VL, Qwen2.5-VL and Qwen3-VL: our decoder with transformers' vision tower of each
(model.py)."""

from __future__ import annotations

from functools import partial

from shardforge.models.llama.plan import vision_language_plan
from shardforge.models.llama.vision import vision_language_costs
from shardforge.models.qwen2_vl import hf_adapter
from shardforge.models.qwen2_vl.model import Qwen2VLDecoder
from shardforge.models.spec import ModelSpec, register

for _type, _arch in (
    ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    ("qwen3_vl", "Qwen3VLForConditionalGeneration"),
):
    _qwen3 = _type == "qwen3_vl"
    register(
        ModelSpec(
            name=_type,
            model_type=_type,
            architecture=_arch,
            model_cls=Qwen2VLDecoder,
            config_from_hf=partial(hf_adapter.config_from_hf, text="qwen3" if _qwen3 else "qwen2"),
            hf_config_from=partial(hf_adapter.hf_config_from, model_type=_type, architecture=_arch),
            key_to_hf=hf_adapter.runtime_key_to_hf if _qwen3 else hf_adapter.key_to_hf,
            key_from_hf=hf_adapter.key_from_hf,
            costs=partial(vision_language_costs, Qwen2VLDecoder),
            tp_plan=partial(vision_language_plan, towers=("visual",)),
            runtime_module=hf_adapter.runtime_module,
        )
    )
