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

for _type, _arch, _cls, _config in (
    ("llava", "LlavaForConditionalGeneration", LlavaDecoder, hf_adapter.config_from_hf),
    ("llava_next", "LlavaNextForConditionalGeneration", LlavaNextDecoder, hf_adapter.next_config_from_hf),
):
    register(
        ModelSpec(
            name=_type,
            model_type=_type,
            architecture=_arch,
            model_cls=_cls,
            config_from_hf=_config,
            hf_config_from=partial(hf_adapter.hf_config_from, model_type=_type, architecture=_arch),
            key_to_hf=hf_adapter.key_to_hf,
            key_from_hf=hf_adapter.key_from_hf,
            costs=partial(vision_language_costs, _cls),
            tp_plan=partial(vision_language_plan, towers=_cls.TOWERS),
            runtime_module=hf_adapter.runtime_module,
        )
    )
