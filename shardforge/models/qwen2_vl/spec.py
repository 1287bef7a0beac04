"""Register Qwen2-VL: our decoder with transformers' vision tower (model.py)."""

from __future__ import annotations

from functools import partial

from shardforge.models.common.costs import costs
from shardforge.models.llama.plan import tensor_parallel_plan
from shardforge.models.qwen2_vl import hf_adapter
from shardforge.models.qwen2_vl.model import VisionLanguageDecoder
from shardforge.models.spec import ModelSpec, register

register(
    ModelSpec(
        name="qwen2_vl",
        model_type="qwen2_vl",
        architecture="Qwen2VLForConditionalGeneration",
        model_cls=VisionLanguageDecoder,
        config_from_hf=hf_adapter.config_from_hf,
        hf_config_from=partial(
            hf_adapter.hf_config_from, model_type="qwen2_vl", architecture="Qwen2VLForConditionalGeneration"
        ),
        key_to_hf=hf_adapter.key_to_hf,
        key_from_hf=hf_adapter.key_from_hf,
        costs=costs,
        tp_plan=tensor_parallel_plan,
        runtime_module=hf_adapter.runtime_module,
    )
)
