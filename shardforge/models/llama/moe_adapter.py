"""Hugging Face <-> shardforge for the mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE): their
config fields, and their expert weights in both layouts that exist on disk.

Our modules keep transformers 5's fused names (models/moe.py). Published checkpoints, and what
`save_pretrained` writes by default, hold one tensor per expert and projection instead:
`block_sparse_moe.experts.N.w1/w2/w3` (Mixtral: w1 gate, w3 up, w2 down) or
`mlp.experts.N.gate_proj/up_proj/down_proj` (Qwen), and Mixtral's router under `block_sparse_moe.gate`.
Loading places each of those into its slice of our 3-D tensors (gate rows first in `gate_up_proj`); export
writes either layout (`per_expert`, the default, or `fused`), and transformers reloads both.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import replace

import torch
from transformers import PretrainedConfig

from shardforge.errors import ModelError
from shardforge.models.common.config import DecoderConfig
from shardforge.models.llama import hf_adapter
from shardforge.models.llama.model import MLP
from shardforge.models.moe import MoEShape, SparseMoE
from shardforge.models.spec import Slot

_PROJECTIONS = {  # per-expert names: (gate, up, down)
    "mixtral": ("w1", "w3", "w2"),
    "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
    "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
}
_OURS = re.compile(
    r"^layers\.(\d+)\.mlp\.(gate\.weight|gate\.bias|experts\.gate_up_proj|experts\.down_proj"
    r"|shared_expert\.(gate_proj|up_proj|down_proj)\.weight|shared_expert_gate\.weight)$"
)
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_HF_MOE = re.compile(
    r"^model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj"
    r"|shared_expert\.(gate_proj|up_proj|down_proj)\.weight|shared_expert_gate\.weight)$"
)


def moe_mlp(cfg: DecoderConfig, layer: int) -> torch.nn.Module:
    """The block MLP of an MoE family: sparse where the config says, dense elsewhere."""
    if not cfg.is_moe(layer):
        return MLP(cfg)
    shape = MoEShape(
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        cfg.num_experts,
        cfg.experts_per_token,
        cfg.norm_topk_prob,
        cfg.shared_expert_intermediate_size,
    )
    return SparseMoE(shape)


def config_from_hf(hf: PretrainedConfig, family: str) -> DecoderConfig:
    cfg = hf_adapter.config_from_hf(hf, family)
    if float(getattr(hf, "router_jitter_noise", 0.0) or 0.0):
        raise ModelError(
            f"router_jitter_noise={hf.router_jitter_noise}: the router's training noise is not supported; "
            f"set it to 0.0 in config.json"
        )
    layers = hf.num_hidden_layers
    if family == "mixtral":
        experts, width, dense = hf.num_local_experts, hf.intermediate_size, []
        renormalize, shared = True, 0
    else:
        experts = getattr(hf, "num_experts", None) or hf.num_local_experts
        width, renormalize = hf.moe_intermediate_size, bool(hf.norm_topk_prob)
        shared = int(getattr(hf, "shared_expert_intermediate_size", 0) or 0) if family == "qwen2_moe" else 0
        only_dense, step = set(hf.mlp_only_layers or []), hf.decoder_sparse_step
        dense = [i for i in range(layers) if i in only_dense or experts == 0 or (i + 1) % step != 0]
    return replace(
        cfg,
        num_experts=experts,
        experts_per_token=hf.num_experts_per_tok,
        moe_intermediate_size=width,
        norm_topk_prob=renormalize,
        shared_expert_intermediate_size=shared,
        dense_layers=dense,
        router_aux_loss_coef=float(hf.router_aux_loss_coef),
    )


def hf_config_from(cfg: DecoderConfig, model_type: str, architecture: str) -> PretrainedConfig:
    hf = hf_adapter.hf_config_from(cfg, model_type, architecture)
    fields: dict = {
        "num_experts_per_tok": cfg.experts_per_token,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
    }
    if model_type == "mixtral":
        fields.update(num_local_experts=cfg.num_experts, intermediate_size=cfg.moe_intermediate_size)
    else:
        fields.update(
            num_experts=cfg.num_experts,
            moe_intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=list(cfg.dense_layers),
        )
        if model_type == "qwen2_moe":
            fields["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    for key, value in fields.items():
        setattr(hf, key, value)
    return hf


def key_from_hf(key: str, family: str) -> str | Slot:
    """Our parameter (and slice of it) for an HF key of either layout."""
    expert = _HF_EXPERT.match(key)
    if expert:
        layer, _, e, proj = expert.groups()
        gate, up, down = _PROJECTIONS[family]
        base = f"layers.{layer}.mlp.experts."
        if proj in (gate, up):  # the gate's rows first, then the up projection's
            return Slot(base + "gate_up_proj", (int(e),), (0 if proj == gate else 1, 2))
        if proj == down:
            return Slot(base + "down_proj", (int(e),))
        raise ModelError(f"checkpoint weight {key!r}: unknown expert projection {proj!r} for {family}")
    moe = _HF_MOE.match(key)
    if moe:
        return f"layers.{moe.group(1)}.mlp.{moe.group(3)}"
    return hf_adapter.key_from_hf(key)


def key_to_hf(key: str) -> str:
    """The fused layout's name of one of our parameters (export splits experts with `tensors_to_hf`)."""
    moe = _OURS.match(key)
    if moe:
        return f"model.{key}"
    return hf_adapter.key_to_hf(key)


def tensors_to_hf(key: str, tensor: torch.Tensor, layout: str, family: str) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors for one of ours: an expert tensor split per expert in the per-expert layout (under
    Mixtral's `block_sparse_moe`, which also holds its router); the expert-choice bias stays ours."""
    moe = _OURS.match(key)
    layer, name = moe.groups()[:2] if moe else (None, None)
    if moe is None or (layout == "fused" and name != "gate.bias"):
        return [(key_to_hf(key), tensor)]
    if name == "gate.bias":  # transformers' Mixtral / Qwen MoE routers have no expert bias
        if tensor.abs().max() > 0:
            warnings.warn(
                f"layer {layer}'s router has a trained expert bias (method.moe.balance: bias), which "
                f"transformers' {family} has no place for: the exported folder chooses experts without it "
                f"(shardforge's own checkpoints keep it)",
                stacklevel=2,
            )
        return []
    block = f"model.layers.{layer}.{'block_sparse_moe' if family == 'mixtral' else 'mlp'}"
    gate, up, down = _PROJECTIONS[family]
    if name == "experts.gate_up_proj":  # per expert: the gate's rows, then the up projection's
        out = []
        for e, weight in enumerate(tensor):
            first, second = weight.chunk(2)
            out += [
                (f"{block}.experts.{e}.{gate}.weight", first),
                (f"{block}.experts.{e}.{up}.weight", second),
            ]
        return out
    if name == "experts.down_proj":
        return [(f"{block}.experts.{e}.{down}.weight", tensor[e]) for e in range(tensor.shape[0])]
    if name == "gate.weight":
        return [(f"{block}.gate.weight", tensor)]
    return [(key_to_hf(key), tensor)]
