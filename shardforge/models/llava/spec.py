"""Register LLaVA (1.5) and LLaVA-NeXT (1.6): our decoder with transformers' vision tower and projector
(model.py; next.py: images of any resolution, in tiles)."""

from __future__ import annotations

from functools import partial

from shardforge.models.llama.plan import vision_language_plan
from shardforge.models.llama.vision import vision_language_costs
from shardforge.models.llava import hf_adapter
from shardforge.models.llava.model import LlavaDecoder
from shardforge.models.llava.next import LlavaNextDecoder
from shardforge.models.spec import ModelSpec, register

register(
    ModelSpec(
        name="llava",
        model_type="llava",
        architecture="LlavaForConditionalGeneration",
        model_cls=LlavaDecoder,
        config_from_hf=hf_adapter.config_from_hf,
        hf_config_from=partial(
            hf_adapter.hf_config_from, model_type="llava", architecture="LlavaForConditionalGeneration"
        ),
        key_to_hf=hf_adapter.key_to_hf,
        key_from_hf=hf_adapter.key_from_hf,
        costs=partial(vision_language_costs, LlavaDecoder),
        tp_plan=partial(vision_language_plan, towers=("vision_tower", "multi_modal_projector")),
        runtime_module=hf_adapter.runtime_module,
    )
)

register(
    ModelSpec(
        name="llava_next",
        model_type="llava_next",
        architecture="LlavaNextForConditionalGeneration",
        model_cls=LlavaNextDecoder,
        config_from_hf=hf_adapter.next_config_from_hf,
        hf_config_from=partial(
            hf_adapter.hf_config_from,
            model_type="llava_next",
            architecture="LlavaNextForConditionalGeneration",
        ),
        key_to_hf=hf_adapter.key_to_hf,
        key_from_hf=hf_adapter.key_from_hf,
        costs=partial(vision_language_costs, LlavaNextDecoder),
        tp_plan=partial(vision_language_plan, towers=LlavaNextDecoder.TOWERS),
        runtime_module=hf_adapter.runtime_module,
    )
)
