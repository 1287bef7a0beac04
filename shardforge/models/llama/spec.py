"""Register the Llama-family specs: one model class, four HF flavours."""

from __future__ import annotations

from functools import partial

from shardforge.models.llama import hf_adapter, moe_adapter
from shardforge.models.llama.costs import costs
from shardforge.models.llama.model import Decoder
from shardforge.models.llama.plan import tensor_parallel_plan
from shardforge.models.spec import ModelSpec, register

_FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

for _family, _arch in _FAMILIES.items():
    register(
        ModelSpec(
            name=_family,
            model_type=_family,
            architecture=_arch,
            model_cls=Decoder,
            config_from_hf=partial(hf_adapter.config_from_hf, family=_family),
            hf_config_from=partial(hf_adapter.hf_config_from, model_type=_family, architecture=_arch),
            key_to_hf=hf_adapter.key_to_hf,
            key_from_hf=hf_adapter.key_from_hf,
            costs=costs,
            tp_plan=tensor_parallel_plan,
        )
    )

_MOE_FAMILIES = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

for _family, _arch in _MOE_FAMILIES.items():
    register(
        ModelSpec(
            name=_family,
            model_type=_family,
            architecture=_arch,
            model_cls=Decoder,
            config_from_hf=partial(moe_adapter.config_from_hf, family=_family),
            hf_config_from=partial(moe_adapter.hf_config_from, model_type=_family, architecture=_arch),
            key_to_hf=moe_adapter.key_to_hf,
            key_from_hf=partial(moe_adapter.key_from_hf, family=_family),
            costs=costs,
            tp_plan=tensor_parallel_plan,
            mlp=moe_adapter.moe_mlp,
            split_to_hf=partial(moe_adapter.tensors_to_hf, family=_family),
        )
    )
