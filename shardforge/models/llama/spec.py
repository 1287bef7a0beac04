"""Register the Llama-family specs: one model class, seven HF flavours (three of them mixtures of experts,
whose MLP factory, config fields and expert keys come from moe_adapter)."""

from __future__ import annotations

from functools import partial

from shardforge.models.common.costs import costs
from shardforge.models.llama import hf_adapter, moe_adapter
from shardforge.models.llama.model import Decoder
from shardforge.models.llama.plan import tensor_parallel_plan
from shardforge.models.spec import ModelSpec, register

_FAMILIES = {  # model_type: (architecture, a mixture of experts)
    "llama": ("LlamaForCausalLM", False),
    "mistral": ("MistralForCausalLM", False),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
    "mixtral": ("MixtralForCausalLM", True),
    "qwen2_moe": ("Qwen2MoeForCausalLM", True),
    "qwen3_moe": ("Qwen3MoeForCausalLM", True),
}

for _family, (_arch, _moe) in _FAMILIES.items():
    _adapter = moe_adapter if _moe else hf_adapter
    register(
        ModelSpec(
            name=_family,
            model_type=_family,
            architecture=_arch,
            model_cls=Decoder,
            config_from_hf=partial(_adapter.config_from_hf, family=_family),
            hf_config_from=partial(_adapter.hf_config_from, model_type=_family, architecture=_arch),
            key_to_hf=_adapter.key_to_hf,
            key_from_hf=partial(moe_adapter.key_from_hf, family=_family) if _moe else hf_adapter.key_from_hf,
            costs=costs,
            tp_plan=tensor_parallel_plan,
            mlp=moe_adapter.moe_mlp if _moe else None,
            split_to_hf=partial(moe_adapter.tensors_to_hf, family=_family) if _moe else None,
        )
    )
